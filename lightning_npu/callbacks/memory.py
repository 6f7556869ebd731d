"""`MemoryMonitor`: where each rank's memory goes, logged every step and summarised once per epoch.

Model state and saved activations are counted from the tensors (`lightning_npu.memory`), so the split is exact on
every device and strategy; the allocator's own figures (allocated, reserved, peak, fragmentation) come from
`lightning_npu.device` on CUDA and NPU. The CPU has no caching allocator: there the process's RSS is reported.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info

from lightning_npu import device as dev
from lightning_npu.memory import SavedActivations, model_state_bytes, storage_keys
from lightning_npu.validate import check_bool, check_int

_MIB = 2**20


class MemoryMonitor(Callback):
    """Logs ``memory/<kind>_bytes`` for this rank (rank 0's values; ``sync_dist`` would average ranks that differ).

    Kinds: ``parameters``, ``gradients`` (at ``on_before_optimizer_step``), ``optimizer_state`` (state and fp32
    masters, after the step), ``activations_peak`` (the most bytes saved for backward at once during the step),
    and the device's ``allocated``, ``reserved``, ``max_allocated``, ``fragmentation`` (reserved - allocated), or
    ``rss`` / ``peak_rss`` on CPU.

    Args:
        activations: count saved activations (a Python hook per saved tensor: about 1-3% step time on small models).
        log_every_n_steps: log every N steps (the epoch summary always comes).
    """

    def __init__(self, activations: bool = True, log_every_n_steps: int = 1) -> None:
        self.activations = check_bool("activations", activations, owner="MemoryMonitor")
        self.log_every_n_steps = check_int("log_every_n_steps", log_every_n_steps, minimum=1, example=10,
                                           owner="MemoryMonitor")
        self.last: dict[str, float] = {}
        self.epoch_peak: dict[str, float] = {}
        self.last_summary = ""  # the last epoch's line (also logged at INFO on rank 0)
        self._saved: Optional[SavedActivations] = None

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if self.activations:
            if self._saved is None:
                self._saved = SavedActivations(ignore=storage_keys(pl_module.parameters()))
            self._saved.start()

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        self.last["gradients"] = float(model_state_bytes(pl_module, [optimizer])["gradients"])

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        state = model_state_bytes(pl_module, trainer.optimizers)
        self.last["parameters"] = float(state["parameters"])
        self.last["optimizer_state"] = float(state["optimizer_state"])
        if self._saved is not None:
            self._saved.stop()
            self.last["activations_peak"] = float(self._saved.peak)
        stats = dev.memory_stats(pl_module.device)
        if "reserved_bytes" in stats:
            stats["fragmentation_bytes"] = stats["reserved_bytes"] - stats["allocated_bytes"]
        self.last.update({k.removesuffix("_bytes"): v for k, v in stats.items() if k.endswith("_bytes")})
        for key, value in self.last.items():
            self.epoch_peak[key] = max(value, self.epoch_peak.get(key, 0.0))
        if trainer.global_step % self.log_every_n_steps == 0:
            pl_module.log_dict({f"memory/{k}_bytes": torch.tensor(v) for k, v in self.last.items()},
                               rank_zero_only=True)

    def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        if self.epoch_peak:
            self.last_summary = self.summary()
            rank_zero_info(self.last_summary)
        self.epoch_peak = {}

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self.on_train_epoch_end(trainer, pl_module)  # max_steps can stop inside an epoch

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        if self._saved is not None:
            self._saved.stop()

    def summary(self) -> str:
        """One line: this epoch's largest value of each kind on rank 0, in MiB."""
        p = self.epoch_peak
        parts = [f"{name} {p[key] / _MIB:.1f}" for key, name in (
            ("parameters", "params"), ("gradients", "grads"), ("optimizer_state", "optimizer"),
            ("activations_peak", "activations"), ("max_allocated", "device peak"), ("fragmentation", "fragmentation"),
            ("peak_rss", "process peak RSS")) if key in p]
        device = "" if "max_allocated" in p else " (CPU: no caching allocator)"
        return "memory per rank, MiB: " + ", ".join(parts) + device
