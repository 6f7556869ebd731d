"""Pipeline parallelism (torch.distributed.pipelining inside Lightning's loop) must reproduce single-process
training exactly (fp32): losses, logged train/val loss, parameters, predictions, clipping, resume, and 3D layouts."""

import pytest
import torch

from lightning_npu.launch import spawn
from tests._pp_workers import train_pp

# as tests/test_foundation_parity.py: fp32 rtol 1e-5, atol 1e-6 on parameters (~0.02); a wrong gradient moves
# parameters by ~lr = 3e-3, three orders above this bound
RTOL, ATOL = 1e-5, 1e-6
STEPS, BATCH = 5, 8


def merged_state(ranks: list) -> dict:
    """The union of every rank's (stage's) parameters; replicas (dp/tp peers) must agree exactly-ish."""
    merged: dict = {}
    for rank in ranks:
        for k, v in rank["state"].items():
            if k in merged:
                torch.testing.assert_close(v, merged[k], rtol=RTOL, atol=ATOL, msg=lambda m: f"replicas {k}: {m}")
            merged[k] = v
    return merged


def assert_matches(ranks: list, ref: dict, check_logits: bool = True) -> None:
    for rank in ranks:
        # the logged (sync_dist) train_loss is the last stage's loss on every rank
        torch.testing.assert_close(torch.tensor(rank["logged"]), torch.tensor(ref["logged"]), rtol=RTOL, atol=0)
        assert rank["val_loss"] == pytest.approx(ref["val_loss"], rel=RTOL)
        assert rank["global_step"] == ref["global_step"]
    assert ref["logged"][-1] < ref["logged"][0]  # it trained
    state = merged_state(ranks)
    assert state.keys() == ref["state"].keys()
    for k in state:
        torch.testing.assert_close(state[k], ref["state"][k], rtol=RTOL, atol=ATOL, msg=lambda m: f"{k}: {m}")
    if check_logits:
        preds = [r for r in ranks if r["logits"] is not None]
        assert preds, "no rank returned predictions"
        dp = ranks[0]["mesh"][1]
        for r in preds:  # the predict loader's DistributedSampler gives dp rank d the samples d, d+dp, ...
            torch.testing.assert_close(r["logits"], ref["logits"][r["dp_rank"]::dp], rtol=1e-4, atol=1e-5)


@pytest.fixture(scope="module")
def single_process():
    return spawn(train_pp, 1, 1, BATCH, STEPS, {"zero_stage": 0})[0]


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved_1f1b"])
def test_pp2_matches_single_process(single_process, schedule):
    ranks = spawn(train_pp, 2, 2, BATCH, STEPS,
                  {"pipeline_parallel_size": 2, "pipeline_schedule": schedule, "micro_batches": 4})
    assert ranks[0]["mesh"] == (2, 1, 1)
    # each rank holds only its stages: disjoint parameters, together the whole model
    assert ranks[0]["state"].keys().isdisjoint(ranks[1]["state"].keys())
    assert ranks[0]["local_numel"] + ranks[1]["local_numel"] == sum(v.numel() for v in single_process["state"].values())
    assert "model.transformer.wte.weight" in ranks[0]["state"] and "model.lm_head.weight" in ranks[1]["state"]
    if schedule == "interleaved_1f1b":
        assert ranks[0]["stages"] == [0, 2] and ranks[1]["stages"] == [1, 3]
    else:
        assert ranks[0]["stages"] == [0] and ranks[1]["stages"] == [1]
    assert_matches(ranks, single_process)


def test_pp2_clipping_and_accumulation():
    """Global-norm clipping counts each stage's gradients once (all-reduced over pp); accumulation is not rescaled."""
    # train_pp(devices, batch, steps, strategy, model, ckpt_dir, ckpt_in, limit_train_batches, clip, accumulate)
    clip = (None, None, None, None, 0.05, 2)
    ref = spawn(train_pp, 1, 1, BATCH, 3, {"zero_stage": 0}, *clip)[0]
    ranks = spawn(train_pp, 2, 2, BATCH, 3, {"pipeline_parallel_size": 2, "micro_batches": 2}, *clip)
    assert ref["grad_norms"] and all(n > 0.05 for n in ref["grad_norms"])  # clipping was active
    for rank in ranks:
        torch.testing.assert_close(torch.tensor(rank["grad_norms"]), torch.tensor(ref["grad_norms"]), rtol=RTOL, atol=0)
    assert_matches(ranks, ref, check_logits=False)


def test_pp2_resume_matches_uninterrupted(tmp_path):
    """Per-stage DCP checkpoints every 3 steps; resuming from step 3 repeats steps 4-6 exactly."""
    pp = {"pipeline_parallel_size": 2, "micro_batches": 2}
    full = spawn(train_pp, 2, 2, BATCH, 6, pp, None, str(tmp_path), None, 3)
    ckpt = tmp_path / "epoch=0-step=3.ckpt"
    assert ckpt.is_dir(), sorted(p.name for p in tmp_path.iterdir())
    resumed = spawn(train_pp, 2, 2, BATCH, 6, pp, None, None, str(ckpt), 3)
    assert resumed[0]["global_step"] == 6
    for r_full, r_res in zip(full, resumed):
        torch.testing.assert_close(torch.tensor(r_res["logged"]), torch.tensor(r_full["logged"][3:]), rtol=RTOL, atol=0)
        assert r_res["state"].keys() == r_full["state"].keys()
        for k in r_full["state"]:
            torch.testing.assert_close(r_res["state"][k], r_full["state"][k], rtol=RTOL, atol=ATOL)


@pytest.mark.slow
def test_pp2_tp2_matches_single_process(single_process):
    ranks = spawn(train_pp, 4, 4, BATCH, STEPS,
                  {"pipeline_parallel_size": 2, "tensor_parallel_size": 2, "micro_batches": 2})
    assert ranks[0]["mesh"] == (2, 1, 2)
    assert_matches(ranks, single_process)


@pytest.mark.slow
def test_3d_pp2_dp2_tp2_matches_single_process(single_process):
    """8 processes on one mesh: pp=2 x dp=2 x tp=2 (ZeRO-1 over dp), 1F1B with 2 micro-batches per dp rank."""
    ranks = spawn(train_pp, 8, 8, BATCH, STEPS,
                  {"pipeline_parallel_size": 2, "tensor_parallel_size": 2, "data_parallel_size": 2,
                   "zero_stage": 1, "micro_batches": 2})
    assert ranks[0]["mesh"] == (2, 2, 2)
    assert [r["stages"] for r in ranks] == [[0]] * 4 + [[1]] * 4
    assert_matches(ranks, single_process)
