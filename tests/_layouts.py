"""One layout table and one runner for the parity checks (a torchtitan-style feature table).

A feature's parity with one process is a row here, not another Trainer builder: every row trains the same
model from the same seed on the same global batch, so a row differs from its one-process reference only in the
layout under test. Check kinds (tests/test_layouts.py):

- ``parity``: logged losses, final full state, full optimizer state (torch's format, as a single-file checkpoint
  holds it: fused projections' moments un-fused) and validation loss equal the reference's (fp32);
- ``guard``: GradientHealthGuard's ``health/grad_norm`` equals the norm clipping used, `lightning_npu.grad_norm`
  of the model's ``.grad`` and the reference's global norm (clipping active on every step);
- ``guard_loss``: ``health/loss`` equals the logged ``train_loss`` (the training loss, not loss x scale);
- ``full_state``: `lightning_npu.load_full_state_dict` round-trips through `lightning_npu.full_state_dict`;
- ``predict``: pipeline predictions equal the reference model's logits.

``expect`` holds facts about the layout itself (mesh, optimizer class, stages, tp report lines, ...).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import lightning as L
import torch
import torch.distributed as dist
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel

import lightning_npu
from lightning_npu import NPUHybridStrategy
from lightning_npu.callbacks import GradientHealthGuard
from lightning_npu.launch import spawn
from lightning_npu.parallel.checkpoint.full_state import full_optimizer_state_dict
from lightning_npu.parallel.data_parallel import wrap as data_parallel
from lightning_npu.parallel.tensor_parallel.shards import tensor_parallel_parameter_names
from tests._gpt_workers import SMALL_GPT, LossRecorder, parity_trainer
from tests._pp_workers import PP_GPT
from tests._tp_workers import _make_model
from tests._zero_workers import OptGPT

STEPS, GLOBAL_BATCH, CLIP = 5, 8, 0.5  # CLIP: below every step's global norm, so clipping is always active
DEFAULT_CHECKS = ("parity", "guard", "full_state")


@dataclass(frozen=True)
class Layout:
    name: str
    devices: int
    strategy: dict[str, Any] = field(default_factory=dict)
    precision: str = "32-true"
    checks: tuple[str, ...] = DEFAULT_CHECKS
    # over SMALL_GPT; "arch": a `transformers` model; "optimizer": tests/_zero_workers.py's OptGPT choice
    model: dict[str, Any] = field(default_factory=dict)
    accumulate: int = 1  # micro-batches per optimizer step; the global batch per step stays GLOBAL_BATCH
    clip: Optional[float] = CLIP
    expect: dict[str, Any] = field(default_factory=dict)

    def reference(self) -> Layout:
        """One process, same model, precision, clipping and batch per step: what the row must reproduce."""
        name = "-".join(["ref", self.precision, *(f"{k}={v}" for k, v in sorted(self.model.items()))]
                        + ([] if self.clip == CLIP else [f"clip={self.clip}"]))
        return Layout(name, 1, {"zero_stage": 0}, self.precision, ("predict",), self.model, clip=self.clip)

    def reference_key(self) -> tuple:
        return self.precision, tuple(sorted(self.model.items())), self.clip


PP = {"n_layer": PP_GPT["n_layer"]}  # 4 blocks: room for pp=2 x 2 virtual stages
TP2 = {"tensor_parallel_size": 2, "zero_stage": 0}
PP2 = {"pipeline_parallel_size": 2, "zero_stage": 0}
# a user plan: globs -> style names, and a DTensor ParallelStyle object (LM head gathered, no loss parallel)
DICT_PLAN = {
    "model.transformer.wte": "vocab",
    "*.attn.c_attn": "qkv",
    "*.attn.c_proj": "rowwise",
    "*.mlp.c_fc": "colwise",
    "*.mlp.c_proj": "rowwise",
    "model.lm_head": ColwiseParallel(output_layouts=Replicate()),
}
DP = dict(mesh=(1, 2, 1), local_differs=True)  # each dp rank sees different data; the logged loss is global
PIPE = DEFAULT_CHECKS + ("predict",)
# pp=2, dp=1: each rank holds only its stages (disjoint parameters, together the whole model)
PP_STAGES = dict(mesh=(2, 1, 1), disjoint_stages=True)

LAYOUTS = [
    Layout("dp2-zero0", 2, {"zero_stage": 0}, expect=dict(DP, optimizer="MixedPrecisionOptimizer")),
    Layout("dp2-zero1", 2, {"zero_stage": 1}, expect=dict(DP, optimizer="DistributedOptimizer")),
    Layout("dp2-zero3", 2, {"zero_stage": 3}, expect=dict(DP, optimizer="MixedPrecisionOptimizer")),
    # dp=2 x accumulate 2 x micro-batch 2 == 1 process x batch 8 (no gradient sync on the first micro-step)
    Layout("dp2-zero1-accumulate2", 2, {"zero_stage": 1}, accumulate=2),
    Layout("tp2-zero0", 2, TP2, expect=dict(
        mesh=(1, 1, 2), sharded=True,
        # every projection, the embedding and the head are sharded; only norms and wpe (32x32) stay whole
        local_numel_below=0.55, report=("model.transformer.h.0.attn.c_attn: qkv", "n_head 4 -> 2"))),
    Layout("tp2-zero3", 2, {**TP2, "zero_stage": 3}),
    Layout("tp2-dict-plan", 2, {**TP2, "tp_plan": DICT_PLAN}, expect=dict(sharded=True, report=("model.lm_head: custom",))),
    # norms, dropout and residuals on sequence shards (reduce-scatter after row-parallel, gather into blocks)
    Layout("tp2-sequence-parallel", 2, {**TP2, "sequence_parallel": True}, expect=dict(sharded=True, report=(
        "sequence parallel", "model.transformer.h.0.ln_1: norm", "model.transformer.wpe: position",
        "model.transformer.h.0.attn: gather_seq"))),
    # `transformers` LlamaForCausalLM (GQA, gated MLP) and GPT2LMHeadModel (Conv1D, fused c_attn, tied head)
    Layout("tp2-llama", 2, TP2, model={"arch": "llama"}, expect=dict(sharded=True, report=(
        "self_attn.k_proj: colwise", "mlp.down_proj: rowwise", "model.lm_head: vocab"))),
    Layout("tp2-gpt2", 2, TP2, model={"arch": "gpt2"}, expect=dict(sharded=True, report=(
        "attn.c_attn: qkv", "num_heads 4 -> 2", "model.lm_head: vocab"))),
    Layout("pp2-gpipe", 2, {**PP2, "pipeline_schedule": "gpipe", "micro_batches": 4}, checks=PIPE, model=PP,
           expect=dict(PP_STAGES, stages=[[0], [1]])),
    Layout("pp2-1f1b", 2, {**PP2, "pipeline_schedule": "1f1b", "micro_batches": 4}, checks=PIPE, model=PP,
           expect=dict(PP_STAGES, stages=[[0], [1]])),
    Layout("pp2-interleaved-1f1b", 2, {**PP2, "pipeline_schedule": "interleaved_1f1b", "micro_batches": 4},
           checks=PIPE, model=PP, expect=dict(PP_STAGES, stages=[[0, 2], [1, 3]])),
    # global-norm clipping counts each stage's gradients once (all-reduced over pp); accumulation is not rescaled
    Layout("pp2-accumulate2", 2, {**PP2, "micro_batches": 2}, model=PP, accumulate=2),
    # other optimizers (and their schedulers) under ZeRO; OptGPT's example AdamW with 3 warmup steps otherwise
    *(Layout(f"dp2-zero{z}-{opt}", 2, {"zero_stage": z}, model={"optimizer": opt, "warmup_steps": 3})
      for opt, stages in (("sgd", (1, 2)), ("adam_fused", (1, 3))) for z in stages),
    # wpe frozen but in the optimizer (AdamW, weight decay 0.1): one process never steps it (no gradient), so ZeRO-1
    # must not either (a zero gradient would still decay it by ~1e-3 relative in a few steps)
    Layout("dp2-zero1-adamw-frozen", 2, {"zero_stage": 1}, model={"optimizer": "adamw_frozen", "warmup_steps": 3}),
    # manual optimization, two backward passes per step (Lightning clips automatic optimization only)
    Layout("dp2-zero1-manual-two-backwards", 2, {"zero_stage": 1}, checks=("parity", "full_state"),
           model={"optimizer": "manual_accumulate", "warmup_steps": 3}, clip=None),
    Layout("dp2-zero1-bf16", 2, {"zero_stage": 1}, "bf16-mixed", ("guard", "guard_loss")),
    Layout("pp2-bf16", 2, PP2, "bf16-mixed", ("guard", "guard_loss")),
    # 4 and 8 processes (marked slow)
    Layout("dp2-tp2-zero0", 4, TP2, expect=dict(mesh=(1, 2, 2), optimizer="MixedPrecisionOptimizer", sharded=True)),
    Layout("dp2-tp2-zero1", 4, {**TP2, "zero_stage": 1},
           expect=dict(mesh=(1, 2, 2), optimizer="DistributedOptimizer", sharded=True)),
    # ZeRO 3 over tp dim-0 shards: `_StridedShard` DTensors whose squared norms must be reduced over dp
    Layout("dp2-tp2-zero3", 4, {**TP2, "zero_stage": 3}, expect=dict(mesh=(1, 2, 2))),
    # ZeRO 2/3 x sequence parallelism: the norms are DTensors replicated over tp, so FSDP2 shards them over dp only;
    # fp32: they ride in their blocks' FSDP units
    *(Layout(f"dp2-tp2-sp-zero{z}", 4, {**TP2, "zero_stage": z, "sequence_parallel": True}, expect=dict(
        mesh=(1, 2, 2), fully_sharded=True, no_fsdp_units=("FSDPLayerNorm",),
        report=("sequence parallel", "model.transformer.h.0.ln_1: norm"),
        placements={"model.transformer.h.0.ln_1.weight": "(Shard(dim=0), Replicate())",
                    "model.transformer.h.0.mlp.c_proj.weight": "(Shard(dim=0), Shard(dim=1))"})) for z in (2, 3)),
    Layout("pp2-tp2", 4, {**PP2, **TP2, "micro_batches": 2}, checks=PIPE, model=PP, expect=dict(mesh=(2, 1, 2))),
    # one mesh of 8: pp=2 x dp=2 x tp=2 (ZeRO-1 over dp), 1F1B with 2 micro-batches per dp rank
    Layout("pp2-dp2-tp2-zero1", 8, {**PP2, **TP2, "data_parallel_size": 2, "zero_stage": 1, "micro_batches": 2},
           checks=PIPE, model=PP, expect=dict(mesh=(2, 2, 2), stages=[[0]] * 4 + [[1]] * 4)),
    # FSDP2 over dp on tensor-parallel stages: 2-D (dp, tp) parameters; replicated-over-tp ones dp-sharded
    Layout("pp2-dp2-tp2-zero2", 8, {**PP2, **TP2, "data_parallel_size": 2, "zero_stage": 2, "micro_batches": 2},
           checks=PIPE, model=PP, expect=dict(
               mesh=(2, 2, 2), stages=[[0]] * 4 + [[1]] * 4, fully_sharded=True, optimizer="MixedPrecisionOptimizer",
               placements={"model.transformer.h.0.attn.c_proj.weight": "(Shard(dim=0), Shard(dim=1))",
                           "model.transformer.h.0.ln_1.weight": "(Shard(dim=0),)",
                           "model.transformer.ln_f.weight": "(Shard(dim=0),)"})),
]


class StepRecorder(LossRecorder):
    """What a user's loggers see: every micro-batch's losses, and per optimizer step the guard's statistics, the
    clipped norm and the norms of the model's ``.grad`` (lightning_npu's and, in one process, torch's own)."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: list[dict[str, float]] = []
        self._norms: Optional[dict[str, float]] = None

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        self._norms = {"npu_grad_norm": float(lightning_npu.grad_norm(pl_module, 2)["grad_2.0_norm_total"])}
        if trainer.world_size == 1:
            grads = [p.grad for p in pl_module.parameters() if p.grad is not None]
            self._norms["torch_grad_norm"] = float(torch.nn.utils.get_total_norm(grads, 2.0))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        if self._norms is not None:  # this micro-batch stepped the optimizer
            metrics = trainer.callback_metrics
            row = {k.removeprefix("npu/"): float(metrics[k])
                   for k in ("health/grad_norm", "health/loss", "train_loss", "npu/grad_norm") if k in metrics}
            self.rows.append({**row, **self._norms})
            self._norms = None


