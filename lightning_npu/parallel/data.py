"""Data parallelism over the mesh's ``dp`` dimension.

ZeRO 0 and 1 keep parameters and gradients replicated, so they ride on PyTorch's
DistributedDataParallel (bucketed all-reduce overlapped with backward) restricted to the dp
process group. ZeRO 1 additionally shards the optimizer state with PyTorch's
ZeroRedundancyOptimizer: every rank steps only the parameters it owns and broadcasts them.
"""

from __future__ import annotations

import inspect
from typing import Any, Optional

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel
from torch.optim import Optimizer


def wrap_data_parallel(
    module: torch.nn.Module,
    mesh: DeviceMesh,
    device_ids: Optional[list[int]],
    bucket_size_mb: float,
    ddp_kwargs: dict[str, Any],
) -> DistributedDataParallel:
    kwargs = {"bucket_cap_mb": bucket_size_mb, "gradient_as_bucket_view": True, **ddp_kwargs}
    return DistributedDataParallel(module, device_ids=device_ids, process_group=mesh["dp"].get_group(), **kwargs)


def shard_optimizer_state(optimizer: Optimizer, mesh: DeviceMesh) -> Optimizer:
    """Re-create `optimizer` as a ZeroRedundancyOptimizer over the dp group (ZeRO stage 1).

    The user's optimizer class and every param-group hyper-parameter (lr, betas, weight decay,
    `initial_lr` set by schedulers, ...) carry over; the caller must re-point LR schedulers.
    """
    if isinstance(optimizer, ZeroRedundancyOptimizer):
        return optimizer
    if optimizer.state:
        raise ValueError(
            f"{type(optimizer).__name__} already holds state before ZeRO-1 sharding; return a fresh optimizer "
            "from `configure_optimizers` (or use zero_stage=0)."
        )
    groups = [dict(group) for group in optimizer.param_groups]
    # `defaults` can hold keys the constructor does not take (AdamW's `decoupled_weight_decay`).
    accepted = inspect.signature(type(optimizer).__init__).parameters
    defaults = {k: v for k, v in optimizer.defaults.items() if k in accepted}
    return ZeroRedundancyOptimizer(
        groups, optimizer_class=type(optimizer), process_group=mesh["dp"].get_group(), **defaults
    )


def sharded_optimizer_state_bytes(optimizer: Optimizer) -> int:
    """Bytes of optimizer state this rank holds (its ZeRO shard, or everything when unsharded)."""
    inner = optimizer.optim if isinstance(optimizer, ZeroRedundancyOptimizer) else optimizer
    total = 0
    for state in inner.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor):
                local = value.to_local() if hasattr(value, "to_local") else value
                total += local.numel() * local.element_size()
    return total
