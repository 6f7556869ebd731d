"""Attention and the loss over a sequence split across the cp ranks.

Two forms (``context_parallel_attention``):
- ``"ring"`` (the default, `ring`): K/V blocks passed point-to-point around the cp ring, each step attending the
  local queries to one block, merged by log-sum-exp; saved attention activations are 1/cp of the unsplit run's.
- ``"allgather"``: K and V all-gathered over cp (differentiable: backward reduce-scatters their gradients), the
  local queries attending to the whole sequence's keys, causal by global position: on CPU each query chunk as two
  flash calls merged by log-sum-exp (`blockwise`), elsewhere one SDPA with a boolean mask. The Llama 3 405B run's
  form for its 128k phase: one collective per layer instead of cp - 1 hops, but the gathered K/V are
  whole-sequence on every rank.

`ContextParallelMode` reroutes, while a step runs: ``F.scaled_dot_product_attention(..., is_causal=True)`` (the
example GPT, any model calling it) to `cp_attention`; ``F.cross_entropy(..., reduction="mean")`` to the sum over
this rank's tokens divided by the whole sequence's token count / cp, so that the mean over the dp x cp ranks (the
gradient average, ``sync_dist``) is the loss over every token, ignored tokens spread unevenly included.
transformers models reach `cp_attention` through `AttentionInterface` (`hf_attention`).
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed import _functional_collectives as funcol
from torch.overrides import TorchFunctionMode

from lightning_npu.parallel.context_parallel import blockwise, ring
from lightning_npu.parallel.context_parallel.layout import IGNORE_INDEX

HF_IMPLEMENTATION = "npu_context_parallel"
# torch >= 2.13 names it all_gather_single_autograd (all_gather_tensor_autograd is deprecated there)
_all_gather = getattr(funcol, "all_gather_single_autograd", None) or funcol.all_gather_tensor_autograd


class _StepState:
    """The current step's split, kept from its forward through its backward: activation checkpointing recomputes
    attention inside backward (on the device's autograd thread, hence not thread-local)."""

    active: bool = False  # inside the step's forward (the position-id hook reads it)
    group: Any = None
    query_positions: Optional[torch.Tensor] = None
    key_positions: Optional[torch.Tensor] = None
    key_order: Optional[torch.Tensor] = None  # the gathered keys' indices in global order
    chunks: tuple[int, ...] = ()  # this rank's chunk indices
    method: str = "ring"  # `context_parallel_attention`: "ring" (point-to-point K/V blocks) or "allgather"
    ring: Any = None  # ring.Ring over `group`
    all_chunks: tuple[tuple[int, ...], ...] = ()  # every cp rank's chunk indices, rank after rank
    inside: bool = False


STATE = _StepState()


def cp_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: Optional[float] = None,
                 kv_repeat: int = 1) -> torch.Tensor:
    """``[B, H, L_local, D]`` queries against the whole sequence's keys, causal by global position."""
    if STATE.group is None:
        raise RuntimeError("context-parallel attention ran outside a context-parallel step.")
    if STATE.method == "ring":
        return ring.RingAttention.apply(q, k, v, STATE.ring, STATE.all_chunks, scale, kv_repeat)
    k_all = _all_gather(k.contiguous(), gather_dim=2, group=STATE.group)
    v_all = _all_gather(v.contiguous(), gather_dim=2, group=STATE.group)
    if blockwise.supported(q):  # CPU: the keys in global order, each query chunk in two flash calls (no mask)
        order = STATE.key_order
        k_all, v_all = k_all.index_select(2, order), v_all.index_select(2, order)
        if kv_repeat > 1:  # grouped-query attention: gather the kv heads, then repeat them (less to communicate)
            k_all, v_all = k_all.repeat_interleave(kv_repeat, dim=1), v_all.repeat_interleave(kv_repeat, dim=1)
        return blockwise.ChunkedCausalAttention.apply(q, k_all, v_all, STATE.chunks, scale)
    if kv_repeat > 1:
        k_all, v_all = k_all.repeat_interleave(kv_repeat, dim=1), v_all.repeat_interleave(kv_repeat, dim=1)
    # elsewhere: one SDPA with a (local queries x sequence) boolean mask by global position (untested off CPU)
    mask = STATE.key_positions[None, :] <= STATE.query_positions[:, None]
    STATE.inside = True
    try:
        return F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=mask, scale=scale)
    finally:
        STATE.inside = False