def _round_trip(module: torch.nn.Module) -> float:
    """Load full state + 1 into the model, read it back, undo; the largest error seen."""
    full = lightning_npu.full_state_dict(module)
    shifted = {k: v + 1 if v.is_floating_point() else v for k, v in full.items()}
    lightning_npu.load_full_state_dict(module, shifted)
    back = lightning_npu.full_state_dict(module)
    lightning_npu.load_full_state_dict(module, full)
    err = max((back[k].double() - shifted[k].double()).abs().max().item() for k in full)
    again = lightning_npu.full_state_dict(module)
    return max(err, max((again[k].double() - full[k].double()).abs().max().item() for k in full))


def _predict(trainer: L.Trainer, model: L.LightningModule, data: Any) -> Optional[torch.Tensor]:
    """Logits for 4 validation samples: through the pipeline (its last stage returns them), or directly."""
    loader = torch.utils.data.DataLoader(torch.utils.data.Subset(data.val_set, range(4)), batch_size=4)
    if trainer.strategy.parallel_config.pipeline_parallel_size > 1:
        logits = trainer.predict(model, dataloaders=loader)[0]
    else:
        with torch.no_grad():
            logits = model(next(iter(loader))[0])
    return None if logits is None else logits.detach().clone()


def _model(spec: dict[str, Any]) -> L.LightningModule:
    if "optimizer" in spec:
        return OptGPT(**{**SMALL_GPT, **spec})
    return _make_model(spec.get("arch", "gpt"), {k: v for k, v in spec.items() if k != "arch"})


