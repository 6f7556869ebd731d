"""`ContextParallel`: what the strategy installs on a model under ``context_parallel_size>1`` and enters around
each step.

Installed once per model: a forward pre-hook on each outermost module whose ``forward`` takes ``position_ids``
(a transformers ``*ForCausalLM``, the example GPT) gives it this rank's global position ids, and hands a
transformers model the already shifted ``labels`` as ``shift_labels``; transformers models switch to the
context-parallel attention function (`attention.hf_attention`). Per step: the batch is cut to this rank's chunks
(`layout.split_batch`) and `attention.ContextParallelMode` is entered around the forward.
"""

from __future__ import annotations

import inspect
from contextlib import contextmanager
from typing import Iterator

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from lightning_npu.parallel.context_parallel import attention, ring
from lightning_npu.parallel.context_parallel.layout import ChunkLayout, split_batch


def _takes_position_ids(module: nn.Module) -> bool:
    try:
        return "position_ids" in inspect.signature(module.forward).parameters
    except (TypeError, ValueError):
        return False


def position_modules(model: nn.Module) -> list[nn.Module]:
    """The outermost modules whose forward takes ``position_ids`` (inner ones receive what these pass on)."""
    found: list[nn.Module] = []
    covered: set[int] = set()
    for module in model.modules():  # pre-order: a parent comes before its children
        if id(module) in covered:
            continue
        if _takes_position_ids(module):
            found.append(module)
            covered.update(id(m) for m in module.modules())
    return found


class ContextParallel:
    def __init__(self, module: nn.Module, mesh: DeviceMesh, method: str = "ring") -> None:
        cp_mesh = mesh["cp"]
        self.module = module
        self.group = cp_mesh.get_group()
        self.method = method
        self.ring = ring.Ring(self.group)
        self.layout = ChunkLayout(cp_mesh.size(), cp_mesh.get_local_rank())
        self.seq_len: int = 0
        self.shifted_labels = False
        self.targets = position_modules(module)
        if not self.targets:
            raise ValueError(
                f"`context_parallel_size={self.layout.cp}` gives each rank the global position ids of its chunks, "
                f"but no module of {type(module).__name__} takes `position_ids` in its forward; add a "
                "`position_ids=None` argument to the model's forward (used in place of arange(seq_len)), or set "
                "context_parallel_size=1.")
        self.hf_models = [m for m in self.targets if hasattr(m, "set_attn_implementation")]
        if self.hf_models:
            attention.register_hf_attention()
        for m in self.hf_models:
            m.set_attn_implementation(attention.HF_IMPLEMENTATION)
        self._hooks = [m.register_forward_pre_hook(self._pre_forward, with_kwargs=True) for m in self.targets]

    def _pre_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if not attention.STATE.active:
            return args, kwargs  # outside a context-parallel step (e.g. a user's own forward call)
        bound = inspect.signature(module.forward).bind_partial(*args, **kwargs).arguments
        if bound.get("position_ids") is None:
            kwargs = {**kwargs, "position_ids": attention.STATE.query_positions[None]}
        if self.shifted_labels and module in self.hf_models and bound.get("labels") is not None:
            kwargs.setdefault("shift_labels", bound["labels"])
        return args, kwargs

    def split_args(self, args: tuple) -> tuple:
        """The step's batch (its first argument) cut to this rank's chunks."""
        if not args:
            return args
        batch, self.seq_len = split_batch(args[0], self.layout)
        self.shifted_labels = isinstance(args[0], dict) and "labels" in args[0]
        return (batch, *args[1:])

    @contextmanager
    def step(self, device: torch.device) -> Iterator[None]:
        state = attention.STATE
        state.group = self.group
        state.query_positions = self.layout.positions(self.seq_len, device)
        state.key_positions = self.layout.gathered_positions(self.seq_len, device)
        state.key_order = torch.argsort(state.key_positions)
        state.chunks = self.layout.chunks(self.layout.rank)
        state.method, state.ring = self.method, self.ring
        state.all_chunks = tuple(self.layout.chunks(r) for r in range(self.layout.cp))
        state.active = True
        try:
            with attention.ContextParallelMode():
                yield
        finally:  # the positions stay for backward's recompute (activation checkpointing)
            state.active = False
