"""Full tensors in the model's original layout, whatever the layout it trains in: every conversion between a
layout's shards and full tensors lives here, once.

How a shard is held is `tensor_parallel.shards`' (a DTensor, or a plain local tp shard with its `Sharding`);
this module turns those into full tensors and back:

* gathers: `full_tensor` (one entry: FSDP2 / ZeRO-1 slices, then tp), `full_tensors` (a state dict), and
  `gather_stages` (each pipeline stage holds a disjoint part of the model);
* scatter back: `local_slice`, `shard_like`, `load_full_tensors`, `shard_optimizer_state` (each rank slices
  its own part of a full tensor every rank holds: no communication);
* fused projections (q|k|v, gate|up), kept rank-major under tp: `unfuse_full_tensors`, `refuse_fused`,
  `relayout_fused` (from one tp size's layout to another's);
* the public `full_state_dict` / `load_full_state_dict`, and torch's optimizer format with full tensors.

`full_state_dict` and `load_full_state_dict` are collectives (call them on every rank). Under bf16-true /
16-true the optimizer's fp32 masters are the weights read and written.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from lightning_npu.parallel.checkpoint.optim_state import (
    STATE_PREFIX,
    by_name,
    by_position,
    flat_state,
    initialised_state,
    nested,
    reindexed,
    split_state_key,
)
from lightning_npu.parallel.optim import grad_norm as gn
from lightning_npu.parallel.optim.distributed import DistributedOptimizer
from lightning_npu.parallel.optim.mixed_precision import (
    masters_as_parameters,
    stepped_groups,
    stepped_optimizer,
    unwrap_optimizer,
)
from lightning_npu.parallel.state import module_state
from lightning_npu.parallel.tensor_parallel.shards import Sharding, as_dtensor, fused_layout, sharding_of
from lightning_npu.parallel.tensor_parallel.styles import _part_major, _rank_major


# ---- fused projections: rank-major under tp, the original (part-major) layout in full tensors ---------------
def unfuse_full_tensors(full: dict[str, Any], fused: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Full tensors of rank-major fused projections -> the original (part-major) layout. Keys may carry `prefix`
    (``"state."`` for optimizer entries, whose keys then end in ``.<state name>``)."""
    return _map_fused(full, fused, prefix, _part_major)


