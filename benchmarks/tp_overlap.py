"""Can tensor parallelism's all-reduces hide behind compute on this machine? (issue #31, a research spike)

The example GPT's blocks (d=256, 8 heads, MLP 4x, 4 layers, 1024 tokens = 8 x 128 per step, fp32) split
Megatron-style over tp=2 real gloo processes (1 thread each): column-parallel q|k|v and MLP-up, row-parallel
attention-out and MLP-down, as plain local shards plus `torch.distributed.all_reduce` (one 1 MiB all-reduce after
each row-parallel layer in forward, one on the gradient entering each column-parallel layer in backward: 16 per
step). Arms, alternated `--repeats` times in the same processes:

- ``autograd``: one autograd graph, every all-reduce waited where it is issued (what tp does today);
- ``A``: the same split into segments between the all-reduces, run and back-propagated one segment at a time,
  every all-reduce waited at once (the segment machinery's own cost);
- ``B`` / ``C``: the batch in 2 / 4 chunks interleaved segment by segment (DeepSpeed Domino, 2024): each chunk's
  all-reduce is issued async and waited only after the other chunks' compute of the same segment, in forward and
  in backward;
- ``B_autograd``: B's forward, then one backward of both chunks' losses together (autograd's own order; the
  backward all-reduces block).

Reports per arm the median step (forward + backward) ms, the ms spent in `Work.wait()` / blocking all-reduces,
the rest ("compute") and the process CPU ms (gloo's threads included), and the largest difference of the loss and
gradients from ``autograd`` and from the unsharded model on one process.

    python benchmarks/tp_overlap.py [--repeats 5] [--steps 10] [--warmup 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from benchmarks._env import write_json  # noqa: E402
from lightning_npu.launch import spawn  # noqa: E402

D, HEADS, LAYERS, BATCH, SEQ = 256, 8, 4, 8, 128
OUT = Path(__file__).resolve().parent / "results" / "tp_overlap.json"


def full_params(seed: int = 0) -> dict[str, torch.Tensor]:
    """The unsharded block weights, the same on every rank (a seeded init)."""
    g = torch.Generator().manual_seed(seed)
    p = {}
    for i in range(LAYERS):
        for name, shape in (("qkv", (3 * D, D)), ("o", (D, D)), ("up", (4 * D, D)), ("down", (D, 4 * D))):
            p[f"{i}.{name}.w"] = torch.randn(shape, generator=g) * shape[1] ** -0.5
        for name, n in (("qkv", 3 * D), ("o", D), ("up", 4 * D), ("down", D)):
            p[f"{i}.{name}.b"] = torch.randn(n, generator=g) * 0.02
        for ln in ("ln1", "ln2"):
            p[f"{i}.{ln}.w"] = 1 + 0.1 * torch.randn(D, generator=g)
            p[f"{i}.{ln}.b"] = 0.1 * torch.randn(D, generator=g)
    p["lnf.w"], p["lnf.b"] = torch.ones(D), torch.zeros(D)
    return p


def shard(p: dict[str, torch.Tensor], rank: int, tp: int) -> dict[str, torch.Tensor]:
    """This rank's Megatron shard: q|k|v and MLP-up by output rows (whole heads), attention-out and MLP-down by
    input columns; LayerNorms and the row-parallel biases replicated."""
    out = {}
    for k, v in p.items():
        layer_name = k.split(".")[1] if k[0].isdigit() else ""
        if layer_name == "qkv":  # rows are [q | k | v], each split by heads
            v = torch.cat([part.chunk(tp)[rank] for part in v.chunk(3)])
        elif layer_name == "up":
            v = v.chunk(tp)[rank]
        elif layer_name in ("o", "down") and k.endswith(".w"):
            v = v.chunk(tp, dim=1)[rank]
        out[k] = v.clone().requires_grad_()
    return out


def stages(p: dict[str, torch.Tensor], heads: int) -> tuple[list[tuple], Callable]:
    """The model as segments between all-reduces, [(fn(*state) -> state, all-reduce the last input's gradient in
    backward, all-reduce the last output in forward)], and the loss head."""

    def ln(x, name):
        return F.layer_norm(x, (D,), p[f"{name}.w"], p[f"{name}.b"])

    def attn(i):
        def fn(x, a):
            b, t, _ = a.shape
            q, k, v = F.linear(a, p[f"{i}.qkv.w"], p[f"{i}.qkv.b"]).view(b, t, 3, heads, D // HEADS).unbind(2)
            y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
            return x, F.linear(y.transpose(1, 2).reshape(b, t, -1), p[f"{i}.o.w"])

        return fn

    def mlp(i):
        return lambda x, a: (x, F.linear(F.gelu(F.linear(a, p[f"{i}.up.w"], p[f"{i}.up.b"])), p[f"{i}.down.w"]))

    def add_ln(bias, name):
        def fn(x, s):
            x = x + s + p[bias]
            return x, ln(x, name)

        return fn

    def head(x, s, target):  # a linear loss, summed, so the chunks' losses add up to the whole batch's
        return (ln(x + s + p[f"{LAYERS - 1}.down.b"], "lnf") * target).sum() / (BATCH * SEQ)

    out = [(lambda x: (x, ln(x, "0.ln1")), False, False)]
    for i in range(LAYERS):
        out += [(attn(i), True, True), (add_ln(f"{i}.o.b", f"{i}.ln2"), False, False), (mlp(i), True, True)]
        if i + 1 < LAYERS:
            out.append((add_ln(f"{i}.down.b", f"{i + 1}.ln1"), False, False))
    return out, head


class Waits:
    """Time spent blocked on all-reduces."""

    def __init__(self, comm: bool = True) -> None:
        self.s, self.comm = 0.0, comm  # comm=False: the unsharded model, whose all-reduces are identities

    def wait(self, work) -> None:
        if work is not None:
            t = time.perf_counter()
            work.wait()
            self.s += time.perf_counter() - t

    def all_reduce(self, t: torch.Tensor, async_op: bool):
        work = dist.all_reduce(t, async_op=True) if self.comm else None
        if not async_op:
            self.wait(work)
            return None
        return work


class _F(torch.autograd.Function):  # Megatron's f: identity forward, all-reduce backward
    @staticmethod
    def forward(ctx, x, waits):
        ctx.waits = waits
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        g = g.clone()
        ctx.waits.all_reduce(g, async_op=False)
        return g, None


class _G(torch.autograd.Function):  # Megatron's g: all-reduce forward (its Work kept in `pending`), identity backward
    @staticmethod
    def forward(ctx, x, waits, pending, async_op):
        x = x.clone()
        pending.append(waits.all_reduce(x, async_op))
        return x

    @staticmethod
    def backward(ctx, g):
        return g, None, None, None


def step_autograd(p, x, target, waits, heads, chunks: int = 1, overlap: bool = False) -> torch.Tensor:
    """Autograd graphs, the all-reduces of backward blocking; with `chunks` the forward runs the chunks segment by
    segment, each forward all-reduce waited only when its chunk reaches the next segment, and backward runs once
    on the sum of the chunks' losses (the engine's own order)."""
    segs, head = stages(p, heads)
    state = [(xc,) for xc in x.chunk(chunks)]
    pending = [[] for _ in range(chunks)]
    for fn, comm_in, comm_out in segs:
        for c in range(chunks):
            while pending[c]:
                waits.wait(pending[c].pop())
            if comm_in:
                state[c] = (*state[c][:-1], _F.apply(state[c][-1], waits))
            state[c] = fn(*state[c])
            if comm_out:
                state[c] = (*state[c][:-1], _G.apply(state[c][-1], waits, pending[c], overlap))
    for c in range(chunks):
        while pending[c]:
            waits.wait(pending[c].pop())
    loss = sum(head(*state[c], t) for c, t in enumerate(target.chunk(chunks)))
    loss.backward()
    return loss.detach()


def step_chunked(p, x, target, waits, heads, chunks: int, overlap: bool) -> torch.Tensor:
    """Segment by segment, chunk by chunk; with `overlap` a chunk's all-reduce is waited for only when that chunk
    reaches its next segment (after the other chunks' compute), else at once."""
    segs, head = stages(p, heads)
    xs, ts = x.chunk(chunks), target.chunk(chunks)
    state = [(xc,) for xc in xs]
    saved = [[] for _ in range(chunks)]  # per chunk: (leaf inputs, outputs) of every segment
    pending = [None] * chunks
    for fn, _, comm_out in segs:
        for c in range(chunks):
            waits.wait(pending[c])
            inputs = tuple(t.detach().requires_grad_() for t in state[c])
            outs = fn(*inputs)
            saved[c].append((inputs, outs))
            state[c] = tuple(o.detach() for o in outs)
            pending[c] = None
            if comm_out:
                state[c] = (*state[c][:-1], state[c][-1].clone())
                pending[c] = waits.all_reduce(state[c][-1], async_op=overlap)
    losses, grads = [], [None] * chunks
    for c in range(chunks):
        waits.wait(pending[c])
        inputs = tuple(t.detach().requires_grad_() for t in state[c])
        loss = head(*inputs, ts[c])
        loss.backward()
        losses.append(loss.detach())
        grads[c] = [t.grad for t in inputs]
    for k in range(len(segs) - 1, -1, -1):
        comm_in = segs[k][1]
        for c in range(chunks):
            waits.wait(pending[c])
            pending[c] = None
            inputs, outs = saved[c][k]
            torch.autograd.backward(outs, grads[c])
            grads[c] = [t.grad for t in inputs]
            if comm_in:
                pending[c] = waits.all_reduce(grads[c][-1], async_op=overlap)
    for c in range(chunks):
        waits.wait(pending[c])
    return torch.stack(losses).sum()


ARMS = {
    "autograd": lambda *a: step_autograd(*a),
    "A": lambda *a: step_chunked(*a, chunks=1, overlap=False),
    "B": lambda *a: step_chunked(*a, chunks=2, overlap=True),
    "C": lambda *a: step_chunked(*a, chunks=4, overlap=True),
    "B_autograd": lambda *a: step_autograd(*a, chunks=2, overlap=True),
}


def run_arm(name, p, x, target, heads, steps, warmup):
    rows = []
    for i in range(warmup + steps):
        for v in p.values():
            v.grad = None
        waits = Waits()
        dist.barrier()
        t0, c0 = time.perf_counter(), time.process_time()
        loss = ARMS[name](p, x, target, waits, heads)
        t1, c1 = time.perf_counter(), time.process_time()
        if i >= warmup:
            rows.append((t1 - t0, waits.s, c1 - c0))
    grads = {k: v.grad.clone() for k, v in p.items()}
    return rows, loss, grads


def max_diff(a: dict, b: dict) -> float:
    return max((a[k] - b[k]).abs().max().item() for k in a)


def worker(repeats: int, steps: int, warmup: int) -> dict:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, tp = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(1)
    x, target = torch.randn(BATCH, SEQ, D, generator=g), torch.randn(BATCH, SEQ, D, generator=g)
    full = full_params()
    p = shard(full, rank, tp)

    # the reference: the unsharded model on this one process (no all-reduces), then sliced as this rank's shard
    ref_p = {k: v.clone().requires_grad_() for k, v in full.items()}
    ref_loss = step_autograd(ref_p, x, target, Waits(comm=False), HEADS)
    ref_grads = shard({k: v.grad for k, v in ref_p.items()}, rank, tp)

    samples = {name: [] for name in ARMS}
    checks = {}
    for r in range(repeats):
        order = list(ARMS)[r % len(ARMS):] + list(ARMS)[: r % len(ARMS)]
        for name in order:
            rows, loss, grads = run_arm(name, p, x, target, HEADS // tp, steps, warmup)
            samples[name].append(rows)
            checks[name] = (loss, grads)
    base_loss, base_grads = checks["autograd"]
    out = {"rank": rank, "arms": {}}
    for name, reps in samples.items():
        loss, grads = checks[name]
        med = lambda j: [statistics.median(row[j] for row in rep) * 1e3 for rep in reps]  # noqa: E731
        step, wait, cpu = med(0), med(1), med(2)
        out["arms"][name] = {
            "step_ms_per_repeat": [round(v, 2) for v in step],
            "wait_ms_per_repeat": [round(v, 2) for v in wait],
            "cpu_ms_per_repeat": [round(v, 2) for v in cpu],
            "loss_diff_vs_autograd": abs(loss - base_loss).item(),
            "grad_max_diff_vs_autograd": max_diff(grads, base_grads),
            "loss_diff_vs_one_process": abs(loss - ref_loss).item(),
            "grad_max_diff_vs_one_process": max_diff(grads, ref_grads),
        }
    # a lone 1 MiB all-reduce, for scale
    buf = torch.randn(BATCH * SEQ, D)
    ts, cs = [], []
    for _ in range(20):
        dist.barrier()
        t, c = time.perf_counter(), time.process_time()
        dist.all_reduce(buf)
        ts.append(time.perf_counter() - t)
        cs.append(time.process_time() - c)
    out["allreduce_1mib_ms"] = round(statistics.median(ts) * 1e3, 3)
    out["allreduce_1mib_cpu_ms"] = round(statistics.median(cs) * 1e3, 3)  # gloo's threads' CPU, not idle waiting
    dist.barrier()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--out", default=str(OUT))
    args = ap.parse_args()
    load_before = os.getloadavg()
    ranks = spawn(worker, 2, args.repeats, args.steps, args.warmup, threads=1)
    load_after = os.getloadavg()
    arms = {}
    for name in ARMS:
        per_rank = [r["arms"][name] for r in ranks]
        # a step ends when the slower rank ends it: per repeat the max over ranks, then the median over repeats
        agg = {
            key: round(statistics.median(max(col) for col in zip(*(a[key + "_per_repeat"] for a in per_rank))), 2)
            for key in ("step_ms", "wait_ms", "cpu_ms")
        }
        agg["compute_ms"] = round(agg["step_ms"] - agg["wait_ms"], 2)
        for key in per_rank[0]:
            if not key.endswith("_per_repeat"):
                agg[key] = max(a[key] for a in per_rank)
        agg["per_rank"] = per_rank
        arms[name] = agg
        print(f"{name:9s} step {agg['step_ms']:7.2f} ms  waiting {agg['wait_ms']:6.2f}"
              f"  compute {agg['compute_ms']:7.2f}  cpu {agg['cpu_ms']:7.2f}"
              f"  grad diff vs autograd {agg['grad_max_diff_vs_autograd']:.1e}"
              f"  vs one process {agg['grad_max_diff_vs_one_process']:.1e}")
    payload = {
        "shape": {"d": D, "heads": HEADS, "layers": LAYERS, "batch": BATCH, "seq": SEQ, "tp": 2, "dtype": "fp32"},
        "settings": vars(args) | {"threads_per_process": 1, "backend": "gloo"},
        "allreduce_1mib_ms": [r["allreduce_1mib_ms"] for r in ranks],
        "allreduce_1mib_cpu_ms": [r["allreduce_1mib_cpu_ms"] for r in ranks],
        "load_average_before": [round(v, 2) for v in load_before],
        "load_average_after": [round(v, 2) for v in load_after],
        "arms": arms,
    }
    print("lone 1 MiB all-reduce ms:", payload["allreduce_1mib_ms"], "cpu ms:", payload["allreduce_1mib_cpu_ms"],
          " load", payload["load_average_before"],
          "->", payload["load_average_after"])
    write_json(args.out, payload)


if __name__ == "__main__":
    main()
