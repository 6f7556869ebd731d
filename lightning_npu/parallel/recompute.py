"""Activation checkpointing of the model's blocks (``activation_checkpointing``).

torch's composable ``checkpoint`` puts the recompute in forward pre/post hooks instead of a wrapper module, so
parameter names (which checkpoints, the tp plan and the ZeRO-1 buckets key on) and the pipeline split's module
tree stay as they were. It is non-reentrant and restores the RNG and autocast state for the recompute: dropout
masks and the fp32 islands of bf16-mixed come out identical.

Policies:

- ``N`` (int): the N-th, 2N-th, ... block (``1`` is every block);
- ``"full"``: every block; backward keeps only each block's input;
- ``"selective"``: every block, but matmul and attention outputs are kept (torch's selective activation
  checkpointing), so only the cheap element-wise ops (norms, activations, softmax, dropout) run twice;
- ``"auto"``: the fewest blocks (the first k, Megatron's "block" method) whose recompute makes the saved
  activations fit a budget, measured on the first training step (`AutoRecompute`).
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from dataclasses import dataclass
from typing import Any, Optional, Union

import torch
from torch import nn

from lightning_npu.memory import SavedActivations, model_state_bytes, note_kept, storage_bytes, storage_keys
from lightning_npu.parallel.context_parallel.attention import ContextParallelMode
from lightning_npu.parallel.pipeline_parallel.plan import declared_layout, find_blocks
from lightning_npu.parallel.state import module_state
from lightning_npu.precision.hybrid import FUNCTION_MODES

POLICIES = ("full", "selective")
# the function modes a block's recompute re-enters: the precision plugin's, and context parallelism's attention
REPLAYED_MODES = (*FUNCTION_MODES, ContextParallelMode)

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
    if policy == "auto":  # calibrated by AutoRecompute: every block but the first, which is measured
        return tuple(range(1, num_blocks))
    if isinstance(policy, str):
        return tuple(range(num_blocks))
    return tuple(i for i in range(num_blocks) if (i + 1) % policy == 0)


def block_list(module: nn.Module) -> tuple[str, nn.ModuleList]:
    """The model's blocks: the ``pipeline_layout`` declaration's, or the ``nn.ModuleList`` holding the most
    parameters (GPT's ``transformer.h``, a ``transformers`` decoder's ``layers``), as the pipeline split finds them."""
    fqn = declared_layout(module).blocks or find_blocks(module)
    return fqn, module.get_submodule(fqn)


def _disable_kv_cache(module: nn.Module) -> None:
    """A transformers decoder left at ``use_cache=True`` appends each block's keys and values to a cache in forward;
    the recompute would append them a second time (keys twice the mask's length). Training never reads that cache,
    so it is turned off, as transformers' own gradient checkpointing does."""
    for sub in module.modules():
        config = getattr(sub, "config", None)
        if getattr(config, "use_cache", False) is True:
            config.use_cache = False


def apply_activation_checkpointing(module: nn.Module, policy: Union[int, str]) -> RecomputeReport:
    from torch.distributed._composable import checkpoint

    _disable_kv_cache(module)
    fqn, blocks = block_list(module)
    chosen = checkpointed_indices(len(blocks), policy)
    if not chosen:
        warnings.warn(
            f"`activation_checkpointing={policy}` is larger than the {len(blocks)} blocks of `{fqn}`: no block is "
            f"recomputed; use a value <= {len(blocks)} (1 or 'full' recomputes every block).",
            stacklevel=2,
        )
    context_fn = functools.partial(_contexts, selective=policy == "selective")
    for i in range(len(blocks)) if policy == "auto" else chosen:
        block = blocks[i]
        if module_state(block).recompute is not None:
            continue  # fit -> validate -> fit: hooks are registered once
        checkpoint(block, context_fn=context_fn)
        module_state(block).recompute = policy
    report = RecomputeReport(fqn, policy, chosen, len(blocks))
    if policy == "auto":
        _enable(blocks, chosen)
    return report


def _enable(blocks: nn.ModuleList, chosen: tuple[int, ...]) -> None:
    from torch.distributed._composable import checkpoint

    for i, block in enumerate(blocks):
        checkpoint.state(block).enable_hook = i in chosen


class AutoRecompute:
    """``activation_checkpointing="auto"``: measure the first training step, then recompute the fewest blocks that fit.

    The first step recomputes every block but the first, whose saved bytes (besides its input) are counted on their
    own; the step's peak then gives the rest. With n blocks, each saving ``inside`` bytes, recomputing k of them
    leaves ``peak_1 + (n - 1 - k) * inside`` saved. `decide` picks the smallest k within the budget (the budget
    less the model state this rank holds), takes the largest k over every rank (a recomputed block re-runs its
    collectives in backward: tp peers must agree), and keeps it for the rest of training.
    """

    def __init__(self, module: nn.Module, budget_bytes: Optional[float]) -> None:
        self.fqn, self.blocks = block_list(module)
        self.budget_bytes = budget_bytes
        self.report: Optional[RecomputeReport] = None
        ignore = storage_keys(module.parameters())
        self._step = SavedActivations(ignore)
        self._block = SavedActivations(ignore)
        self._input_bytes = 0
        self._handles = [
            self.blocks[0].register_forward_pre_hook(self._enter_first_block),
            self.blocks[0].register_forward_hook(lambda *_: self._block.stop()),
        ]

    def _enter_first_block(self, module: nn.Module, args: tuple) -> None:
        self._input_bytes = storage_bytes(a for a in args if isinstance(a, torch.Tensor))
        self._block.start()  # (while it counts, the step's meter does not see these: hooks do not nest)

    def before_step(self, module: nn.Module, optimizers: list, device: torch.device, free_bytes: float) -> None:
        """Training step 1: measure it; step 2: decide (a no-op afterwards)."""
        if self.report is not None:
            return
        if self._step.peak == 0:
            self._step.start()
            return
        self.decide(sum(model_state_bytes(module, optimizers).values()), free_bytes, device)
        from lightning.pytorch.utilities import rank_zero_info

        rank_zero_info(f"{self.report} (predicted {self.predicted_bytes / 2**20:.1f} MiB saved per step on rank 0)")

    def after_forward(self) -> None:
        self._step.stop()

    def decide(self, model_state_bytes: int, free_bytes: float, device: Any = "cpu") -> RecomputeReport:
        import torch.distributed as dist

        for h in self._handles:
            h.remove()
        n = len(self.blocks)
        peak = self._step.peak + self._block.peak  # what step 1 saved: k = n - 1 blocks recomputed
        inside = max(self._block.peak - self._input_bytes, 0)
        budget = (self.budget_bytes - model_state_bytes) if self.budget_bytes is not None else 0.9 * free_bytes
        k = next((k for k in range(n + 1) if peak + (n - 1 - k) * inside <= budget), n)
        if dist.is_available() and dist.is_initialized():
            agreed = torch.tensor([k], dtype=torch.int64, device=device)
            dist.all_reduce(agreed, op=dist.ReduceOp.MAX)
            k = int(agreed.item())
        chosen = tuple(range(k))
        _enable(self.blocks, chosen)
        self.report = RecomputeReport(self.fqn, "auto", chosen, n)
        self.predicted_bytes = peak + (n - 1 - k) * inside
        if self.predicted_bytes > budget:
            warnings.warn(
                f"activation_checkpointing='auto': even recomputing all {n} blocks keeps ~{self.predicted_bytes / 2**30:.2f} "
                f"GiB of activations, over the budget of {max(budget, 0) / 2**30:.2f} GiB; lower the batch size or "
                "raise memory_budget_gb.", stacklevel=2)
        return self.report


def _contexts(selective: bool) -> tuple[Any, Any]:
    """The recompute runs inside backward, outside the precision plugin's forward context: it re-enters the
    plugin's function modes (fp32 functions, emulated bf16 matmuls) that were active when the block ran forward,
    as torch's checkpoint restores the autocast state."""
    modes: list[type] = []
    forward, recompute = _note_modes(modes), _replay_modes(modes)
    if not selective:
        return forward, recompute
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    keep_forward, keep_recompute = create_selective_checkpoint_contexts(_keep_matmuls)
    return _both(forward, keep_forward), _both(recompute, keep_recompute)


@contextlib.contextmanager
def _note_modes(modes: list[type]) -> Any:
    from torch.overrides import _get_current_function_mode_stack

    modes[:] = [type(m) for m in _get_current_function_mode_stack() if type(m) in REPLAYED_MODES]
    yield


@contextlib.contextmanager
def _replay_modes(modes: list[type]) -> Any:
    with contextlib.ExitStack() as stack:
        for mode in modes:
            stack.enter_context(mode())
        yield


@contextlib.contextmanager
def _both(first: Any, second: Any) -> Any:
    with first, second:
        yield


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
