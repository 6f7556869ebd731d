"""Data-parallel training must reproduce single-process training exactly (fp32)."""

import pytest
import torch

from lightning_npu.launch import spawn
from tests._gpt_workers import train_gpt

# fp32: rtol 1e-5, plus atol 1e-6 on parameters (~0.02 in size) so Adam's first steps, which turn
# 1e-7 gradient rounding differences into near-lr-sized updates on tiny gradients, do not flake.
# A missing or wrong all-reduce moves parameters by ~lr = 3e-3, three orders above this bound.
RTOL, ATOL = 1e-5, 1e-6


def assert_same_state(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=RTOL, atol=ATOL, msg=lambda m: f"{k}: {m}")


@pytest.fixture(scope="module")
def single_process():
    return spawn(train_gpt, 1, 1, 8, 5, {"zero_stage": 0})[0]


@pytest.mark.parametrize("zero_stage", [0, 1])
def test_dp2_matches_single_process(single_process, zero_stage):
    ranks = spawn(train_gpt, 2, 2, 8, 5, {"zero_stage": zero_stage})
    ref = single_process
    assert ranks[0]["mesh"] == (1, 2, 1)
    assert ranks[0]["optimizer"] == ("DistributedOptimizer" if zero_stage == 1 else "MixedPrecisionOptimizer")
    # each rank saw different data: the local losses differ, the synced logged loss is the global one
    assert ranks[0]["local"] != ranks[1]["local"]
    torch.testing.assert_close(torch.tensor(ranks[0]["logged"]), torch.tensor(ref["logged"]), rtol=RTOL, atol=0)
    torch.testing.assert_close(torch.tensor(ranks[1]["logged"]), torch.tensor(ref["logged"]), rtol=RTOL, atol=0)
    assert ref["logged"][-1] < ref["logged"][0]  # it trained
    for rank in ranks:
        assert_same_state(rank["state"], ref["state"])
    assert ranks[0]["val_loss"] == pytest.approx(ref["val_loss"], rel=RTOL)


def test_resume_matches_uninterrupted(tmp_path):
    """dp=2 with ZeRO-1 checkpoints every 3 steps; a new Trainer resumed from step 3 repeats steps 4-6 exactly."""
    full = spawn(train_gpt, 2, 2, 8, 6, {"zero_stage": 1}, str(tmp_path), None, "32-true", None, 3)
    ckpt = tmp_path / "epoch=0-step=3.ckpt"
    # the checkpoint (dp-only ZeRO-1: one Lightning file by default) under the name ModelCheckpoint chose
    assert ckpt.exists(), sorted(p.name for p in tmp_path.iterdir())
    resumed = spawn(train_gpt, 2, 2, 8, 6, {"zero_stage": 1}, None, str(ckpt), "32-true", None, 3)
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
    args = (2, 8, 6, {"zero_stage": 1})
    model_kwargs = {"warmup_steps": 4}
    full = spawn(train_gpt, 2, *args, str(tmp_path), None, "32-true", model_kwargs, 3)
    ckpt = tmp_path / "epoch=0-step=3.ckpt"
    assert ckpt.exists(), sorted(p.name for p in tmp_path.iterdir())
    resumed = spawn(train_gpt, 2, *args, None, str(ckpt), "32-true", model_kwargs, 3)
    # recorded after each step's scheduler step: step 4 runs with lr[2], which differs from step 3's lr[1]
    lr = full[0]["lr"]
    assert lr[0] < lr[1] < lr[2] == lr[3], lr
    assert resumed[0]["global_step"] == 6
    for r, f in zip(resumed, full):
        assert r["lr"] == f["lr"][3:]
        torch.testing.assert_close(torch.tensor(r["logged"]), torch.tensor(f["logged"][3:]), rtol=RTOL, atol=0)
        torch.testing.assert_close(torch.tensor(r["local"]), torch.tensor(f["local"][3:]), rtol=RTOL, atol=0)
        assert_same_state(r["state"], f["state"])
