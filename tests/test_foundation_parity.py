"""Resuming data-parallel training must repeat the uninterrupted run exactly (fp32). (dp=2 against one process:
the layout table, tests/test_layouts.py.)"""

from functools import partial

import torch

from lightning_npu.launch import spawn
from tests._layouts import Layout, run_layout

# fp32: rtol 1e-5, plus atol 1e-6 on parameters (~0.02 in size) so Adam's first steps, which turn
# 1e-7 gradient rounding differences into near-lr-sized updates on tiny gradients, do not flake.
# A missing or wrong all-reduce moves parameters by ~lr = 3e-3, three orders above this bound.
RTOL, ATOL = 1e-5, 1e-6
DP2_ZERO1 = Layout("dp2-zero1", 2, {"zero_stage": 1}, checks=(), clip=None)


def assert_same_state(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=RTOL, atol=ATOL, msg=lambda m: f"{k}: {m}")


def test_resume_matches_uninterrupted(tmp_path):
    """dp=2 with ZeRO-1 checkpoints every 3 steps; a new Trainer resumed from step 3 repeats steps 4-6 exactly."""
    full = spawn(partial(run_layout, steps=6, ckpt_dir=str(tmp_path), limit_train_batches=3), 2, DP2_ZERO1)
    ckpt = tmp_path / "epoch=0-step=3.ckpt"
    # the checkpoint (dp-only ZeRO-1: one Lightning file by default) under the name ModelCheckpoint chose
    assert ckpt.exists(), sorted(p.name for p in tmp_path.iterdir())
    resumed = spawn(partial(run_layout, steps=6, ckpt_in=str(ckpt), limit_train_batches=3), 2, DP2_ZERO1)
    assert resumed[0]["global_step"] == 6
    torch.testing.assert_close(
        torch.tensor(resumed[0]["logged"]), torch.tensor(full[0]["logged"][3:]), rtol=RTOL, atol=0
    )
    for rank in resumed:
        assert_same_state(rank["state"], full[0]["state"])


def test_resume_zero1_with_warmup_scheduler_matches_uninterrupted(tmp_path):
    """ZeRO-1 + a step-interval LR scheduler still warming up at the checkpoint (LambdaLR, 4 warmup steps):
    the checkpoint must hold the lr the scheduler set after step 3 (on the ZeroRedundancyOptimizer's exposed
    param groups), not the one the local partition optimizer last stepped with; else step 4 runs with step 3's
    lr and steps 5-6 diverge."""
    layout = Layout("dp2-zero1-warmup", 2, {"zero_stage": 1}, checks=(), model={"warmup_steps": 4}, clip=None)
    full = spawn(partial(run_layout, steps=6, ckpt_dir=str(tmp_path), limit_train_batches=3), 2, layout)
    ckpt = tmp_path / "epoch=0-step=3.ckpt"
    assert ckpt.exists(), sorted(p.name for p in tmp_path.iterdir())
    resumed = spawn(partial(run_layout, steps=6, ckpt_in=str(ckpt), limit_train_batches=3), 2, layout)
    # recorded after each step's scheduler step: step 4 runs with lr[2], which differs from step 3's lr[1]
    lr = full[0]["lr"]
    assert lr[0] < lr[1] < lr[2] == lr[3], lr
    assert resumed[0]["global_step"] == 6
    for r, f in zip(resumed, full):
        assert r["lr"] == f["lr"][3:]
        torch.testing.assert_close(torch.tensor(r["logged"]), torch.tensor(f["logged"][3:]), rtol=RTOL, atol=0)
        torch.testing.assert_close(torch.tensor(r["local"]), torch.tensor(f["local"][3:]), rtol=RTOL, atol=0)
        assert_same_state(r["state"], f["state"])
