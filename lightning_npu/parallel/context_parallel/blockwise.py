"""Causal attention of a rank's two query chunks against the whole sequence without a mask tensor.

A mask of (local queries x sequence) positions would cost more memory than the attention it saves. Instead each
query chunk g attends in two flash-kernel calls: to the keys before the chunk (no mask) and to its own chunk
(``is_causal=True``, square), and the two outputs are merged by their log-sum-exps, as ring attention merges
blocks. Backward runs the flash backward of each block with the *merged* output and log-sum-exp, which gives each
block's exact share of the gradient (the block's probabilities are exp(scores - merged lse)).

CPU only: it calls ``aten._scaled_dot_product_flash_attention_for_cpu`` and its backward directly.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

_fwd = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_bwd = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


def supported(q: torch.Tensor) -> bool:
    return q.device.type == "cpu" and q.dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16)


def _blocks(chunk: int, size: int) -> list[tuple[slice, bool]]:
    """(key slice, causal) of the blocks query chunk `chunk` attends to, keys in global order."""
    blocks = [(slice(chunk * size, (chunk + 1) * size), True)]
    if chunk:
        blocks.append((slice(0, chunk * size), False))
    return blocks


class ChunkedCausalAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, chunks: tuple[int, ...],
                scale: Optional[float]) -> torch.Tensor:
        """`q` ``[B, H, len(chunks) * L, D]`` holds query chunks `chunks` (global indices); `k`, `v` the whole
        sequence in global order."""
        size = q.shape[2] // len(chunks)
        outs, lses = [], []
        for i, chunk in enumerate(chunks):
            qc = q[:, :, i * size:(i + 1) * size]
            out = lse = None
            for keys, causal in _blocks(chunk, size):
                o, l = _fwd(qc, k[:, :, keys], v[:, :, keys], 0.0, causal, scale=scale)
                if out is None:
                    out, lse = o.float(), l
                else:
                    merged = torch.logaddexp(lse, l)
                    out = out * (lse - merged).exp().unsqueeze(-1) + o.float() * (l - merged).exp().unsqueeze(-1)
                    lse = merged
            outs.append(out.to(q.dtype))
            lses.append(lse)
        out, lse = torch.cat(outs, dim=2), torch.cat(lses, dim=2)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.chunks, ctx.scale = chunks, scale
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> Any:
        q, k, v, out, lse = ctx.saved_tensors
        size = q.shape[2] // len(ctx.chunks)
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        grad_out = grad_out.contiguous()
        for i, chunk in enumerate(ctx.chunks):
            rows = slice(i * size, (i + 1) * size)
            qc, oc, lc, gc = q[:, :, rows], out[:, :, rows], lse[:, :, rows], grad_out[:, :, rows]
            for keys, causal in _blocks(chunk, size):
                gq, gk, gv = _bwd(gc, qc, k[:, :, keys], v[:, :, keys], oc, lc, 0.0, causal, scale=ctx.scale)
                dq[:, :, rows] += gq
                dk[:, :, keys] += gk
                dv[:, :, keys] += gv
        return dq, dk, dv, None, None
