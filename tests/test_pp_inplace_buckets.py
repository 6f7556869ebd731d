"""The in-place gradient buffers of ZeRO 0/1 under pipeline parallelism (`GradientBuckets.hold` / `take`): a schedule's
backward adds straight into the bucket buffer (``p.grad`` is a view of it), the buffer is reduced in place, and no
gradient is copied in or out; the reduced gradients equal the mean of each rank's (2 gloo processes). The old path
(``inplace=False``) is measured alongside: the bytes it copies are what the in-place buffers avoid."""

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_npu.launch import spawn
from lightning_npu.parallel.data_parallel.sync import GradientBuckets

_COPIES = {"copy_", "_foreach_copy_", "_chunk_cat", "cat", "clone", "_to_copy"}


class CopiedBytes(TorchDispatchMode):
    """Bytes written by copying ops (what a gradient copy into or out of a bucket costs)."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.__name__.split(".")[0]
        if name in _COPIES:
            target = args[0] if name.endswith("_") else (kwargs or {}).get("out", out)  # in place: the first argument
            self.bytes += sum(t.numel() * t.element_size() for t in (target if isinstance(target, (list, tuple))
                                                                      else [target]) if isinstance(t, torch.Tensor))
        return out


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 7), nn.Tanh(), nn.Linear(7, 3))


def _backward(model: nn.Module, rank: int, micro_batches: int = 2) -> None:
    gen = torch.Generator().manual_seed(rank)
    for _ in range(micro_batches):  # a schedule's micro-batch backwards, adding into `.grad`
        model(torch.randn(4, 8, generator=gen)).square().mean().backward()


def _step(shard: bool, inplace: bool, held: bool) -> dict:
    """One pipelined step as the runner and the strategy drive it; returns this rank's reduced rows, whether ``.grad``
    shares the bucket storage, the bytes copied, and the reference mean."""
    world, rank = dist.get_world_size(), dist.get_rank()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    ref = _model()
    _backward(ref, rank)
    want = [p.grad.clone() for p in ref.parameters()]
    for g in want:
        dist.all_reduce(g)
        g.div_(world)

    model = _model()
    params = list(model.parameters())
    buckets = GradientBuckets(params, mesh, bucket_size_mb=25.0, shard=shard, overlap=False, inplace=inplace)
    counter = CopiedBytes()
    with counter:
        kept = buckets.hold(params) if held else set()  # train_step: zero the buffers, `.grad` = their views
        for p in params:
            if id(p) not in kept:
                p.grad = None  # held aside: autograd starts from None
        _backward(model, rank)
        if held:
            buckets.params_ready(params)  # the stage's last backward: launched inside the schedule
        pending = [p.grad for p in params]
        for p in params:
            p.grad = None  # between the schedule and backward (zero_grad)
        buckets.clear()
        if shard:
            buckets.attach_views()  # ZeRO-1's hide_model_grads before backward
        left = buckets.take(params, pending) if inplace else pending  # the runner's apply_gradients
        for p, g in zip(params, left):
            if g is not None:
                p.grad = g if p.grad is None else p.grad + g
        buckets.finish()
    rows, shares = [], []
    for p in params:
        bucket, s = buckets.slice_of[id(p)]
        rows.append((bucket.grad_view(s) if shard else p.grad).clone())
        if bucket.flat is not None:
            shares.append(p.grad is not None and
                          p.grad.untyped_storage().data_ptr() == bucket.flat.untyped_storage().data_ptr())
    numel = sum(p.numel() for p in params)
    return {"rows": rows, "want": want, "shares": shares, "copied": counter.bytes, "grad_bytes": 4 * numel,
            "flat": [b.flat is not None for b in buckets.buckets]}


def _runs() -> dict:
    dist.init_process_group("gloo")
    try:
        return {(shard, inplace, held): _step(shard, inplace, held)
                for shard in (False, True) for inplace, held in ((True, True), (True, False), (False, False))}
    finally:
        dist.destroy_process_group()


def test_pipelined_inplace_buckets_reduce_without_copies():
    ranks = spawn(_runs, 2, threads=1)
    for rank, runs in enumerate(ranks):
        for (shard, inplace, held), got in runs.items():
            assert all(got["flat"]) == inplace
            for i, (rows, want) in enumerate(zip(got["rows"], got["want"])):
                if shard:
                    chunk = -(-want.shape[0] // 2)
                    want = want[rank * chunk: (rank + 1) * chunk]
                torch.testing.assert_close(rows, want, rtol=1e-6, atol=1e-7,
                                           msg=lambda m: f"{shard, inplace, held} {i}: {m}")
            if not inplace:
                # the old path: every gradient copied into a rank-major send buffer, and (zero 0) back into `.grad`
                assert got["copied"] >= got["grad_bytes"] * (1 if shard else 2)
                continue
            # `.grad` is a view of the bucket buffer after backward, and the reduction wrote into it
            assert got["shares"] and all(got["shares"]), got["shares"]
            if held:
                # zero 0: nothing copied; zero 1: only the other rank's rows packed for the all-to-all (half at dp=2)
                assert got["copied"] <= (got["grad_bytes"] // 2 + 64 if shard else 0), got["copied"]
            else:
                # accumulating path (zero_grad may not follow the schedule): added into the buffer, one copy
                assert got["copied"] <= got["grad_bytes"] * (1.5 if shard else 1) + 64, got["copied"]
        if rank == 0:
            print({f"shard={k[0]} inplace={k[1]} held={k[2]}": f"{v['copied']} B copied / {v['grad_bytes']} B grads"
                   for k, v in runs.items()})
