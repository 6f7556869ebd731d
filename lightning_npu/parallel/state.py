"""What lightning-npu records on the modules and tensors it parallelizes: one typed record each, under one attribute,
read and written through `module_state` / `tensor_state`, so a user's module carries no loose private attributes
and every reader sees the same fields the writer set."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch

_ATTR = "_lightning_npu"


@dataclass
class ModuleState:
    fused: dict[str, Any] = field(default_factory=dict)  # the model: its fused projections' tp layout (`shards`)
    parameter_order: dict[str, int] = field(default_factory=dict)  # the model: each name's index before the pp split
    recompute: Optional[str] = None  # a block: its activation-checkpointing policy (`recompute`)
    local_params: Optional[dict[str, torch.nn.Parameter]] = None  # a tp module: its plain local shards (`shards`)
    fp32_stack: list = field(default_factory=list)  # an fp32 island: the autocast states its hooks restore
    fp32_island: bool = False  # an fp32 island's hooks are installed
    experts: Any = None  # an experts module under expert parallelism: its `dispatch.ExpertShard`
    expert_mesh: Any = None  # the model under expert parallelism: the (rest, edp, ep, tp) mesh (`dispatch`)
    gradient_divisor: Optional[int] = None  # an FSDP2 unit averaging over more ranks than its group (`wrap`)
    branch: Any = None  # a branch module under `branch_layouts`: its `branch.apply.BranchShard`
    split_by: Optional[tuple[str, str]] = None  # the model: (the strategy that split it, how): `parallelize`


@dataclass
class TensorState:
    sharding: Any = None  # a plain local tp shard: its `shards.Sharding`
    fused: Optional[tuple[int, Any]] = None  # a fused projection's tp shard: (dim, parts or their sizes), rank-major
    master: bool = False  # a ZeRO-1 fp32 master slice: checkpoints store it in place of its parameter
    view: bool = False  # a checkpoint template's DTensor view of a local shard: loaded in place
    pipeline_copy: bool = False  # the last pipeline stage's copy of a tied embedding: norms count stage 0's


def module_state(module: torch.nn.Module, create: bool = True) -> Optional[ModuleState]:
    # module.__dict__, not getattr: FSDP2 and the fused-op rewrite swap classes, and __getattr__ is slow in hooks
    state = module.__dict__.get(_ATTR)
    if state is None and create:
        state = module.__dict__[_ATTR] = ModuleState()
    return state


def tensor_state(tensor: torch.Tensor, create: bool = True) -> Optional[TensorState]:
    state = getattr(tensor, _ATTR, None)
    if state is None and create:
        state = TensorState()
        setattr(tensor, _ATTR, state)
    return state
