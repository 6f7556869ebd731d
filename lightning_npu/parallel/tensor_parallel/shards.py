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
* `full_tensors` / `load_full_tensors` / `shard_optimizer_state`: to and from full tensors in the model's
  original layout. Fused projections (``c_attn`` = q|k|v) are sharded rank-major (`tensor.Colwise`); their
  layout is recorded per FQN (`fused_layout`) because FSDP2 replaces the parameter objects, and it is undone
  here, once.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, distribute_tensor

from lightning_npu.parallel.checkpoint.optim_state import split_state_key
from lightning_npu.parallel.state import module_state, tensor_state
from lightning_npu.parallel.tensor_parallel.styles import _is_fused, _part_major, _rank_major


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


def localize_parameters(model: nn.Module) -> int:
    """Store DTensor parameters as plain local shards; each module re-wraps its own around forward.

    Returns the number of parameters localized. Tied parameters stay one object.
    """
    local_of: dict[int, nn.Parameter] = {}
    for module in model.modules():
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


# ---- fused projections: recorded per FQN, undone once -------------------------------------------------------
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


def unfuse_full_tensors(full: dict[str, Any], fused: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Full tensors of rank-major fused projections -> the original (part-major) layout. Keys may carry `prefix`
    (``"state."`` for optimizer entries, whose keys then end in ``.<state name>``)."""
    return _map_fused(full, fused, prefix, _part_major)


def refuse_fused(full: dict[str, Any], fused: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Inverse of :func:`unfuse_full_tensors`: original layout -> the rank-major layout of `fused`'s tp size."""
    return _map_fused(full, fused, prefix, _rank_major)


def _map_fused(full: dict[str, Any], fused: dict[str, Any], prefix: str, relayout: Any) -> dict[str, Any]:
    out = dict(full)
    for key, value in full.items():
        name = key[len(prefix):] if prefix and key.startswith(prefix) else key
        for fqn, (dim, parts, tp) in fused.items():
            if (name == fqn or name.startswith(fqn + ".")) and isinstance(value, torch.Tensor) and value.dim() > dim:
                out[key] = relayout(value, dim, parts, tp)
    return out


# ---- full tensors in the original layout ----------------------------------------------------------------------
def _param_of(key: str, params: dict[str, torch.Tensor], prefix: str) -> Optional[torch.Tensor]:
    """The parameter a state key belongs to: ``fqn`` (model state) or ``state.<fqn>.<name>`` (optimizer state)."""
    if prefix:
        if not key.startswith(prefix):
            return None
        key = split_state_key(key, prefix)[0]
    return params.get(key)


def full_tensor(value: Any, param: Optional[torch.Tensor]) -> Any:
    """One state entry of `param` as its full tensor (fused projections still rank-major). A collective for
    sharded values: a DTensor (FSDP2 / ZeRO-1 slices) is gathered, then a local tp shard is gathered over tp."""
    if isinstance(value, DTensor):
        value = value.full_tensor()
    if param is not None:
        value = as_dtensor(value, param)
        if isinstance(value, DTensor):
            value = value.full_tensor()
    return value


def full_tensors(module: nn.Module, state: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """`state` (keyed by parameter FQN, or ``prefix + fqn + "." + name`` for optimizer state) as full tensors in
    the model's original layout. A collective over each tensor's mesh: every rank passes the same keys."""
    params = dict(module.named_parameters(remove_duplicate=False))
    full = {k: full_tensor(v, _param_of(k, params, prefix)) for k, v in state.items()}
    return unfuse_full_tensors(full, fused_layout(module), prefix)


def _local_slice(full: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """This rank's part of a full (rank-major) tensor shaped like `param`'s whole tensor; no communication."""
    local = _sharding(param)
    if local is None or not isinstance(full, torch.Tensor):
        return full
    if tuple(full.shape) != tuple(local.shape):
        raise ValueError(f"expected a full tensor of shape {tuple(local.shape)}, got {tuple(full.shape)}.")
    # every rank holds the full tensor: slice it here (src_data_rank=None), no communication
    return distribute_tensor(full, local.mesh, local.placements, src_data_rank=None).to_local().contiguous()


def load_full_tensors(module: nn.Module, state: dict[str, Any]) -> None:
    """Load full, original-layout tensors (keys a subset of the model's): each rank keeps its own shards."""
    state = refuse_fused(state, fused_layout(module))
    if any(isinstance(p, DTensor) for p in module.parameters()):  # FSDP2 / DTensor parameters: DCP's loader
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        set_model_state_dict(module, state, options=StateDictOptions(full_state_dict=True, strict=False))
        return
    params = dict(module.named_parameters(remove_duplicate=False))
    module.load_state_dict({k: _local_slice(v, params[k]) if k in params else v for k, v in state.items()},
                           strict=False)


def shard_optimizer_state(module: nn.Module, params: list[torch.Tensor], state_dict: dict[str, Any]) -> dict[str, Any]:
    """Torch's position-indexed optimizer state with full tensors (positions = `params`) -> this rank's shards."""
    fqn_of = {id(p): n for n, p in module.named_parameters(remove_duplicate=False)}
    fused = fused_layout(module)
    state = {}
    for idx, entry in state_dict["state"].items():
        param = params[idx]
        local = _sharding(param)
        if local is None:
            state[idx] = entry
            continue
        fqn = fqn_of.get(id(param), "")
        converted = {}
        for name, value in entry.items():
            if isinstance(value, torch.Tensor) and tuple(value.shape) == tuple(local.shape):
                value = _local_slice(refuse_fused({fqn: value}, fused)[fqn], param)
            converted[name] = value
        state[idx] = converted
    return {**state_dict, "state": state}


def _sharding(t: torch.Tensor) -> Any:
    state = tensor_state(t, create=False)
    return state.sharding if state is not None else None
