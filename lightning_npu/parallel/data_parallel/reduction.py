"""What logged values and metrics reduce over: the data-parallel ranks, where the ranks hold different data.

The sampler splits batches over ``dp`` only: tp and pp peers read the same batch, so a value computed from it is
a replica on them. Reducing over every rank (Lightning's default, the world) counts each sample tp x pp times: a
torchmetrics ``SumMetric`` of tokens reads 512 instead of 256 at tp=2, and sums logged with ``sync_dist=True``
are tp x pp too large. So, by default:

* :func:`reduce` (the strategy's ``reduce``, i.e. ``self.log(..., sync_dist=True)``) first makes a DTensor its full
  value (shards gathered, partial sums added: what a single process computes), then reduces over the dp group.
  A DTensor whose mesh spans ``dp`` (FSDP2 parameters, dp-sharded gradients) is already the dp-global value and
  is not reduced again. Under pp the strategy logs the loss after the pipeline broadcast it to every stage, so each
  stage's dp group reduces the same value;
* :func:`all_gather` keeps Lightning's contract, one row per rank over the world (``LightningModule.all_gather``
  passes the world group itself), with DTensors as their full values: rows of tp/pp peers are copies, so pass
  ``group=self.device_mesh["dp"].get_group()`` for one row per distinct batch;
* :func:`bind_metrics` gives the LightningModule's torchmetrics ``Metric`` objects that have no ``process_group``
  the dp group, so their sync counts each batch once (and under pp only the stage that updates them syncs).

An explicit ``group`` (``self.log(..., sync_dist_group=...)``, ``all_gather(group=...)``, ``Metric(process_group=
...)``) is always honoured. Decisions every rank must share (Lightning's ``reduce_boolean_decision``, the
callbacks' agreements) use the whole world explicitly.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist
from lightning.fabric.utilities.distributed import _all_gather_ddp_if_available, _sync_ddp_if_available
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from lightning_npu.parallel.mesh import replica_mesh
from lightning_npu.parallel.tensor_parallel.logits import VocabParallelLogits

__all__ = ["all_gather", "bind_metrics", "full_value", "reduce", "replica_group"]


def replica_group(mesh: Optional[DeviceMesh]) -> Optional[dist.ProcessGroup]:
    """The dp process group of this rank, or None (the world) when the dp ranks are all the ranks or no mesh exists."""
    if mesh is None or "dp" not in (mesh.mesh_dim_names or ()):
        return None
    dp = replica_mesh(mesh)  # under cp, dp x cp: cp ranks hold other tokens of the same samples
    return dp.get_group() if dp.size() < mesh.size() else None


def full_value(tensor: Any) -> Any:
    """A DTensor (or the tp head's VocabParallelLogits) as the plain tensor a single process would hold; anything
    else unchanged. A collective over the DTensor's mesh."""
    if isinstance(tensor, (DTensor, VocabParallelLogits)):
        return tensor.full_tensor()
    return tensor


def _spans_dp(tensor: Any) -> bool:
    return isinstance(tensor, DTensor) and "dp" in (tensor.device_mesh.mesh_dim_names or ())


def reduce(tensor: Any, mesh: Optional[DeviceMesh], group: Optional[Any] = None, reduce_op: Any = "mean") -> Any:
    """``sync_dist``: the full value of `tensor`, reduced with `reduce_op` over `group` (default: the dp group)."""
    if not isinstance(tensor, torch.Tensor):
        return tensor
    already_reduced = group is None and _spans_dp(tensor)
    tensor = full_value(tensor)
    if already_reduced:
        return tensor
    if group is None:
        group = replica_group(mesh)
        if group is not None and dist.get_world_size(group) == 1:
            return tensor
    return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)


def all_gather(tensor: torch.Tensor, group: Optional[Any] = None, sync_grads: bool = False) -> torch.Tensor:
    """``LightningModule.all_gather``: full values stacked over `group` (the world by default, as in Lightning)."""
    return _all_gather_ddp_if_available(full_value(tensor), group, sync_grads)


def bind_metrics(module: nn.Module, mesh: Optional[DeviceMesh]) -> list[Any]:
    """Give every torchmetrics ``Metric`` in `module` without a ``process_group`` the dp group; returns those metrics."""
    group = replica_group(mesh)
    if group is None:
        return []
    try:
        from torchmetrics import Metric
    except ImportError:  # torchmetrics is a dependency, but a module without metrics needs nothing
        return []
    bound = []
    for m in module.modules():
        if isinstance(m, Metric) and getattr(m, "process_group", None) is None:
            m.process_group = group
            bound.append(m)
    return bound
