"""The model summary under npu_hybrid counts the whole model, not one rank's shard of it.

Lightning's `ModelSummary` callback sums ``p.numel()`` over the LightningModule on rank 0: a tensor-parallel
shard, or one pipeline stage (the example GPT at pp=2 showed 445 K of its 875 K parameters). It has no hook for
sharded layouts but DeepSpeed's (`DeepSpeedSummary`, a `ModelSummary` subclass chosen in the callback's
``_summary``); this is the same for npu_hybrid: each parameter counts its full shape (a tp shard or a ZeRO-3
slice knows it), the stages' counts are summed over ``pp``, and with pp > 1 a line under the table says which
stage its rows list. The strategy puts these subclasses in place of Lightning's own summary callbacks at setup.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import ModelSummary, RichModelSummary
from lightning.pytorch.utilities.model_summary import ModelSummary as Summary
from lightning.pytorch.utilities.model_summary.model_summary import _tensor_has_shape
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_npu.parallel.state import tensor_state
from lightning_npu.parallel.tensor_parallel.shards import sharding_of


def global_numel(p: torch.Tensor) -> int:
    """Elements of the whole parameter that `p` (a tp shard, a DTensor slice, or a plain tensor) is part of."""
    if _tensor_has_shape(p):  # not materialised yet (Lightning counts these as 0)
        return 0
    sharding = sharding_of(p)
    return math.prod(sharding.shape) if sharding is not None else p.numel()


def parameter_counts(module: torch.nn.Module, pp_group: Optional[dist.ProcessGroup]) -> tuple[int, int]:
    """(total, trainable) parameters of the whole model: every rank of `pp_group` calls this (a collective)."""
    # the last stage's copy of a tied embedding is the first stage's parameter (`pipeline_copy`): counted there
    params = [p for p in module.parameters() if not getattr(tensor_state(p, create=False), "pipeline_copy", False)]
    counts = torch.tensor([sum(global_numel(p) for p in params),
                           sum(global_numel(p) for p in params if p.requires_grad)], dtype=torch.float64)
    if pp_group is not None and dist.get_world_size(pp_group) > 1:
        backend_device = next((p.device for p in params), torch.device("cpu"))
        counts = counts.to(backend_device)
        dist.all_reduce(counts, group=pp_group)  # stages hold disjoint parameters
    return int(counts[0].item()), int(counts[1].item())


class LayoutSummary(Summary):
    """Lightning's summary with whole-model counts: full shapes per row, totals over every pipeline stage."""

    def __init__(self, model: Any, max_depth: int, counts: tuple[int, int], stages: int) -> None:
        self._counts, self._stages = counts, stages
        super().__init__(model, max_depth=max_depth)

    @property
    def param_nums(self) -> list[int]:
        return [sum(global_numel(p) for p in layer._module.parameters()) for layer in self._layer_summary.values()]

    @property
    def total_parameters(self) -> int:
        return self._counts[0]

    @property
    def trainable_parameters(self) -> int:
        return self._counts[1]

    @property
    def total_layer_params(self) -> int:
        # the rows list this rank's stage: the other stages' parameters are not "params outside any layer"
        return self._counts[0] if self._stages > 1 else super().total_layer_params


class _WholeModel:
    """`ModelSummary` / `RichModelSummary` behaviour with `LayoutSummary` under npu_hybrid."""

    def _summary(self, trainer: Any, pl_module: Any) -> Summary:
        mesh = getattr(trainer.strategy, "_device_mesh", None)
        if mesh is None:
            return super()._summary(trainer, pl_module)  # type: ignore[misc]
        stages = mesh["pp"].size() if "pp" in (mesh.mesh_dim_names or ()) else 1
        pp_group = mesh["pp"].get_group() if stages > 1 else None
        counts = parameter_counts(pl_module, pp_group)
        if stages > 1 and trainer.is_global_zero:
            self._note = (f"npu_hybrid: the parameter counts are the whole model's (all {stages} pipeline stages and "
                          f"shards); the rows list pipeline stage 0's layers (rank 0).")
        return LayoutSummary(pl_module, self._max_depth, counts, stages)  # type: ignore[attr-defined]

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        self._note: Optional[str] = None
        super().on_fit_start(trainer, pl_module)  # type: ignore[misc]
        if self._note:
            rank_zero_info(self._note)


class WholeModelSummary(_WholeModel, ModelSummary):
    pass


class WholeModelRichSummary(_WholeModel, RichModelSummary):
    pass


def use_whole_model_summary(trainer: Any) -> None:
    """Put the subclasses in place of Lightning's own summary callbacks (its default, or a user's), same options."""
    for i, cb in enumerate(trainer.callbacks):
        cls = {ModelSummary: WholeModelSummary, RichModelSummary: WholeModelRichSummary}.get(type(cb))
        if cls is not None:
            trainer.callbacks[i] = cls(max_depth=cb._max_depth, **cb._summarize_kwargs)