def refuse_fused(full: dict[str, Any], fused: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Inverse of :func:`unfuse_full_tensors`: original layout -> the rank-major layout of `fused`'s tp size."""
    return _map_fused(full, fused, prefix, _rank_major)


def relayout_fused(full: dict[str, Any], saved: dict[str, Any], current: dict[str, Any],
                   prefix: str = "") -> dict[str, Any]:
    """Full tensors in the fused layout `saved` (another tp size's) -> the layout `current`."""
    return refuse_fused(unfuse_full_tensors(full, saved, prefix), current, prefix)


def _map_fused(full: dict[str, Any], fused: dict[str, Any], prefix: str, relayout: Any) -> dict[str, Any]:
    out = dict(full)
    for key, value in full.items():
        name = key[len(prefix):] if prefix and key.startswith(prefix) else key
        for fqn, (dim, parts, tp) in fused.items():
            if (name == fqn or name.startswith(fqn + ".")) and isinstance(value, torch.Tensor) and value.dim() > dim:
                out[key] = relayout(value, dim, parts, tp)
    return out


# ---- gathers: shards -> full tensors --------------------------------------------------------------------------
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


def cpu_copy(state: dict[str, Any]) -> dict[str, Any]:
    """Detached CPU copies of `state`'s tensors (what the full state hands out: nothing aliases the model)."""
    return {k: v.detach().cpu().clone() if isinstance(v, torch.Tensor) else v for k, v in state.items()}


def gather_stages(module: nn.Module, part: Any) -> Optional[list[Any]]:
    """Every pipeline stage's `part` (picklable; e.g. the state of its own parameters), in stage order; None
    without pp. A collective over the pp group."""
    group = gn.pipeline_group(getattr(module, "_device_mesh", None))
    if group is None:
        return None
    parts: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(parts, part, group=group)
    return parts


def _merged_stages(module: nn.Module, state: dict[str, Any]) -> dict[str, Any]:
    """The whole model's entries from each stage's disjoint `state` (itself without pp)."""
    parts = gather_stages(module, state)
    return state if parts is None else {k: v for part in parts for k, v in (part or {}).items()}


# ---- scatter back: full tensors -> this rank's shards (no communication) -------------------------------------
def _slice(full: torch.Tensor, mesh: Any, placements: Any) -> DTensor:
    # every rank holds the full tensor: each slices its own part (src_data_rank=None), no communication
    return distribute_tensor(full, mesh, placements, src_data_rank=None)


def local_slice(full: Any, param: torch.Tensor) -> Any:
    """This rank's part of a full (rank-major) tensor shaped like `param`'s whole tensor, where `param` is a
    plain local tp shard; `full` unchanged otherwise."""
    local = sharding_of(param) if not isinstance(param, DTensor) else None
    if local is None or not isinstance(full, torch.Tensor):
        return full
    if tuple(full.shape) != tuple(local.shape):
        raise ValueError(f"expected a full tensor of shape {tuple(local.shape)}, got {tuple(full.shape)}.")
    return _slice(full, local.mesh, local.placements).to_local().contiguous()


def shard_like(full: dict[str, Any], like: dict[str, Any]) -> dict[str, Any]:
    """This rank's (dp, tp) shard of each full tensor, laid out as `like`'s (DTensors where `like` has them)."""
    out = {}
    for k, v in like.items():
        f = full[k]
        if isinstance(v, DTensor) and isinstance(f, torch.Tensor) and not isinstance(f, DTensor):
            f = _slice(f.to(v.dtype), v.device_mesh, v.placements)
        elif isinstance(v, torch.Tensor) and isinstance(f, torch.Tensor):
            f = f.to(device=v.device, dtype=v.dtype)
        out[k] = f
    return out


def load_full_tensors(module: nn.Module, state: dict[str, Any]) -> None:
    """Load full, original-layout tensors (keys a subset of the model's): each rank keeps its own shards."""
    state = refuse_fused(state, fused_layout(module))
    if any(isinstance(p, DTensor) for p in module.parameters()):  # FSDP2 / DTensor parameters: DCP's loader
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        set_model_state_dict(module, state, options=StateDictOptions(full_state_dict=True, strict=False))
        return
    params = dict(module.named_parameters(remove_duplicate=False))
    module.load_state_dict({k: local_slice(v, params[k]) if k in params else v for k, v in state.items()},
                           strict=False)


def shard_optimizer_state(module: nn.Module, params: list[torch.Tensor], state_dict: dict[str, Any]) -> dict[str, Any]:
    """Torch's position-indexed optimizer state with full tensors (positions = `params`) -> this rank's shards."""
    fqn_of = {id(p): n for n, p in module.named_parameters(remove_duplicate=False)}
    fused = fused_layout(module)
    state = {}
    for idx, entry in state_dict["state"].items():
        param = params[idx]
        local: Optional[Sharding] = sharding_of(param) if not isinstance(param, DTensor) else None
        if local is None:
            state[idx] = entry
            continue
        fqn = fqn_of.get(id(param), "")
        converted = {}
        for name, value in entry.items():
            if isinstance(value, torch.Tensor) and tuple(value.shape) == tuple(local.shape):
                value = local_slice(refuse_fused({fqn: value}, fused)[fqn], param)
            converted[name] = value
        state[idx] = converted
    return {**state_dict, "state": state}


# ---- the public functions -------------------------------------------------------------------------------------
def _optimizers(module: nn.Module) -> list[Any]:
    trainer = getattr(module, "_trainer", None)
    return list(getattr(getattr(trainer, "strategy", None), "optimizers", None) or ())


def _masters_as_parameters(module: nn.Module) -> Any:
    """bf16/16-true: the fp32 master weights are the exact weights; read and write those."""
    return masters_as_parameters(module, _optimizers(module))


def full_state_dict(module: nn.Module) -> dict[str, torch.Tensor]:
    """The whole model's state dict as full CPU tensors in its original layout (fused projections un-fused).

    Works under every layout (dp, ZeRO 0-3, tp, sequence parallel, pp and their products); a collective.
    Under bf16-true/16-true with HybridPrecision's master weights (ZeRO 0, 2, 3) those fp32 masters are returned.
    """
    with _masters_as_parameters(module):  # this rank's stage, tp / dp shards gathered
        state = cpu_copy(full_tensors(module, module.state_dict()))
    return _merged_stages(module, state)


def load_full_state_dict(module: nn.Module, state: dict[str, Any], strict: bool = True) -> None:
    """Load full, original-layout tensors (as `full_state_dict` returns, or a 1-process `state_dict`) into a
    model in any layout: each rank keeps its own shards and its own pipeline stage's keys. A collective.

    The ZeRO-1 optimizer's fp32 master slices are refreshed from the loaded weights.
    """
    own = set(module.state_dict().keys())
    missing = sorted(own - state.keys())
    if strict and missing:
        raise KeyError(
            f"load_full_state_dict: the state lacks {len(missing)} of the model's keys, e.g. {missing[:8]}; pass the "
            "whole model's state (lightning_npu.full_state_dict) or strict=False."
        )
    pipelined = gn.pipeline_group(getattr(module, "_device_mesh", None)) is not None
    if strict and not pipelined:  # under pp the other stages' keys are expected here
        unexpected = sorted(state.keys() - own)
        if unexpected:
            raise KeyError(
                f"load_full_state_dict: {len(unexpected)} keys are not in the model, e.g. {unexpected[:8]}; load the "
                "state of the same model or pass strict=False."
            )
    state = {k: v for k, v in state.items() if k in own}
    with _masters_as_parameters(module):
        load_full_tensors(module, state)
    _refresh_distributed_optimizers(module)


def _refresh_distributed_optimizers(module: nn.Module) -> None:
    for opt in map(unwrap_optimizer, _optimizers(module)):
        if isinstance(opt, DistributedOptimizer):
            opt.refresh_masters_from_parameters()


# ---- optimizer state as torch's own format, with full tensors ---------------------------------------------
def _param_fqns(module: nn.Module, optimizer: Any) -> dict[int, str]:
    """id of each tensor in the optimizer's groups -> its parameter's FQN (ZeRO-1 groups hold master slices)."""
    if hasattr(optimizer, "master_state_dict"):
        return {id(m): fqn for fqn, m in optimizer.master_state_dict().items()}
    return {id(p): n for n, p in module.named_parameters(remove_duplicate=False)}


def full_optimizer_state_dict(module: nn.Module, optimizer: Any) -> dict[str, Any]:
    """`optimizer.state_dict()` as a 1-process run of the same model would have it: ``state`` indexed by the
    position of each parameter in the groups, full tensors in the original layout, and ``param_groups``. A
    collective (call on every rank), in any layout; a plain `torch.optim` optimizer, or Lightning under "ddp",
    loads it with ``load_state_dict``. Why: a single-file checkpoint must be loadable without lightning-npu.
    """
    optimizer = unwrap_optimizer(optimizer)
    groups = optimizer_groups(module, optimizer)
    with masters_as_parameters(module, [optimizer]):  # 16-bit params' fp32 masters are keyed by the params' FQNs
        flat = flat_state(module, optimizer)
        own = {k: v for k, v in flat.items() if k.startswith(STATE_PREFIX)}
        state = cpu_copy(full_tensors(module, own, STATE_PREFIX))
    return by_position(groups, _merged_stages(module, state))  # each stage holds its own parameters' state


def optimizer_groups(module: nn.Module, optimizer: Any) -> list[dict[str, Any]]:
    """Each param group's hyper-parameters and parameter FQNs (``"params"``), for the whole model (a collective
    under pp): what turns a sharded checkpoint's FQN-keyed optimizer state back into torch's format offline."""
    optimizer = unwrap_optimizer(optimizer)
    with masters_as_parameters(module, [optimizer]):
        fqn_of = _param_fqns(module, optimizer)
        groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": [fqn_of[id(p)] for p in g["params"]]}
                  for g in stepped_groups(optimizer)]
    parts = gather_stages(module, groups)
    if parts is not None:
        order = getattr(module_state(module, create=False), "parameter_order", None) or {}
        groups = [{**gs[0], "params": sorted((f for g in gs for f in g["params"]), key=lambda f: order.get(f, len(order)))}
                  for gs in zip(*parts)]
    return groups


