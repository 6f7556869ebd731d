"""Full tensors in the model's original layout, whatever the layout it trains in.

`full_state_dict` and `load_full_state_dict` are collectives (call them on every rank). They hide how a
layout stores a parameter: a tensor-parallel shard (with fused projections kept rank-major), an FSDP2
(ZeRO 2/3) slice, a pipeline stage's part of the model, or a 16-bit parameter whose fp32 master the
optimizer steps.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn

from lightning_npu.parallel.checkpoint.optim_state import (
    STATE_PREFIX,
    by_name,
    by_position,
    initialised_state,
    nested,
    reindexed,
)
from lightning_npu.parallel.checkpoint.sharded import optimizer_state_dict
from lightning_npu.parallel.optim import grad_norm as gn
from lightning_npu.parallel.optim.distributed import DistributedOptimizer
from lightning_npu.parallel.optim.mixed_precision import masters_as_parameters, unwrap_optimizer
from lightning_npu.parallel.state import module_state
from lightning_npu.parallel.tensor_parallel import shards as tp_shards


def _optimizers(module: nn.Module) -> list[Any]:
    trainer = getattr(module, "_trainer", None)
    return list(getattr(getattr(trainer, "strategy", None), "optimizers", None) or ())


def _masters_as_parameters(module: nn.Module) -> Any:
    """bf16/16-true: the fp32 master weights are the exact weights; read and write those."""
    return masters_as_parameters(module, _optimizers(module))


def _local_full_state(module: nn.Module) -> dict[str, Any]:
    """This rank's model part (its pipeline stage) with tp / dp shards gathered: full tensors."""
    return tp_shards.full_tensors(module, module.state_dict())


def full_state_dict(module: nn.Module) -> dict[str, torch.Tensor]:
    """The whole model's state dict as full CPU tensors in its original layout (fused projections un-fused).

    Works under every layout (dp, ZeRO 0-3, tp, sequence parallel, pp and their products); a collective.
    Under bf16-true/16-true with HybridPrecision's master weights (ZeRO 0, 2, 3) those fp32 masters are returned.
    """
    with _masters_as_parameters(module):
        state = {k: v.detach().cpu().clone() if isinstance(v, torch.Tensor) else v
                 for k, v in _local_full_state(module).items()}
    group = gn.pipeline_group(getattr(module, "_device_mesh", None))
    if group is None:
        return state
    parts: list[Optional[dict[str, Any]]] = [None] * dist.get_world_size(group)
    dist.all_gather_object(parts, state, group=group)  # each stage holds a disjoint part of the model
    merged: dict[str, Any] = {}
    for part in parts:
        merged.update(part or {})
    return merged


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
        tp_shards.load_full_tensors(module, state)
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
        flat = optimizer_state_dict(module, optimizer)
        state = tp_shards.full_tensors(module, {k: v for k, v in flat.items() if k.startswith(STATE_PREFIX)},
                                       STATE_PREFIX)
    state = {k: v.detach().cpu().clone() if isinstance(v, torch.Tensor) else v for k, v in state.items()}
    group = gn.pipeline_group(getattr(module, "_device_mesh", None))
    if group is not None:  # each stage holds the state of its own parameters
        parts: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(parts, state, group=group)
        state = {k: v for part in parts for k, v in part.items()}
    return by_position(groups, state)


def optimizer_groups(module: nn.Module, optimizer: Any) -> list[dict[str, Any]]:
    """Each param group's hyper-parameters and parameter FQNs (``"params"``), for the whole model (a collective
    under pp): what turns a sharded checkpoint's FQN-keyed optimizer state back into torch's format offline."""
    optimizer = unwrap_optimizer(optimizer)
    with masters_as_parameters(module, [optimizer]):
        fqn_of = _param_fqns(module, optimizer)
        groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": [fqn_of[id(p)] for p in g["params"]]}
                  for g in optimizer.param_groups]
    group = gn.pipeline_group(getattr(module, "_device_mesh", None))
    if group is not None:
        parts: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(parts, groups, group=group)
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
        fqns = [fqn_of[id(p)] for g in optimizer.param_groups for p in g["params"]]
        if len(fqns) != sum(len(g["params"]) for g in state_dict["param_groups"]):
            raise ValueError("The checkpoint's optimizer state does not match this optimizer's parameters (count "
                             "differs); resume with the same `configure_optimizers`.")
        flat, groups = by_name(state_dict, fqns)
        flat = tp_shards.refuse_fused(flat, tp_shards.fused_layout(module), STATE_PREFIX)
        with initialised_state(optimizer):
            set_optimizer_state_dict(module, optimizer, {"state": nested(flat), "param_groups": groups},
                                     options=StateDictOptions(full_state_dict=True))


def select_optimizer_state(module: nn.Module, optimizer: Any, state_dict: dict[str, Any],
                           saved_fqns: list[list[str]]) -> dict[str, Any]:
    """A whole-model optimizer state in torch's format, whose positions are the parameters `saved_fqns` names
    (per group), re-indexed for `optimizer`'s own parameters: a pipeline stage's optimizer holds only its part."""
    optimizer = unwrap_optimizer(optimizer)
    with masters_as_parameters(module, [optimizer]):
        fqn_of = _param_fqns(module, optimizer)
        own = [[fqn_of[id(p)] for p in g["params"]] for g in optimizer.param_groups]
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