def run_layout(layout: Layout, steps: int = STEPS, ckpt_dir: Optional[str] = None, ckpt_in: Optional[str] = None,
               limit_train_batches: Optional[int] = None) -> dict[str, Any]:
    """Train the row's layout (checkpoint tests: every 3 steps into `ckpt_dir`, or resumed from `ckpt_in`)."""
    L.seed_everything(0, verbose=False)
    model = _model(layout.model)
    recorder = StepRecorder()
    callbacks: list[L.Callback] = [recorder]
    if "guard" in layout.checks:  # ranges off: the guard only measures and logs (every step: log_every_n_steps=1)
        callbacks.append(GradientHealthGuard(grad_norm_range=None, loss_range=None, grad_variance_range=None,
                                             loss_spike_factor=None, update_ratio_target=None))
    strategy = NPUHybridStrategy(**layout.strategy)
    trainer, data = parity_trainer(
        strategy, model, layout.devices, GLOBAL_BATCH // layout.accumulate, steps, callbacks, ckpt_dir,
        limit_train_batches, precision=layout.precision, gradient_clip_val=layout.clip, log_every_n_steps=1,
        accumulate_grad_batches=layout.accumulate,
    )
    trainer.fit(model, datamodule=data, ckpt_path=ckpt_in)
    val = trainer.validate(model, datamodule=data, verbose=False)[0]["val_loss"]
    runner = getattr(trainer.strategy, "_pipeline", None)
    out: dict[str, Any] = {
        "logged": recorder.logged,
        "local": recorder.local,
        "lr": recorder.lr,
        "rows": recorder.rows,
        "state": lightning_npu.full_state_dict(model),
        "local_keys": sorted(model.state_dict()),
        # elements this rank stores (a DTensor's numel() is the global one)
        "local_numel": sum((p.to_local() if hasattr(p, "to_local") else p).numel() for p in model.parameters()),
        "val_loss": float(val),
        "global_step": trainer.global_step,
        "optimizer": type(trainer.strategy.optimizers[0]).__name__,
        "mesh": tuple(trainer.strategy.device_mesh.mesh.shape),
        "dp_rank": trainer.strategy.device_mesh["dp"].get_local_rank(),
        "stages": runner.local_stages if runner is not None else None,
        "sharded": bool(tensor_parallel_parameter_names(model)),
        "fully_sharded": data_parallel.is_fully_sharded(model),
        "fsdp_units": sorted(type(m).__name__ for m in data_parallel.fsdp_modules(model)),
        "placements": {n: str(getattr(p, "placements", None)) for n, p in model.named_parameters()},
        "report": str(trainer.strategy.tp_report) if trainer.strategy.tp_report is not None else None,
    }
    if "predict" in layout.checks:
        out["logits"] = _predict(trainer, model, data)
    if "parity" in layout.checks or layout.devices == 1:  # what parity compares, and the one-process side of it
        out["optimizer_state"] = full_optimizer_state_dict(model, trainer.optimizers[0])["state"]
    if "full_state" in layout.checks:
        out["round_trip_error"] = _round_trip(model)
    return out


