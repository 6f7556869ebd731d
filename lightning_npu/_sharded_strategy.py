"""Sharded-checkpoint hooks of `NPUHybridStrategy` (Lightning glue).

A mixin that sits between `NPUHybridStrategy` and Lightning's `DDPStrategy` in the MRO, so the
strategy's own overrides (e.g. tensor parallelism's) can wrap these with ``super()``. The parallel
logic itself is in `lightning_npu.parallel.data` (FSDP2) and `lightning_npu.parallel.checkpoint` (DCP).

Checkpoints: `trainer.save_checkpoint(path)` (and so `ModelCheckpoint`) writes a DCP directory at
`path`, atomically; `ckpt_path=` accepts such a directory saved under any (pp, dp, tp, zero) layout, or a
Lightning single-file checkpoint (zero 0/1 only).
"""

from __future__ import annotations

from contextlib import nullcontext
from pathlib import Path
from typing import Any, Mapping, Optional

from lightning.pytorch.core.optimizer import LightningOptimizer

from lightning_npu.parallel import checkpoint as ckpt
from lightning_npu.parallel import data as data_parallel


def _unwrap(optimizer: Any) -> Any:
    return optimizer._optimizer if isinstance(optimizer, LightningOptimizer) else optimizer


class ShardedStrategyMixin:
    """Needs the strategy attributes: parallel_config, device_mesh, lightning_module, optimizers."""

    async_save: bool = False
    # `trainer.save_checkpoint(path, storage_options=CommitRequest(...))`: the commit (and marker) is ours
    accepts_commit_request: bool = True
    _ckpt_writer: Optional[ckpt.ShardedCheckpointWriter] = None
    _restored_from_file: bool = False

    # ---- checkpoints --------------------------------------------------------------------------
    def _is_fully_sharded(self) -> bool:
        module = self.lightning_module
        return module is not None and data_parallel.is_fully_sharded(module)

    def _writer(self) -> ckpt.ShardedCheckpointWriter:
        if self._ckpt_writer is None:
            self._ckpt_writer = ckpt.ShardedCheckpointWriter(async_save=self.async_save)
        return self._ckpt_writer

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        # sharded state loads into the wrapped/sharded model and the already created (ZeRO) optimizers
        return True

    @property
    def lightning_restore_optimizer(self) -> bool:
        # DCP checkpoints restore optimizers in `load_checkpoint`; single files through Lightning
        return self._restored_from_file

    def layout(self) -> dict[str, Any]:
        cfg = self.parallel_config
        return {
            "format": ckpt.FORMAT_VERSION,
            "tensor_parallel_size": cfg.tensor_parallel_size,
            "pipeline_parallel_size": cfg.pipeline_parallel_size,
            "data_parallel_size": cfg.resolved_dp,
            "zero_stage": cfg.zero_stage,
            "world_size": self.world_size,
            # ZeRO 2/3 x TP: fused projections stored rank-major for this tp size (FQN -> (dim, parts, tp))
            "fused": dict(getattr(self.lightning_module, "_lnpu_fused", None) or {}),
        }

    def _masters_as_parameters(self) -> Any:
        """bf16/16-true: the precision plugin's fp32 master weights stand in for the 16-bit parameters, so that
        DCP's FQN-keyed state dicts see the tensors the optimizer steps (`HybridPrecision.masters_as_parameters`)."""
        swap = getattr(self.precision_plugin, "masters_as_parameters", None)
        return swap(self.lightning_module) if swap is not None else nullcontext()

    def lightning_module_state_dict(self) -> dict[str, Any]:
        with self._masters_as_parameters():
            return ckpt.model_state_dict(self.lightning_module, [_unwrap(o) for o in self.optimizers])

    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        with self._masters_as_parameters():
            return ckpt.optimizer_state_dict(self.lightning_module, _unwrap(optimizer))

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Optional[Any] = None) -> None:
        request = storage_options if isinstance(storage_options, ckpt.CommitRequest) else None
        if storage_options is not None and request is None:
            raise TypeError(
                f"`{type(self).__name__}.save_checkpoint(..., storage_options=...)` is not supported: sharded "
                "checkpoints are written with torch.distributed.checkpoint, not the CheckpointIO plugin."
            )
        path = Path(self.broadcast(str(filepath)))
        token = self.broadcast(ckpt.new_token())
        checkpoint = dict(checkpoint)
        tensors = {ckpt.MODEL_KEY: checkpoint.pop("state_dict")}
        precision_key = type(self.precision_plugin).__qualname__
        if isinstance(checkpoint.get(precision_key), dict) and hasattr(self.precision_plugin, "masters_as_parameters"):
            # the fp32 master weights are the model tensors above (sharded, reshardable): not again, as rank 0's
            # unsharded copies, in meta.pt
            checkpoint[precision_key] = {k: v for k, v in checkpoint[precision_key].items() if k != "master_weights"}
        for i, state in enumerate(checkpoint.pop("optimizer_states", [])):
            tensors[f"optimizer_{i}"] = state
        checkpoint["lightning_npu"] = self.layout()
        self._writer().save(tensors, checkpoint, path, token, self.is_global_zero, self.barrier, request)

    def finalize_checkpoints(self) -> None:
        """Wait for an async save in flight (rank 0 commits it as soon as written); raise its error. Collective."""
        if self._ckpt_writer is not None:
            self._ckpt_writer.finalize(self.barrier)

    def load_checkpoint(self, checkpoint_path: Any, weights_only: Optional[bool] = None) -> dict[str, Any]:
        self.finalize_checkpoints()
        path = ckpt.resolve_checkpoint_path(self.broadcast(str(checkpoint_path)))
        self._restored_from_file = path.is_file()
        if self._restored_from_file:
            if self._is_fully_sharded() and self.optimizers:
                raise NotImplementedError(
                    f"{str(path)!r} is a single-file checkpoint; resuming one under zero_stage="
                    f"{self.parallel_config.zero_stage} is not supported. Resume it with zero_stage 0 or 1 and save "
                    "again (a sharded directory), which then loads under any stage."
                )
            with ckpt.refusing_unsafe(path):  # every file is read with weights_only=True
                return super().load_checkpoint(path, weights_only=True)
        module = self.lightning_module
        load = ckpt.load_sharded
        if ckpt.is_sharded_checkpoint(path) and ckpt.fused_layout_changes(ckpt.read_meta(path), module):
            load = ckpt.load_sharded_relayout  # fused projections saved under another tp size: full-tensor reload
        with self._masters_as_parameters():  # bf16/16-true: restores the fp32 masters, then the 16-bit params
            return load(
                path,
                module,
                [_unwrap(o) for o in self.optimizers],
                strict=module.strict_loading,
            )

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        if not self._restored_from_file:
            return  # loaded by `load_checkpoint`
        if self._is_fully_sharded():
            from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

            set_model_state_dict(
                self.lightning_module, checkpoint["state_dict"], options=StateDictOptions(full_state_dict=True, strict=strict)
            )
            return
        super().load_model_state_dict(checkpoint, strict=strict)

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        if self._restored_from_file:
            super().load_optimizer_state_dict(checkpoint)

    def teardown(self) -> None:
        if self._ckpt_writer is not None:
            ckpt.finalize_at_teardown(self._ckpt_writer)
        super().teardown()
