"""Ring attention: K/V blocks passed around the cp ring point-to-point, each rank attending its queries to one block
per step and merging the blocks' outputs by log-sum-exp.

Nothing whole-sequence is kept: backward needs only this rank's q, k, v, the merged output and its log-sum-exp
(the flash recipe), so saved attention activations are 1/cp of the unsplit run's. Backward passes the K/V blocks
around the ring once more, together with an accumulator of each block's dK/dV that every rank adds its share to;
after cp steps the accumulator is back at the rank that owns the block (one more hop). The next block's transfer
runs while the current one is computed.

With the load-balanced chunks (rank i holds chunks i and 2cp-1-i) a query chunk a meets key chunk b as a full block
(b < a), a causal one (b == a) or not at all (b > a): fully masked blocks are skipped, and every rank computes the
same number of blocks at every step. Blocks run on CPU as the flash kernel (`blockwise`), elsewhere as plain
matmuls with an explicit log-sum-exp (exact on every device, not fused).
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist

from lightning_npu.parallel.context_parallel import blockwise


class Ring:
    """The cp group seen as a ring: this rank sends to the next and receives from the previous."""

    def __init__(self, group: Any) -> None:
        self.group = group
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)

    def start(self, tensor: torch.Tensor, tag: int) -> tuple[list, torch.Tensor]:
        """Send `tensor` on and post the receive of the previous rank's; `finish` waits for both."""
        tensor = tensor.contiguous()
        received = torch.empty_like(tensor)
        works = dist.batch_isend_irecv([
            dist.P2POp(dist.isend, tensor, group=self.group, tag=tag, group_peer=(self.rank + 1) % self.size),
            dist.P2POp(dist.irecv, received, group=self.group, tag=tag, group_peer=(self.rank - 1) % self.size),
        ])
        return works, received

    @staticmethod
    def finish(pending: tuple[list, torch.Tensor]) -> torch.Tensor:
        works, received = pending
        for work in works:
            work.wait()
        return received


_KV, _GRAD = 0, 1  # message tags: the K/V blocks and the dK/dV accumulators travel side by side in backward


def _acc(t: torch.Tensor) -> torch.dtype:
    """The accumulation dtype: fp32, or the input's if wider."""
    return torch.promote_types(t.dtype, torch.float32)