def run_calls(calls: list[tuple[Callable[..., Any], dict[str, Any]]]) -> list[Any]:
    """``fn(**kwargs)`` for each call, in order, in one process group: one launch checks several things (the
    process start-up and imports are paid once). Each call is a module-level function and its arguments."""
    out = []
    for fn, kwargs in calls:
        if dist.is_initialized():  # Lightning's environment deletes WORLD_SIZE at teardown; the next Trainer needs it
            os.environ["WORLD_SIZE"] = str(dist.get_world_size())
        out.append(fn(**kwargs))
    return out


def launch_calls(devices: int, calls: list[tuple[Callable[..., Any], dict[str, Any]]]) -> list[list[Any]]:
    """`calls` in one launch of `devices` processes (`run_calls`); per call, each rank's result."""
    return [list(per_call) for per_call in zip(*spawn(run_calls, devices, calls))]


def run_layouts(layouts: list[Layout]) -> list[dict[str, Any]]:
    """Several rows in one process group: the process start-up and imports are paid once."""
    return run_calls([(run_layout, {"layout": layout}) for layout in layouts])


def references(layouts: list[Layout]) -> list[Layout]:
    """The distinct one-process references of `layouts`, in order."""
    seen: dict[tuple, Layout] = {}
    for layout in layouts:
        seen.setdefault(layout.reference_key(), layout.reference())
    return list(seen.values())

