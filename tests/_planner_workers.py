"""What a rank holds after a training step of the example GPT, measured exactly, for the planner's check.

Per rank, for each layout: bytes of parameters (local shards; at the start of backward, when ZeRO-2 still holds
the gathered weights and ZeRO-3 has freed them), gradients (before the optimizer step), optimizer state (after it),
and the peak of the activations autograd saves for backward (`torch.autograd.graph.saved_tensors_hooks`; each
storage once; parameters, their views and their gathered copies excluded), plus the rank's pipeline stage.
"""

from __future__ import annotations

from typing import Any

import lightning as L
import torch

from examples.gpt.data import TextDataModule
from examples.gpt.model import GPTModule
from lightning_npu import NPUHybridStrategy
from lightning_npu.parallel import data as data_parallel
from lightning_npu.parallel.optimizer import unwrap_optimizer

MODEL = dict(vocab_size=256, n_layer=4, n_head=4, n_embd=64, block_size=64, bias=False, dropout=0.0)
PER_DP_BATCH = 4


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


class _Held:
    __slots__ = ("t", "ptr", "probe")

    def __init__(self, t: torch.Tensor, ptr: int, probe: "MemoryProbe") -> None:
        self.t, self.ptr, self.probe = t, ptr, probe

    def __del__(self) -> None:
        self.probe._release(self.ptr)


class MemoryProbe(L.Callback):
    def __init__(self) -> None:
        self.out: dict[str, Any] = {}
        self._refs: dict[int, list[int]] = {}
        self._live = self._peak = 0
        self._ctx: Any = None
        self._module: Any = None

    # ---- saved activations ------------------------------------------------------------------
    def _param_storages(self) -> set[int]:
        return {_local(p).untyped_storage().data_ptr() for p in self._module.parameters() if not p.is_meta}

    def _pack(self, t: torch.Tensor) -> Any:
        local = _local(t)
        if local.is_meta:  # the pipeline's shape inference runs the stages on meta tensors
            return t
        storage = local.untyped_storage()
        ptr = storage.data_ptr()
        if storage.nbytes() == 0 or ptr in self._param_storages():
            return t
        entry = self._refs.setdefault(ptr, [storage.nbytes(), 0])
        if entry[1] == 0:
            self._live += entry[0]
            self._peak = max(self._peak, self._live)
        entry[1] += 1
        return _Held(t, ptr, self)

    @staticmethod
    def _unpack(obj: Any) -> torch.Tensor:
        return obj.t if isinstance(obj, _Held) else obj

    def _release(self, ptr: int) -> None:
        entry = self._refs[ptr]
        entry[1] -= 1
        if entry[1] == 0:
            self._live -= entry[0]
            del self._refs[ptr]

    # ---- hooks ---------------------------------------------------------------------------------
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        # every hook measures each step; the second step's figures are kept (the first one's pipeline shape
        # inference runs an extra forward)
        self._module = pl_module
        self._live = self._peak = 0
        self._ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._ctx.__enter__()

    def on_before_backward(self, trainer, pl_module, loss) -> None:
        self.out["parameters"] = sum(data_parallel._local_bytes(p) for p in pl_module.parameters() if not p.is_meta)

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        # the model's gradients, or the ones the optimizer steps with when they live elsewhere (ZeRO-1's fp32
        # slices; the model's were freed bucket by bucket as they were reduce-scattered)
        model_grads = sum(data_parallel._local_bytes(p.grad) for p in pl_module.parameters() if p.grad is not None)
        stepped = [p for g in unwrap_optimizer(optimizer).param_groups for p in g["params"]]
        step_grads = sum(data_parallel._local_bytes(p.grad) for p in stepped if p.grad is not None)
        self.out["gradients"] = max(model_grads, step_grads)
        # fp32 master copies (ZeRO-1's slices, *-true's masters) are optimizer state too
        own = {id(p) for p in pl_module.parameters()}
        self.out["masters"] = sum(data_parallel._local_bytes(p) for p in stepped if id(p) not in own)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self._ctx.__exit__(None, None, None)
        self.out["activations"] = self._peak
        self.out["optimizer"] = data_parallel.sharded_optimizer_state_bytes(trainer.strategy.optimizers[0]) + \
            self.out.pop("masters")
        self.out.setdefault("parameters", data_parallel.parameter_bytes(pl_module))  # pp: no on_before_backward
        mesh = trainer.strategy.device_mesh
        self.out["stage"] = mesh["pp"].get_local_rank() if "pp" in (mesh.mesh_dim_names or ()) else 0


def measure(layouts: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Train one step of the GPT under each layout (same 4 processes), return each one's measured bytes."""
    results = []
    for kwargs in layouts:
        L.seed_everything(0, verbose=False)
        strategy = NPUHybridStrategy(**kwargs)
        cfg = strategy.parallel_config
        probe = MemoryProbe()
        trainer = L.Trainer(
            accelerator="cpu", devices=4, strategy=strategy, max_steps=2, precision="32-true", logger=False,
            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
            callbacks=[probe],
        )
        model = GPTModule(**MODEL)
        dp = 4 // (cfg.tensor_parallel_size * cfg.pipeline_parallel_size)
        trainer.fit(model, datamodule=TextDataModule(block_size=MODEL["block_size"], batch_size=PER_DP_BATCH,
                                                     shuffle=False))
        results.append({**probe.out, "dp": dp})
    return results
