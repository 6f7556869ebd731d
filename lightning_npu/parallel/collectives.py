"""torch.distributed's single-tensor collectives under the names torch 2.13 gives them (the old names warn)."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist


def reduce_scatter_into(*args: Any, **kwargs: Any) -> Any:
    # torch 2.13 renamed the single-tensor collectives (the old names warn)
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return fn(*args, **kwargs)


def all_gather_into(*args: Any, **kwargs: Any) -> Any:
    """`dist.all_gather_into_tensor` under the name torch 2.13 gives it (the old name warns)."""
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return fn(*args, **kwargs)
