"""`torch.equal` where DTensor refuses it: DTensors of different meshes, or a DTensor and a plain tensor.

Why: Lightning's `BaseFinetuning.unfreeze_and_add_param_group` drops the parameters already in the optimizer with
``torch.equal(p, param)`` over every pair. Under `branch_layouts` a model holds DTensors on several meshes (each
branch's FSDP2 ``fdp`` or tp mesh) beside plain tensors, and DTensor raises on such pairs. They are compared as
torch compares tensors: global shapes first (the same on every rank: no collective), then the full values. The
handler sits in DTensor's table of custom ops while a strategy is set up, as torch's own `loss_parallel` adds its
ops there; the pairs DTensor supports keep its path.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor

_EQUAL = torch.ops.aten.equal.default
_users = 0


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _equal(op_call: Any, args: tuple, kwargs: dict) -> bool:
    a, b = args[0], args[1]
    handlers = DTensor._op_dispatcher._custom_op_handlers
    if isinstance(a, DTensor) and isinstance(b, DTensor) and a.device_mesh == b.device_mesh:
        del handlers[_EQUAL]  # DTensor's own path (its sharding rule and one all-reduce)
        try:
            return op_call(*args, **kwargs)
        finally:
            handlers[_EQUAL] = _equal
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return bool(torch.equal(_full(a), _full(b)))  # collectives over each DTensor's mesh, in the same order on all


def install() -> None:
    """Add the handler (counted: nested strategies share it)."""
    global _users
    _users += 1
    DTensor._op_dispatcher._custom_op_handlers.setdefault(_EQUAL, _equal)


def uninstall() -> None:
    global _users
    _users = max(0, _users - 1)
    if not _users and DTensor._op_dispatcher._custom_op_handlers.get(_EQUAL) is _equal:
        del DTensor._op_dispatcher._custom_op_handlers[_EQUAL]
