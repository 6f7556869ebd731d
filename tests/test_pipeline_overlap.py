"""Pipeline parallelism x ZeRO 0/1: each stage's dp reduction starts after its last micro-batch backward, inside the
schedule; the results are bit-identical to reducing after the schedule."""

import torch

from lightning_npu.launch import spawn
from tests._pp_overlap_workers import train_overlap

RUNS = [
    {"strategy": {"zero_stage": 0}, "overlap": True},
    {"strategy": {"zero_stage": 0}, "overlap": False},
    {"strategy": {"zero_stage": 1, "pipeline_schedule": "interleaved_1f1b"}, "overlap": True},
    {"strategy": {"zero_stage": 1, "pipeline_schedule": "interleaved_1f1b"}, "overlap": False},
    # accumulating: the held-aside gradients are added after the schedule, so the reduction waits for them
    {"strategy": {"zero_stage": 0}, "overlap": True, "trainer": {"accumulate_grad_batches": 2}},
]


def test_pp2_dp2_zero01_reduce_inside_the_schedule():
    ranks = spawn(train_overlap, 4, RUNS, 4, {})
    for rank in ranks:
        z0, z0_after, z1, z1_after, acc = rank
        assert all(n > 0 for n in z0["in_flight"]) and all(n > 0 for n in z1["in_flight"])
        assert z0_after["in_flight"] == [0] * 4 == z1_after["in_flight"] and acc["in_flight"] == [0] * 8
        for on, off in ((z0, z0_after), (z1, z1_after)):
            assert on["logged"] == off["logged"]
            for k in on["state"]:
                torch.testing.assert_close(on["state"][k], off["state"][k], rtol=0, atol=0)
        assert z0["logged"][-1] < z0["logged"][0]
