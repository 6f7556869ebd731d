"""Workers for tests/test_expert_parallel.py: a stock MoE model checkpointed under one expert-parallel size and resumed
under another, in one 2-process launch."""

from __future__ import annotations

from typing import Any, Optional

import lightning as L
from torch.utils.data import DataLoader

from lightning_npu import NPUHybridStrategy
from tests._model_zoo_workers import Case, Losses, ZooData, ZooModule, _world, run_zoo


def _fit(strategy: dict[str, Any], steps: int, save: Optional[str], load: Optional[str]) -> list[float]:
    world = _world()
    L.seed_everything(0, verbose=False)
    model, losses = ZooModule("mixtral"), Losses()
    trainer = L.Trainer(accelerator="cpu", devices=world, strategy=NPUHybridStrategy(**strategy), max_steps=steps,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[losses], num_sanity_val_steps=0, limit_val_batches=0)
    trainer.fit(model, DataLoader(ZooData("lm", size=24), batch_size=2, shuffle=False), ckpt_path=load)
    if save:
        trainer.save_checkpoint(save)
    return losses.logged


def resume_across_ep_sizes(directory: str, moe: list[str]) -> dict[str, Any]:
    """4 steps at ep=1; 2 steps at ep=2 saved (sharded and single-file), resumed for 2 at ep=1 and at ep=2; the
    same from ep=2 at ZeRO-1 (resumed at ep=1, at ep=2 ZeRO-3 and ZeRO-1). Then the `moe` models at ep=2 x ZeRO-1
    (dp=2) for the comparison against one process (``"zoo ep2 zero1"``)."""
    out: dict[str, Any] = {"whole": _fit({"zero_stage": 0}, 4, None, None)}
    for form in ("ckpt", "dir"):
        path = f"{directory}/ep2.{form}"
        sharded = {"save_distributed_checkpoint": form == "dir"}
        out[f"ep2 {form}"] = _fit({"zero_stage": 0, "expert_parallel_size": 2, **sharded}, 2, path, None)
        out[f"ep1 from {form}"] = _fit({"zero_stage": 0}, 4, None, path)
        out[f"ep2 from {form}"] = _fit({"zero_stage": 0, "expert_parallel_size": 2}, 4, None, path)
    # ZeRO-1's experts: fp32 master slices over (edp, ep), saved in ZeRO-3's layout
    out["ep2 zero1 dir"] = _fit({"zero_stage": 1, "expert_parallel_size": 2}, 2, f"{directory}/ep2z1.dir", None)
    out["ep1 from zero1 dir"] = _fit({"zero_stage": 1}, 4, None, f"{directory}/ep2z1.dir")
    out["ep2 zero3 from zero1 dir"] = _fit({"zero_stage": 3, "expert_parallel_size": 2}, 4, None,
                                           f"{directory}/ep2z1.dir")
    out["ep2 zero1 from dir"] = _fit({"zero_stage": 1, "expert_parallel_size": 2}, 4, None, f"{directory}/ep2.dir")
    # ZeRO-3's experts (FSDP2 over edp on top of the ep split: 2-D DTensors) saved as a sharded directory
    out["ep2 zero3 dir"] = _fit({"zero_stage": 3, "expert_parallel_size": 2}, 2, f"{directory}/ep2z3.dir", None)
    out["ep1 from zero3 dir"] = _fit({"zero_stage": 0}, 4, None, f"{directory}/ep2z3.dir")
    try:
        trainer_model = ZooModule("llama")
        trainer = L.Trainer(accelerator="cpu", devices=_world(), logger=False, enable_checkpointing=False,
                            strategy=NPUHybridStrategy(zero_stage=0, expert_parallel_size=2), max_steps=1,
                            enable_progress_bar=False, enable_model_summary=False)
        trainer.fit(trainer_model, DataLoader(ZooData("lm", size=4), batch_size=2))
    except Exception as err:  # noqa: BLE001 (the refusal is the result)
        out["dense model"] = f"{type(err).__name__}: {err}"
    out["zoo ep2 zero1"] = run_zoo({"expert_parallel_size": 2, "zero_stage": 1}, {m: Case(m) for m in moe})
    return out


def run_layouts(layouts: dict[str, tuple[dict[str, Any], list[str]]]) -> dict[str, Any]:
    """Every layout (strategy arguments, models) in turn, in one process group."""
    return {name: run_zoo(strategy, {m: Case(m) for m in models}) for name, (strategy, models) in layouts.items()}