def _math_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                  scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    q, k, v = (t.to(_acc(t)) for t in (q, k, v))
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    if causal:
        scores = scores.masked_fill(torch.ones_like(scores, dtype=torch.bool).triu(1), float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    return torch.matmul((scores - lse.unsqueeze(-1)).exp(), v), lse


def _math_backward(grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                   lse: torch.Tensor, causal: bool, scale: float) -> tuple[torch.Tensor, ...]:
    grad, q, k, v = (t.to(_acc(t)) for t in (grad, q, k, v))
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    if causal:
        scores = scores.masked_fill(torch.ones_like(scores, dtype=torch.bool).triu(1), float("-inf"))
    p = (scores - lse.unsqueeze(-1)).exp()  # this block's share of the merged softmax
    dp = torch.matmul(grad, v.transpose(-1, -2))
    ds = p * (dp - (grad * out.to(grad.dtype)).sum(-1, keepdim=True))
    return torch.matmul(ds, k) * scale, torch.matmul(ds.transpose(-1, -2), q) * scale, torch.matmul(
        p.transpose(-1, -2), grad)


def block_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                  scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(output in fp32, log-sum-exp) of `q` against one key block."""
    if blockwise.supported(q):
        out, lse = blockwise._fwd(q, k, v, 0.0, causal, scale=scale)[:2]
        return out.to(_acc(out)), lse
    return _math_forward(q, k, v, causal, scale)


def block_backward(grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                   lse: torch.Tensor, causal: bool, scale: float) -> tuple[torch.Tensor, ...]:
    """dq, dk, dv of one block, given the *merged* output and log-sum-exp (the block's exact share)."""
    if blockwise.supported(q):
        return blockwise._bwd(grad, q, k, v, out, lse, 0.0, causal, scale=scale)[:3]
    return _math_backward(grad, q, k, v, out, lse, causal, scale)


def _pairs(mine: Sequence[int], theirs: Sequence[int]) -> list[tuple[int, int, bool]]:
    """(local query chunk, key chunk, causal) of the blocks to compute: key chunks after a query chunk are skipped."""
    return [(i, j, b == a) for i, a in enumerate(mine) for j, b in enumerate(theirs) if b <= a]


class RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ring: Ring,
                chunks: Sequence[Sequence[int]], scale: Optional[float], kv_repeat: int) -> torch.Tensor:
        """`q` ``[B, H, n * L, D]`` holds this rank's n query chunks ``chunks[rank]``, `k`, `v` ``[B, H / kv_repeat,
        n * L, D]`` the same tokens' keys and values; ``chunks[r]`` names rank r's chunks (global indices)."""
        scale = q.shape[-1] ** -0.5 if scale is None else scale
        mine = chunks[ring.rank]
        size = q.shape[2] // len(mine)
        rows = [slice(i * size, (i + 1) * size) for i in range(len(mine))]
        out: list[Optional[torch.Tensor]] = [None] * len(mine)
        lse: list[Optional[torch.Tensor]] = [None] * len(mine)
        kv = torch.stack([k, v])
        for step in range(ring.size):
            src = (ring.rank - step) % ring.size
            pending = ring.start(kv, _KV) if step < ring.size - 1 else None
            keys, values = (t.repeat_interleave(kv_repeat, dim=1) if kv_repeat > 1 else t for t in kv)
            for i, j, causal in _pairs(mine, chunks[src]):
                o, l = block_forward(q[:, :, rows[i]], keys[:, :, rows[j]], values[:, :, rows[j]], causal, scale)
                if out[i] is None:
                    out[i], lse[i] = o, l
                else:
                    merged = torch.logaddexp(lse[i], l)
                    out[i] = out[i] * (lse[i] - merged).exp().unsqueeze(-1) + o * (l - merged).exp().unsqueeze(-1)
                    lse[i] = merged
            if pending is not None:
                kv = ring.finish(pending)
        merged_out, merged_lse = torch.cat(out, dim=2).to(q.dtype), torch.cat(lse, dim=2)
        ctx.save_for_backward(q, k, v, merged_out, merged_lse)
        ctx.ring, ctx.chunks, ctx.scale, ctx.kv_repeat = ring, chunks, scale, kv_repeat
        return merged_out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> Any:
        q, k, v, out, lse = ctx.saved_tensors
        ring, chunks, scale, rep = ctx.ring, ctx.chunks, ctx.scale, ctx.kv_repeat
        mine = chunks[ring.rank]
        size = q.shape[2] // len(mine)
        rows = [slice(i * size, (i + 1) * size) for i in range(len(mine))]
        grad_out = grad_out.contiguous()
        dq = torch.zeros_like(q, dtype=_acc(q))
        kv, grads = torch.stack([k, v]), None  # grads: the accumulated dK/dV of the block held
        pending_grads = None
        for step in range(ring.size):
            src = (ring.rank - step) % ring.size
            pending_kv = ring.start(kv, _KV) if step < ring.size - 1 else None
            keys, values = (t.repeat_interleave(rep, dim=1) if rep > 1 else t for t in kv)
            share = torch.zeros((2, *keys.shape), dtype=_acc(keys), device=keys.device)
            for i, j, causal in _pairs(mine, chunks[src]):
                gq, gk, gv = block_backward(grad_out[:, :, rows[i]], q[:, :, rows[i]], keys[:, :, rows[j]],
                                            values[:, :, rows[j]], out[:, :, rows[i]], lse[:, :, rows[i]], causal,
                                            scale)
                dq[:, :, rows[i]] += gq
                share[0][:, :, rows[j]] += gk
                share[1][:, :, rows[j]] += gv
            if rep > 1:  # each kv head served `rep` query heads: its gradient is their sum
                share = share.unflatten(2, (-1, rep)).sum(3)
            grads = share if pending_grads is None else Ring.finish(pending_grads) + share
            pending_grads = ring.start(grads, _GRAD)  # on to the next rank; after cp hops, home
            if pending_kv is not None:
                kv = Ring.finish(pending_kv)
        grads = Ring.finish(pending_grads)
        return dq.to(q.dtype), grads[0].to(k.dtype), grads[1].to(v.dtype), None, None, None, None
