"""How a tensor-parallel shard is held: the one module that knows.

Every other module sees one representation, DTensor. Under ZeRO 2/3 the parameters are DTensors (FSDP2 makes
them 2-D ``(dp, tp)``). Under ZeRO 0/1 each tp-sharded parameter is stored as a plain local shard and each
sharded module rebuilds DTensors around its own forward (torch's ``_pre_dp_module_transform`` does the same for
DDP, which reduces plain tensors): the DDP reducer and the ZeRO-1 buckets then handle them like any tensor, and the
optimizer steps without DTensor dispatch (measured: tp=2 at 1.5x the tokens/s of Lightning's
``ModelParallelStrategy``, whose parameters stay DTensors). Whatever reads a parameter's layout asks here:

* `sharding_of`: the mesh, placements and full shape of a parameter (either storage);
* `as_dtensor`: a parameter, its gradient or a parameter-shaped optimizer state as a DTensor over the same
  storage (checkpoints hand these to DCP, which writes global offsets and loads in place);
* `fused_layout`: fused projections (``c_attn`` = q|k|v) are sharded rank-major (`styles.Colwise`); their
  layout is recorded per FQN, because FSDP2 replaces the parameter objects.

Converting shards to and from full tensors in the model's original layout (gathers, slicing, undoing the
rank-major order) is `lightning_npu.parallel.checkpoint.full_state`'s, alone.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from lightning_npu.parallel.state import module_state, tensor_state
from lightning_npu.parallel.tensor_parallel.styles import _is_fused


class Sharding(NamedTuple):
    """A tp-sharded parameter's layout: its DTensor's mesh, placements and full (global) shape and stride."""

    mesh: DeviceMesh
    placements: tuple
    shape: torch.Size
    stride: tuple


def sharding_of(p: torch.Tensor) -> Optional[Sharding]:
    """The layout of a DTensor (parameter or not) or of a local tp shard; None for a plain (replicated) tensor."""
    if isinstance(p, DTensor):
        return Sharding(p.device_mesh, tuple(p.placements), p.shape, p.stride())
    return _sharding(p)


def as_dtensor(value: Any, param: torch.Tensor) -> Any:
    """`value` (`param`, its gradient, or an optimizer state shaped like it) as a DTensor over the same storage
    when `param` is a local tp shard; anything else unchanged (a DTensor already, a scalar, a replicated tensor)."""
    local = _sharding(param)
    if local is None or not isinstance(value, torch.Tensor) or isinstance(value, DTensor) or value.shape != param.shape:
        return value
    return _wrap(value, local)


def _wrap(local_value: torch.Tensor, sharding: Sharding) -> DTensor:
    return DTensor.from_local(local_value, sharding.mesh, sharding.placements, run_check=False, shape=sharding.shape,
                              stride=sharding.stride)


def share_layout(copy: torch.Tensor, param: torch.Tensor) -> None:
    """`copy` (an fp32 master of `param`, same local shape) is sharded as `param` is (and is a tied pipeline copy
    where `param` is one)."""
    if _sharding(param) is not None:
        tensor_state(copy).sharding = _sharding(param)
    if getattr(tensor_state(param, create=False), "pipeline_copy", False):
        tensor_state(copy).pipeline_copy = True


def localize_parameters(model: nn.Module, skip: Optional[set[int]] = None) -> int:
    """Store DTensor parameters as plain local shards; each module re-wraps its own around forward.

    Returns the number of parameters localized. Tied parameters stay one object. `skip`: ids of modules whose
    DTensors stay (a ZeRO-2/3 branch's, which FSDP2 shards next).
    """
    local_of: dict[int, nn.Parameter] = {}
    for module in model.modules():
        if skip and id(module) in skip:
            continue
        own = {n: p for n, p in module._parameters.items() if isinstance(p, DTensor)}
        if not own:
            continue
        for pname, p in own.items():
            if id(p) not in local_of:
                local = nn.Parameter(p.to_local().detach(), requires_grad=p.requires_grad)
                tensor_state(local).sharding = sharding_of(p)
                local_of[id(p)] = local
            module._parameters[pname] = local_of[id(p)]
        module_state(module).local_params = {n: module._parameters[n] for n in own}
        # first in, last out around the styles' own hooks (which may swap parameters themselves, see
        # `styles.ReplicateSumGrad`); `always_call`: a forward that raises leaves the plain shards in place, so the
        # user sees their error rather than Lightning's teardown failing to move half-swapped parameters
        module.register_forward_pre_hook(_to_dtensor_params, prepend=True)
        module.register_forward_hook(_to_local_params, always_call=True)
    return len(local_of)


def _to_dtensor_params(module: nn.Module, args: Any) -> None:
    for pname, local in module_state(module).local_params.items():
        module._parameters[pname] = _wrap(local, _sharding(local))  # type: ignore[assignment]


def _to_local_params(module: nn.Module, args: Any, output: Any) -> None:
    module._parameters.update(module_state(module).local_params)


def tensor_parallel_parameter_names(model: nn.Module) -> list[str]:
    """Parameters that differ between tp ranks (Lightning's whole-world broadcast must skip them)."""
    return [n for n, p in model.named_parameters() if sharding_of(p) is not None]


# ---- fused projections: recorded per FQN --------------------------------------------------------------------
def fused_parameters(model: nn.Module) -> dict[str, tuple[int, int, int]]:
    """FQN -> (dim, parts, tp) of the rank-major fused DTensor parameters (parts: a count, or the parts' sizes),
    read right after tp is applied (before localizing or FSDP2 replaces the parameter objects)."""
    out = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        fused = getattr(tensor_state(p, create=False), "fused", None)
        if isinstance(p, DTensor) and fused is not None and _is_fused(fused[1]):
            out[name] = (fused[0], fused[1], p.device_mesh.size())
    return out


def fused_layout(model: nn.Module) -> dict[str, tuple[int, int, int]]:
    """FQN -> (dim, parts, tp) of the fused projections kept rank-major (recorded when tp was applied)."""
    state = module_state(model, create=False)
    return dict(state.fused) if state is not None else {}


def set_fused_layout(model: nn.Module, fused: dict[str, tuple[int, int, int]]) -> None:
    module_state(model).fused = dict(fused)


def _sharding(t: torch.Tensor) -> Any:
    state = tensor_state(t, create=False)
    return state.sharding if state is not None else None
