"""All four callbacks together under Lightning's "ddp" and under "npu_hybrid" (2 real processes, gloo):
a NaN on one rank is skipped by every rank, and SIGTERM to one rank saves on every rank and stops them all."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch

import lightning_npu  # noqa: F401  (registers "npu_hybrid")
from lightning_npu.callbacks import DynamicCheckpoint, GradientHealthGuard, PreemptionCheckpoint, TrainingGuard
from lightning_npu.launch import spawn
from tests._callbacks_helpers import StepSeeded, flat_params, trainer_kwargs


def _run(root: str, strategy: str) -> dict:
    model = StepSeeded(nan_at=(2,), nan_ranks=(0,), signal_at=6, signal_rank=0)
    dyn = DynamicCheckpoint(dirpath=str(Path(root) / "ck"), phase_fractions=(), intervals=(4,), keep_last_k=2)
    health, guard, pre = GradientHealthGuard(), TrainingGuard(health_check_interval=2), PreemptionCheckpoint()
    trainer = L.Trainer(callbacks=[dyn, health, guard, pre],
                        **trainer_kwargs(root, 20, devices=2, strategy=strategy, log_every_n_steps=1))
    guard.fit(trainer, model)
    return {
        "rank": trainer.global_rank,
        "step": trainer.global_step,
        "before2": model.param_log[2],
        "before3": model.param_log[3],
        "final": flat_params(model),
        "state": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "actions": [e["action"] for e in health.events if e["action"] != "warn"],
        "saved": str(pre.saved_path),
        "metrics": sorted(k for k in trainer.callback_metrics if k.startswith("health/")),
    }


@pytest.mark.parametrize("strategy", ["ddp", "npu_hybrid"])
def test_callbacks_under_two_processes(tmp_path, strategy):
    r0, r1 = spawn(_run, 2, str(tmp_path), strategy)
    for r in (r0, r1):
        # the NaN was only on rank 0, yet both ranks skipped step 2 (decision all-reduced)
        torch.testing.assert_close(r["before3"], r["before2"], rtol=0, atol=0)
        assert r["actions"] == ["skip"]
        # SIGTERM reached rank 0 only; both stopped after step 6 with one checkpoint
        assert r["step"] == 7 and r["saved"].endswith("step=00000007.ckpt")
        assert "health/grad_norm" in r["metrics"] and any(m.startswith("health/rss") for m in r["metrics"])
    torch.testing.assert_close(r0["final"], r1["final"], rtol=0, atol=0)
    assert torch.isfinite(r0["final"]).all()
    assert DynamicCheckpoint.find_latest(tmp_path / "ck") == r0["saved"]
    if Path(r0["saved"]).is_dir():  # npu_hybrid writes sharded DCP directories
        from lightning_npu.parallel.checkpoint.sharded import consolidate_model_state

        state = consolidate_model_state(r0["saved"])[0]
    else:
        state = torch.load(r0["saved"], weights_only=False)["state_dict"]
    assert sorted(state) == sorted(r0["state"])
    for k, v in r0["state"].items():
        torch.testing.assert_close(state[k], v, rtol=0, atol=0)


def _rollback_run(root: str, strategy: Any = "npu_hybrid") -> dict:
    model = StepSeeded(nan_at=(5,), nan_ranks=(1,))
    dyn = DynamicCheckpoint(dirpath=str(Path(root) / "ck"), phase_fractions=(), intervals=(3,), keep_last_k=None)
    guard = GradientHealthGuard(nonfinite_action="rollback", rollback_lr_factor=0.5)
    trainer = L.Trainer(callbacks=[dyn, guard], **trainer_kwargs(root, 8, devices=2, strategy=strategy))
    trainer.fit(model)
    return {
        "log": {k: v.clone() for k, v in model.param_log.items()},
        "final": flat_params(model),
        "lr": trainer.optimizers[0].param_groups[0]["lr"],
        "optimizer": type(trainer.strategy.optimizers[0]).__name__,
        "actions": [e["action"] for e in guard.events if e["action"] != "warn"],
    }


@pytest.mark.parametrize("sharded", [True, False], ids=["directory", "file"])
def test_rollback_under_zero1_restores_the_sharded_checkpoint(tmp_path, sharded):
    """npu_hybrid's default ZeRO-1 (dp=2): a NaN on rank 1 at step 5 rolls every rank back to the step-3
    checkpoint (a DCP directory: the fp32 master slices are reloaded and all-gathered into the parameters; the
    default single file: full tensors loaded and the slices re-cut from them), with half the lr."""
    from lightning_npu import NPUHybridStrategy

    strategy = NPUHybridStrategy(save_distributed_checkpoint=True) if sharded else "npu_hybrid"
    r0, r1 = spawn(_rollback_run, 2, str(tmp_path), strategy)
    saved = tmp_path / "ck" / "step=00000003.ckpt"
    assert saved.is_dir() == sharded
    at3 = lightning_npu.load_checkpoint(saved)["state_dict"]
    at3 = torch.cat([v.flatten() for v in at3.values()])
    for r in (r0, r1):
        assert r["optimizer"] == "DistributedOptimizer" and r["actions"] == ["rollback"]
        assert not torch.equal(r["log"][5], at3)  # steps 3 and 4 had moved the weights
        torch.testing.assert_close(r["log"][6], at3, rtol=0, atol=0)
        assert r["lr"] == pytest.approx(0.025) and torch.isfinite(r["final"]).all()
    torch.testing.assert_close(r0["final"], r1["final"], rtol=0, atol=0)
