"""Resuming data-parallel training must repeat the uninterrupted run exactly (fp32). (dp=2 against one process:
the layout table, tests/test_layouts.py.)"""

import pytest
import torch

from tests._layouts import Layout, launch_calls, run_layout

# fp32: rtol 1e-5, plus atol 1e-6 on parameters (~0.02 in size) so Adam's first steps, which turn
# 1e-7 gradient rounding differences into near-lr-sized updates on tiny gradients, do not flake.
# A missing or wrong all-reduce moves parameters by ~lr = 3e-3, three orders above this bound.
RTOL, ATOL = 1e-5, 1e-6
DP2_ZERO1 = Layout("dp2-zero1", 2, {"zero_stage": 1}, checks=(), clip=None)
WARMUP = Layout("dp2-zero1-warmup", 2, {"zero_stage": 1}, checks=(), model={"warmup_steps": 4}, clip=None)
STEP3 = "epoch=0-step=3.ckpt"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Both layouts in two launches (start-up and imports paid once each): 6 steps checkpointing every 3, then a
    new Trainer per layout resumed from step 3. name -> (checkpoint folder, uninterrupted ranks, resumed ranks)."""
    root = tmp_path_factory.mktemp("parity")
    layouts = {"plain": DP2_ZERO1, "warmup": WARMUP}
    train = dict(steps=6, limit_train_batches=3)
    full = launch_calls(2, [(run_layout, dict(layout=lay, ckpt_dir=str(root / n), **train)) for n, lay in layouts.items()])
    resumed = launch_calls(2, [(run_layout, dict(layout=lay, ckpt_in=str(root / n / STEP3), **train))
                               for n, lay in layouts.items()])
    return {n: (root / n, f, r) for n, f, r in zip(layouts, full, resumed)}


def assert_same_state(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=RTOL, atol=ATOL, msg=lambda m: f"{k}: {m}")


def test_resume_matches_uninterrupted(runs):
    """dp=2 with ZeRO-1 checkpoints every 3 steps; a new Trainer resumed from step 3 repeats steps 4-6 exactly."""
    folder, full, resumed = runs["plain"]
    # the checkpoint (dp-only ZeRO-1: one Lightning file by default) under the name ModelCheckpoint chose
    assert (folder / STEP3).exists(), sorted(p.name for p in folder.iterdir())
    assert resumed[0]["global_step"] == 6
    torch.testing.assert_close(
        torch.tensor(resumed[0]["logged"]), torch.tensor(full[0]["logged"][3:]), rtol=RTOL, atol=0
    )
    for rank in resumed:
        assert_same_state(rank["state"], full[0]["state"])


def test_resume_zero1_with_warmup_scheduler_matches_uninterrupted(runs):
    """ZeRO-1 + a step-interval LR scheduler still warming up at the checkpoint (LambdaLR, 4 warmup steps):
    the checkpoint must hold the lr the scheduler set after step 3 (on the ZeroRedundancyOptimizer's exposed
    param groups), not the one the local partition optimizer last stepped with; else step 4 runs with step 3's
    lr and steps 5-6 diverge."""
    folder, full, resumed = runs["warmup"]
    assert (folder / STEP3).exists(), sorted(p.name for p in folder.iterdir())
    # recorded after each step's scheduler step: step 4 runs with lr[2], which differs from step 3's lr[1]
    lr = full[0]["lr"]
    assert lr[0] < lr[1] < lr[2] == lr[3], lr
    assert resumed[0]["global_step"] == 6
    for r, f in zip(resumed, full):
        assert r["lr"] == f["lr"][3:]
        torch.testing.assert_close(torch.tensor(r["logged"]), torch.tensor(f["logged"][3:]), rtol=RTOL, atol=0)
        torch.testing.assert_close(torch.tensor(r["local"]), torch.tensor(f["local"][3:]), rtol=RTOL, atol=0)
        assert_same_state(r["state"], f["state"])
