"""ZeRO-1's in-place gloo buckets (`GradientBuckets` with ``shard=True``): the all-to-all reduce-scatter gives each
rank exactly the mean of its rows that the in-place all-reduce gave, for uneven row counts (padding), a rank that owns
no rows of a parameter, and dp=2 and 3; a second backward before ``zero_grad`` (manual optimization) adds the new
mean to the old one, as ``.grad`` would."""

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from lightning_npu.launch import spawn
from lightning_npu.parallel.data_parallel.sync import GradientBuckets

SHAPES = [(7, 3), (2, 5), (1, 4), (16, 16), (5,)]  # odd rows: padded slices; (1, 4), (2, 5): ranks without rows


def _grads(step: int, rank: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * step + rank)
    return [torch.randn(s, generator=gen) for s in SHAPES]


def _reduce(mode: str, backwards: int) -> list[torch.Tensor]:
    """Each rank's reduced rows of every parameter after `backwards` backwards without zero_grad."""
    GradientBuckets.inplace_reduction = mode
    world, rank = dist.get_world_size(), dist.get_rank()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    params = [nn.Parameter(torch.zeros(s)) for s in SHAPES]
    buckets = GradientBuckets(params, mesh, bucket_size_mb=25.0, shard=True, overlap=True)
    assert all(b.flat is not None for b in buckets.buckets)
    assert all((b.peer_plan is not None) == (mode == "all_to_all") for b in buckets.buckets)
    for step in range(backwards):
        buckets.attach_views()  # what hide_model_grads does before each backward
        for p, g in zip(params, _grads(step, rank)):
            p.grad.add_(g)  # autograd adds into the buffer view
            buckets._on_grad_ready(p)
        buckets.finish()
    return [buckets.slice_of[id(p)][0].grad_view(buckets.slice_of[id(p)][1]).clone() for p in params]


def _both(backwards: int) -> dict:
    dist.init_process_group("gloo")
    try:
        return {mode: _reduce(mode, backwards) for mode in ("all_to_all", "all_reduce")}
    finally:
        GradientBuckets.inplace_reduction = "all_to_all"
        dist.destroy_process_group()


def test_all_to_all_reduce_scatter_equals_all_reduce():
    for world in (2, 3):
        for backwards in (1, 2):
            ranks = spawn(_both, world, backwards, threads=1)
            for rank, got in enumerate(ranks):
                for i, shape in enumerate(SHAPES):
                    chunk = -(-shape[0] // world)
                    rows = slice(min(shape[0], rank * chunk), min(shape[0], (rank + 1) * chunk))
                    want = sum(sum(_grads(step, r)[i] for r in range(world)) / world for step in range(backwards))
                    # each step's mean added to the last: the order of the float additions may differ by an ulp
                    torch.testing.assert_close(got["all_to_all"][i], want[rows], rtol=1e-6, atol=1e-6)
                    torch.testing.assert_close(got["all_to_all"][i], got["all_reduce"][i], rtol=1e-6, atol=1e-6)
                    if world == 2 and backwards == 1:  # one SUM of two values, divided by 2: bit for bit
                        assert torch.equal(got["all_to_all"][i], got["all_reduce"][i])
