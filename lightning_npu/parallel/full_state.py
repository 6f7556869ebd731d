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
from torch.distributed.tensor import DTensor

from lightning_npu.parallel import grad_norm as gn
from lightning_npu.parallel import tensor as tp
from lightning_npu.parallel.optimizer import masters_as_parameters, unwrap_optimizer


def _has_dtensor_params(module: nn.Module) -> bool:
    return any(isinstance(p, DTensor) for p in module.parameters())


def _optimizers(module: nn.Module) -> list[Any]:
    trainer = getattr(module, "_trainer", None)
    return list(getattr(getattr(trainer, "strategy", None), "optimizers", None) or ())


def _masters_as_parameters(module: nn.Module) -> Any:
    """bf16/16-true: the fp32 master weights are the exact weights; read and write those."""
    return masters_as_parameters(module, _optimizers(module))


def _local_full_state(module: nn.Module) -> dict[str, Any]:
    """This rank's model part (its pipeline stage) with tp / dp shards gathered: full tensors."""
    if _has_dtensor_params(module):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        state = get_model_state_dict(module, options=StateDictOptions(full_state_dict=True))
        return tp.unfuse_full_tensors(state, tp.fused_layout(module))
    if tp.is_tensor_parallel(module):
        return tp.gather_shards(module)
    return module.state_dict()


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
        if _has_dtensor_params(module):
            from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

            fused = tp.fused_layout(module)
            set_model_state_dict(module, tp.refuse_fused(state, fused),
                                 options=StateDictOptions(full_state_dict=True, strict=False))
        elif tp.is_tensor_parallel(module):
            tp.load_into_shards(module, state, strict=False)
        else:
            module.load_state_dict(state, strict=False)
    _refresh_distributed_optimizers(module)


def _refresh_distributed_optimizers(module: nn.Module) -> None:
    from lightning_npu.parallel.distributed_optimizer import DistributedOptimizer

    for opt in map(unwrap_optimizer, _optimizers(module)):
        if isinstance(opt, DistributedOptimizer):
            opt.refresh_masters_from_parameters()