def load_full_optimizer_state_dict(module: nn.Module, optimizer: Any, state_dict: dict[str, Any]) -> None:
    """Load torch's position-indexed optimizer format with full tensors (a single-file checkpoint, as
    :func:`full_optimizer_state_dict` writes) into an optimizer over FSDP2 (ZeRO 2/3) shards: each rank keeps
    its own slices. A collective."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    optimizer = unwrap_optimizer(optimizer)
    with masters_as_parameters(module, [optimizer]):
        fqn_of = _param_fqns(module, optimizer)
        fqns = [fqn_of[id(p)] for g in stepped_groups(optimizer) for p in g["params"]]
        if len(fqns) != sum(len(g["params"]) for g in state_dict["param_groups"]):
            raise ValueError("The checkpoint's optimizer state does not match this optimizer's parameters (count "
                             "differs); resume with the same `configure_optimizers`.")
        flat, groups = by_name(state_dict, fqns)
        flat = refuse_fused(flat, fused_layout(module), STATE_PREFIX)
        if not any(isinstance(v, torch.Tensor) and v.dim() > 0 for v in flat.values()):
            _load_without_tensors(optimizer, nested(flat), groups, fqn_of)
            return
        with initialised_state(optimizer):
            set_optimizer_state_dict(module, optimizer, {"state": nested(flat), "param_groups": groups},
                                     options=StateDictOptions(full_state_dict=True))


def _load_without_tensors(optimizer: Any, state: dict[str, dict[str, Any]], groups: list[dict[str, Any]],
                          fqn_of: dict[int, str]) -> None:
    """A state with nothing to shard (SGD without momentum: no state, or scalars): the groups' hyper-parameters and
    the entries as they are. torch's full-state loader looks for a tensor to learn the device from, and raises
    without one."""
    inner = stepped_optimizer(optimizer)
    for group, saved in zip(inner.param_groups, groups, strict=True):
        group.update({k: v for k, v in saved.items() if k != "params"})
    by_fqn = {fqn_of[id(p)]: p for group in inner.param_groups for p in group["params"]}
    for fqn, entry in state.items():
        inner.state[by_fqn[fqn]].update(entry)


def select_optimizer_state(module: nn.Module, optimizer: Any, state_dict: dict[str, Any],
                           saved_fqns: list[list[str]]) -> dict[str, Any]:
    """A whole-model optimizer state in torch's format, whose positions are the parameters `saved_fqns` names
    (per group), re-indexed for `optimizer`'s own parameters: a pipeline stage's optimizer holds only its part."""
    optimizer = unwrap_optimizer(optimizer)
    with masters_as_parameters(module, [optimizer]):
        fqn_of = _param_fqns(module, optimizer)
        own = [[fqn_of[id(p)] for p in g["params"]] for g in stepped_groups(optimizer)]
    saved = [f for group in saved_fqns for f in group]
    known = set(saved)
    missing = [f for group in own for f in group if f not in known]
    if missing or len(own) != len(state_dict["param_groups"]):
        raise ValueError(
            f"The checkpoint's optimizer state does not match this optimizer ({len(state_dict['param_groups'])} "
            f"saved param groups, {len(own)} here; parameters not in it: {missing[:8]}); resume with the same "
            "model and `configure_optimizers`."
        )
    return reindexed(state_dict, saved, own)
