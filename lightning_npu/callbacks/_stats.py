"""Gradient statistics in as few device syncs as possible.

Parameters may be plain tensors (DDP: gradients already averaged, identical on every rank) or
DTensors (tensor parallel, FSDP2: each rank holds a shard); DTensor reductions produce partial
results that `_full` completes, so the statistics are global in both cases without double counting.
"""

from __future__ import annotations

from typing import Iterable, Sequence

import torch


def _full(x: torch.Tensor) -> torch.Tensor:
    full = getattr(x, "full_tensor", None)
    return full() if callable(full) else x


def grads_of(params: Iterable[torch.nn.Parameter]) -> list[torch.Tensor]:
    return [p.grad for p in params if p.grad is not None]


def grad_stats(grads: Sequence[torch.Tensor]) -> torch.Tensor:
    """[global L2 norm, element variance] of all gradients as one fp32 device tensor (no host sync)."""
    count = sum(g.numel() for g in grads)
    if any(hasattr(g, "full_tensor") for g in grads):
        sq = torch.stack([_full(torch.linalg.vector_norm(g, dtype=torch.float32)).pow(2) for g in grads]).sum()
        total = torch.stack([_full(g.sum(dtype=torch.float32)) for g in grads]).sum()
    else:
        sq = torch.stack([n.float() for n in torch._foreach_norm(grads)]).pow(2).sum()
        total = torch.stack([g.sum(dtype=torch.float32) for g in grads]).sum()
    mean = total / max(count, 1)
    return torch.stack([sq.sqrt(), sq / max(count, 1) - mean * mean])


def params_norm_and_delta(params: Sequence[torch.Tensor], before: Sequence[torch.Tensor]) -> tuple[float, float]:
    """(|w_before|, |w_after - w_before|), global over shards."""
    w_sq = torch.zeros((), dtype=torch.float32, device=before[0].device)
    d_sq = torch.zeros((), dtype=torch.float32, device=before[0].device)
    for p, b in zip(params, before):
        w_sq = w_sq + _full(torch.linalg.vector_norm(b, dtype=torch.float32)).pow(2)
        d_sq = d_sq + _full(torch.linalg.vector_norm(p.detach() - b, dtype=torch.float32)).pow(2)
    w, d = torch.stack([w_sq, d_sq]).sqrt().tolist()
    return w, d