def _refuse_attention(reason: str) -> None:
    raise ValueError(f"`context_parallel_size>1` runs causal self-attention only, but the model calls attention "
                     f"{reason}; use a causal decoder with SDPA attention, or set context_parallel_size=1.")


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: Any = None, dropout_p: float = 0.0,
          is_causal: bool = False, scale: Optional[float] = None, enable_gqa: bool = False) -> torch.Tensor:
    if attn_mask is not None:
        _refuse_attention("with an explicit mask (padding or a custom mask)")
    if not is_causal:
        _refuse_attention("without is_causal=True (bidirectional)")
    if dropout_p:
        _refuse_attention(f"with dropout_p={dropout_p}")
    if k.shape[-2] != q.shape[-2]:
        _refuse_attention("with keys of another length than the queries (cross-attention or a cache)")
    return cp_attention(q, k, v, scale, q.shape[1] // k.shape[1] if enable_gqa else 1)


def _cross_entropy(input: torch.Tensor, target: torch.Tensor, weight: Any = None, size_average: Any = None,
                   ignore_index: int = IGNORE_INDEX, reduce: Any = None, reduction: str = "mean",
                   label_smoothing: float = 0.0) -> torch.Tensor:
    if size_average is not None or reduce is not None or reduction != "mean":
        return F.cross_entropy(input, target, weight, size_average, ignore_index, reduce, reduction, label_smoothing)
    if weight is not None:
        raise ValueError("`context_parallel_size>1` averages the loss over the whole sequence's tokens, which "
                         "F.cross_entropy(weight=...) does not define per token; drop `weight`, or set "
                         "context_parallel_size=1.")
    total = F.cross_entropy(input, target, None, None, ignore_index, None, "sum", label_smoothing)
    if target.is_floating_point():  # class probabilities: every row counts
        count = torch.tensor(float(target.numel() // target.shape[-1 if target.dim() > 1 else 0]), device=total.device)
    else:
        count = (target != ignore_index).sum().to(torch.float32)
    dist.all_reduce(count, group=STATE.group)
    cp = dist.get_world_size(STATE.group)
    return total / (count / cp).to(total.dtype)


class ContextParallelMode(TorchFunctionMode):
    """Entered around a step's forward (`runtime.ContextParallel.step`); everything else passes through."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention and not STATE.inside:
            return _sdpa(*args, **kwargs)
        if func is F.cross_entropy:
            return _cross_entropy(*args, **kwargs)
        return func(*args, **kwargs)


def hf_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 attention_mask: Any, scaling: Optional[float] = None, dropout: float = 0.0,
                 **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature (``AttentionInterface``); returns ``[B, L, H, D]``."""
    if getattr(module, "is_causal", True) is False:
        _refuse_attention(f"non-causally ({type(module).__name__}.is_causal=False)")
    window = kwargs.get("sliding_window")
    if window is not None and STATE.key_positions is not None and window < STATE.key_positions.numel():
        _refuse_attention(f"with a sliding window ({window} < sequence length {STATE.key_positions.numel()})")
    for name in ("softcap", "s_aux"):
        if kwargs.get(name) is not None:
            _refuse_attention(f"with {name} (logit soft-capping or attention sinks)")
    if dropout:
        _refuse_attention(f"with dropout {dropout}")
    out = cp_attention(query, key, value, scaling, query.shape[1] // key.shape[1])
    return out.transpose(1, 2).contiguous(), None


def register_hf_attention() -> bool:
    """Register `hf_attention` under ``HF_IMPLEMENTATION``; False without transformers."""
    try:
        from transformers import AttentionInterface
    except ImportError:
        return False
    AttentionInterface.register(HF_IMPLEMENTATION, hf_attention)
    return True
