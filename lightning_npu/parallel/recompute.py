"""Activation checkpointing of the model's blocks (``activation_checkpointing``).

torch's composable ``checkpoint`` puts the recompute in forward pre/post hooks instead of a wrapper module, so
parameter names (which checkpoints, the tp plan and the ZeRO-1 buckets key on) and the pipeline split's module
tree stay as they were. It is non-reentrant and restores the RNG and autocast state for the recompute: dropout
masks and the fp32 islands of bf16-mixed come out identical.

Policies:

- ``N`` (int): the N-th, 2N-th, ... block (``1`` is every block);
- ``"full"``: every block; backward keeps only each block's input;
- ``"selective"``: every block, but matmul and attention outputs are kept (torch's selective activation
  checkpointing), so only the cheap element-wise ops (norms, activations, softmax, dropout) run twice.
"""

from __future__ import annotations

import functools
import warnings
from dataclasses import dataclass
from typing import Any, Union

import torch
from torch import nn

from lightning_npu.memory import note_kept

POLICIES = ("full", "selective")

# outputs that "selective" keeps: recomputing them would cost as much as the forward itself
_SAVED_OPS = tuple(
    op
    for name in (
        "mm", "addmm", "bmm", "baddbmm", "_scaled_mm",
        "_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_for_cpu",
        "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
    )
    if (op := getattr(torch.ops.aten, name, None)) is not None
)


@dataclass(frozen=True)
class RecomputeReport:
    """What `apply_activation_checkpointing` did: the block list, the policy, and which blocks recompute."""

    blocks: str
    policy: Union[int, str]
    checkpointed: tuple[int, ...]
    num_blocks: int

    def __str__(self) -> str:
        return (f"activation checkpointing {self.policy!r}: {len(self.checkpointed)} of {self.num_blocks} blocks of "
                f"`{self.blocks}` recompute in backward")


def checkpointed_indices(num_blocks: int, policy: Union[int, str]) -> tuple[int, ...]:
    if isinstance(policy, str):
        return tuple(range(num_blocks))
    return tuple(i for i in range(num_blocks) if (i + 1) % policy == 0)


def block_list(module: nn.Module) -> tuple[str, nn.ModuleList]:
    """The model's blocks: the ``pipeline_layout`` declaration's, or the ``nn.ModuleList`` holding the most
    parameters (GPT's ``transformer.h``, a ``transformers`` decoder's ``layers``), as the pipeline split finds them."""
    from lightning_npu.parallel.pipeline import declared_layout, find_blocks

    fqn = declared_layout(module).blocks or find_blocks(module)
    return fqn, module.get_submodule(fqn)


def apply_activation_checkpointing(module: nn.Module, policy: Union[int, str]) -> RecomputeReport:
    from torch.distributed._composable import checkpoint

    fqn, blocks = block_list(module)
    chosen = checkpointed_indices(len(blocks), policy)
    if not chosen:
        warnings.warn(
            f"`activation_checkpointing={policy}` is larger than the {len(blocks)} blocks of `{fqn}`: no block is "
            f"recomputed; use a value <= {len(blocks)} (1 or 'full' recomputes every block).",
            stacklevel=2,
        )
    context_fn = _selective_contexts if policy == "selective" else None
    for i in chosen:
        block = blocks[i]
        if getattr(block, "_lnpu_recompute", None) is not None:
            continue  # fit -> validate -> fit: hooks are registered once
        checkpoint(block, context_fn=context_fn) if context_fn is not None else checkpoint(block)
        block._lnpu_recompute = policy
    return RecomputeReport(fqn, policy, chosen, len(blocks))


def _selective_contexts() -> Any:
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    return create_selective_checkpoint_contexts(_keep_matmuls)


@functools.lru_cache(maxsize=None)
def _policy_values() -> tuple[Any, Any]:
    from torch.utils.checkpoint import CheckpointPolicy

    return CheckpointPolicy.MUST_SAVE, CheckpointPolicy.PREFER_RECOMPUTE


def _keep_matmuls(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
    save, recompute = _policy_values()
    if getattr(op, "overloadpacket", op) not in _SAVED_OPS:
        return recompute
    if not ctx.is_recompute:
        note_kept(getattr(ctx, "op_output", None))  # torch's cache holds it: MemoryMonitor counts it
    return save
