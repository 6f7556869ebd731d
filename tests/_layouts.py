"""One layout table and one runner for the parity checks (a torchtitan-style feature table).

Each row is `(name, devices, strategy kwargs, precision, checks)`. `run_layout` trains the small GPT with the
row's layout in real processes; the tests compare what it returns with the one-process row of the same
precision. Checks a row can ask for:

- ``parity``: logged losses per step, the final full state and the full optimizer state (torch's format, as a
  single-file checkpoint holds it) equal the reference's (fp32);
- ``guard``: GradientHealthGuard's ``health/grad_norm`` equals the reference's global norm, the norm the
  precision plugin clipped with (one statistics function) and `lightning_npu.grad_norm` of the model's ``.grad``;
- ``guard_loss``: ``health/loss`` equals the logged ``train_loss`` (the training loss, not loss x scale);
- ``full_state``: `lightning_npu.load_full_state_dict` round-trips through `lightning_npu.full_state_dict`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import lightning as L
import torch

import lightning_npu
from examples.gpt.model import GPTModule
from lightning_npu import NPUHybridStrategy
from lightning_npu.callbacks import GradientHealthGuard
from lightning_npu.parallel.full_state import full_optimizer_state_dict
from tests._gpt_workers import SMALL_GPT, parity_trainer


@dataclass(frozen=True)
class Layout:
    name: str
    devices: int
    strategy: dict[str, Any] = field(default_factory=dict)
    precision: str = "32-true"
    checks: tuple[str, ...] = ("parity", "guard", "full_state")


REFERENCE = {
    "32-true": Layout("ref", 1, {"zero_stage": 0}, checks=()),
    "bf16-mixed": Layout("ref-bf16", 1, {"zero_stage": 0}, "bf16-mixed", checks=()),
}

LAYOUTS = [
    Layout("tp2-zero0", 2, {"tensor_parallel_size": 2, "zero_stage": 0}),
    Layout("tp2-zero3", 2, {"tensor_parallel_size": 2, "zero_stage": 3}),
    Layout("dp2-tp2-zero1", 4, {"tensor_parallel_size": 2, "zero_stage": 1}),
    Layout("pp2", 2, {"pipeline_parallel_size": 2, "zero_stage": 0}),
    Layout("dp2-zero1", 2, {"zero_stage": 1}),
    Layout("dp2-zero3", 2, {"zero_stage": 3}),
    Layout("pp2-tp2", 4, {"pipeline_parallel_size": 2, "tensor_parallel_size": 2, "zero_stage": 0}),
    Layout("dp2-zero1-bf16", 2, {"zero_stage": 1}, "bf16-mixed", ("guard", "guard_loss")),
    Layout("pp2-bf16", 2, {"pipeline_parallel_size": 2, "zero_stage": 0}, "bf16-mixed", ("guard", "guard_loss")),
]

STEPS, GLOBAL_BATCH, CLIP = 4, 8, 1.0


class StepRecorder(L.Callback):
    """What a user's loggers see each step: the guard's statistics, the clipped norm, the training loss."""

    def __init__(self) -> None:
        self.rows: list[dict[str, float]] = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        # Lightning's grad_norm recipe on the model's `.grad` (lightning_npu's: every layout), before clipping
        self._npu_grad_norm = float(lightning_npu.grad_norm(pl_module, 2)["grad_2.0_norm_total"])

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        metrics = trainer.callback_metrics
        row = {k: float(metrics[k]) for k in ("health/grad_norm", "health/loss", "train_loss", "grad_norm")
               if k in metrics}
        row["npu_grad_norm"] = self._npu_grad_norm
        self.rows.append(row)


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


def run_layout(layout: Layout) -> dict[str, Any]:
    L.seed_everything(0, verbose=False)
    model = GPTModule(**SMALL_GPT)
    recorder = StepRecorder()
    # ranges off: the guard only measures and logs (every step: log_every_n_steps=1)
    guard = GradientHealthGuard(grad_norm_range=None, loss_range=None, grad_variance_range=None,
                                loss_spike_factor=None, update_ratio_target=None)
    trainer, data = parity_trainer(
        NPUHybridStrategy(**layout.strategy), model, layout.devices, GLOBAL_BATCH, STEPS, [guard, recorder],
        precision=layout.precision, gradient_clip_val=CLIP, log_every_n_steps=1,
    )
    trainer.fit(model, datamodule=data)
    out: dict[str, Any] = {"rows": recorder.rows, "state": lightning_npu.full_state_dict(model),
                           "optimizer": full_optimizer_state_dict(model, trainer.optimizers[0])["state"]}
    if "full_state" in layout.checks:
        out["round_trip_error"] = _round_trip(model)
    return out
