"""Pipeline parallelism x ZeRO 0/1: each stage's dp reduction starts after its last micro-batch backward, inside the
schedule; the results are bit-identical to reducing after the schedule. The gradients are views of the buckets'
in-place buffers (`GradientBuckets.hold` / `take`)."""

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
    {"strategy": {"zero_stage": 1}, "overlap": True, "trainer": {"accumulate_grad_batches": 2}},
]
# one process, no pipeline: what every run above must reproduce (fp32)
REFERENCE = [{"pp": 1, "strategy": {"zero_stage": 0}, "overlap": True},
             {"pp": 1, "strategy": {"zero_stage": 0}, "overlap": True, "trainer": {"accumulate_grad_batches": 2}}]
RTOL, ATOL = 1e-5, 1e-6  # tests/test_pipeline_zero.py's


def test_pp2_dp2_zero01_reduce_inside_the_schedule():
    ranks = spawn(train_overlap, 4, RUNS, 4, {})
    ref, ref_acc = spawn(train_overlap, 1, REFERENCE, 4, {}, 1)[0]
    for rank in ranks:
        z0, z0_after, z1, z1_after, acc, acc1 = rank
        assert all(n > 0 for n in z0["in_flight"]) and all(n > 0 for n in z1["in_flight"])
        assert z0_after["in_flight"] == [0] * 4 == z1_after["in_flight"] and acc["in_flight"] == [0] * 8
        for run, want in ((z0, ref), (z1, ref), (acc, ref_acc), (acc1, ref_acc)):  # parity with one process
            torch.testing.assert_close(torch.tensor(run["logged"]), torch.tensor(want["logged"]), rtol=RTOL, atol=0)
            for k, v in run["state"].items():
                torch.testing.assert_close(v, want["state"][k], rtol=RTOL, atol=ATOL, msg=lambda m: f"{k}: {m}")
        for on, off in ((z0, z0_after), (z1, z1_after)):
            assert on["logged"] == off["logged"]
            for k in on["state"]:
                torch.testing.assert_close(on["state"][k], off["state"][k], rtol=0, atol=0)
        assert z0["logged"][-1] < z0["logged"][0]
        # fp32 on gloo: every gradient after backward is a view of its bucket's buffer (reduced in place, no copy)
        for run in rank:
            assert run["in_buffer"] and all(f == 1.0 for f in run["in_buffer"]), run["in_buffer"]
        # bytes the gradient sync copies per step: zero 0 none, zero 1 only the other rank's rows (the all-to-all's
        # send buffer, half the gradients at dp=2); accumulating, each micro-step's gradients added into the buffer
        half = rank[0]["grad_bytes"] / 2
        assert z0["copied_per_step"] == z0_after["copied_per_step"] == 0
        assert z1["copied_per_step"] == z1_after["copied_per_step"] <= half * 1.01, (z1["copied_per_step"], half)
        assert 0 < acc["copied_per_step"] <= 2 * half  # the first micro-step's gradients copied into the zeroed buffer
        print(f"copied per step (bytes, of {2 * half:.0f} gradient bytes): zero0 {z0['copied_per_step']:.0f}, "
              f"zero1 {z1['copied_per_step']:.0f}, zero0 accumulating {acc['copied_per_step']:.0f}, "
              f"zero1 accumulating {acc1['copied_per_step']:.0f}")
