"""ZeRO 2/3 (FSDP2 over dp) under pipeline parallelism, and DCP checkpoints resharded across pipeline sizes.

Parity with one process at fp32 tolerances (as tests/test_pipeline.py), no gradient communication on
accumulating micro-steps, and resumes pp=2 -> pp=1 and pp=1 -> pp=2 that restore every parameter and repeat the
uninterrupted run's losses. Real processes on CPU/gloo; each fixture runs several Trainers in one spawn.
"""

import pytest
import torch

from lightning_npu.launch import spawn
from lightning_npu.parallel.checkpoint.sharded import consolidate_model_state
from lightning_npu.parallel.config import ParallelConfig
from tests._pp_zero_workers import run_many

RTOL, ATOL = 1e-5, 1e-6  # a wrong or missing gradient reduction moves parameters by ~lr = 3e-3
STEP3 = "epoch=0-step=3.ckpt"  # limit_train_batches=3: the step-3 checkpoint is an epoch boundary
PP2 = {"pipeline_parallel_size": 2, "micro_batches": 2}
# accumulation runs also clip by the global gradient norm (dp-sharded DTensor gradients, summed over pp)
ACC = dict(steps=3, accumulate=2, limit_train_batches=None, gradient_clip_val=0.05)


def merged(ranks: list, restored: bool = False) -> dict:
    """Union of the ranks' (stages') tensors (`restored`: those restored from the checkpoint); dp replicas of a
    stage must agree."""
    out: dict = {}
    for rank in ranks:
        for k, v in (rank["restored"]["params"] if restored else rank["state"]).items():
            if k in out:
                torch.testing.assert_close(v, out[k], rtol=RTOL, atol=ATOL, msg=lambda m: f"replicas {k}: {m}")
            out[k] = v
    return out


def assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))[:8]
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=RTOL, atol=ATOL, msg=lambda m: f"{k}: {m}")


def assert_losses(got: list, ref: list) -> None:
    assert len(got) == len(ref) and got
    torch.testing.assert_close(torch.tensor(got), torch.tensor(ref), rtol=RTOL, atol=0)


def ckpt_path(tmp: dict, name: str):
    path = tmp["root"] / name / STEP3
    # pp > 1 writes sharded directories; the one process at pp=1 (dp only) writes the default single file
    assert path.is_file() if name == "pp1" else path.is_dir(), sorted(p.name for p in (tmp["root"] / name).iterdir())
    return path


# ---- runs ------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("pp_zero")


@pytest.fixture(scope="module")
def single(root):
    """One process, no pipeline: the references, and a pp=1 checkpoint for the pp=1 -> pp=2 resumes."""
    ref6, ref_acc = spawn(run_many, 1, [
        dict(steps=6, strategy_kwargs={"zero_stage": 0}, ckpt_dir=str(root / "pp1"), validate=True),
        dict(strategy_kwargs={"zero_stage": 0}, **ACC),
    ])[0]
    return {"root": root, "ref6": ref6, "ref_acc": ref_acc}


@pytest.fixture(scope="module")
def pp2(single):
    """pp=2 x dp=1 (2 processes): a ZeRO-1 run that saves, the pp=1 checkpoint resumed under ZeRO 1 and ZeRO 3."""
    pp1_ckpt = str(ckpt_path(single, "pp1"))
    ranks = spawn(run_many, 2, [
        dict(steps=6, strategy_kwargs={**PP2, "zero_stage": 1}, ckpt_dir=str(single["root"] / "pp2_zero1")),
        dict(steps=6, strategy_kwargs={**PP2, "zero_stage": 1}, ckpt_in=pp1_ckpt),
        dict(steps=6, strategy_kwargs={**PP2, "zero_stage": 3}, ckpt_in=pp1_ckpt),
    ])
    return {"save": [r[0] for r in ranks], "from_pp1": {1: [r[1] for r in ranks], 3: [r[2] for r in ranks]}}


@pytest.fixture(scope="module")
def pp2_dp2(single):
    """pp=2 x dp=2 (4 processes): ZeRO 2 with 1F1B and ZeRO 3 with interleaved 1F1B (both saving a checkpoint and
    validating after fit); with gradient accumulation and clipping, ZeRO 3 with 1F1B and ZeRO 2 with GPipe."""
    root = single["root"]
    ranks = spawn(run_many, 4, [
        dict(steps=6, strategy_kwargs={**PP2, "zero_stage": 2}, ckpt_dir=str(root / "pp2dp2_zero2"), validate=True),
        dict(steps=6, strategy_kwargs={**PP2, "zero_stage": 3, "pipeline_schedule": "interleaved_1f1b"},
             ckpt_dir=str(root / "pp2dp2_zero3"), validate=True),
        dict(strategy_kwargs={**PP2, "zero_stage": 3}, **ACC),
        dict(strategy_kwargs={**PP2, "zero_stage": 2, "pipeline_schedule": "gpipe"}, **ACC),
    ])
    return {"zero2": [r[0] for r in ranks], "zero3_interleaved": [r[1] for r in ranks],
            "zero3_acc": [r[2] for r in ranks], "zero2_gpipe_acc": [r[3] for r in ranks]}


@pytest.fixture(scope="module")
def pp1_resumes(single, pp2, pp2_dp2):
    """One process, one launch: resumes the pp=2 ZeRO-1 checkpoint (pp=2 -> pp=1, ZeRO 0/1), and the pp=2 x dp=2
    ZeRO 2 and ZeRO 3 checkpoints under ZeRO 2 / ZeRO 3 (world 4 -> 1)."""
    from_pp2, z2, z3 = spawn(run_many, 1, [
        dict(steps=6, strategy_kwargs={"zero_stage": 1}, ckpt_in=str(ckpt_path(single, "pp2_zero1"))),
        dict(steps=6, strategy_kwargs={"zero_stage": 2}, ckpt_in=str(ckpt_path(single, "pp2dp2_zero2"))),
        dict(steps=6, strategy_kwargs={"zero_stage": 3}, ckpt_in=str(ckpt_path(single, "pp2dp2_zero3"))),
    ])[0]
    return {"pp2": from_pp2, 2: z2, 3: z3}


def check_resume(resumed: list, uninterrupted: list, saved: dict) -> None:
    """Every rank restored exactly its stage's saved parameters (together: all of them); the steps after the
    resume log the uninterrupted run's losses and end at its parameters."""
    for rank in resumed:
        assert rank["restored"]["step"] == 3 and rank["global_step"] == 6
        for k, v in rank["restored"]["params"].items():
            torch.testing.assert_close(v, saved[k], rtol=0, atol=0, msg=lambda m: f"restored {k}: {m}")
        assert_losses(rank["logged"], uninterrupted[0]["logged"][3:])
    assert merged(resumed, restored=True).keys() == saved.keys()
    assert_same(merged(resumed), merged(uninterrupted))


# ---- ZeRO 2/3 x pp parity ----------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("run", ["zero2", "zero3_interleaved"])
def test_pp2_dp2_zero_matches_single_process(single, pp2_dp2, run):
    ranks, ref = pp2_dp2[run], single["ref6"]
    assert [r["mesh"] for r in ranks] == [(2, 2, 1)] * 4
    assert all(r["fully_sharded"] and r["optimizer"] == "MixedPrecisionOptimizer" for r in ranks)
    if run == "zero3_interleaved":
        assert [r["stages"] for r in ranks] == [[0, 2], [0, 2], [1, 3], [1, 3]]
    # each rank holds half (dp) of its stage's parameters
    total = sum(v.numel() for v in ref["state"].values())
    assert sum(r["local_numel"] for r in ranks) == pytest.approx(total, rel=0.01)
    for rank in ranks:
        assert_losses(rank["logged"], ref["logged"])
        assert rank["global_step"] == 6
        assert rank["val_loss"] == pytest.approx(ref["val_loss"], rel=RTOL)  # the eval schedule on FSDP stages
    assert ref["logged"][-1] < ref["logged"][0]
    assert_same(merged(ranks), ref["state"])


@pytest.mark.slow
@pytest.mark.parametrize("run", ["zero3_acc", "zero2_gpipe_acc"])
def test_pp2_dp2_zero_accumulation_matches_and_skips_reduce_scatter(single, pp2_dp2, run):
    ranks, ref = pp2_dp2[run], single["ref_acc"]
    # recorded at every micro-step's end (the last optimizer step's norm): 3 distinct norms, all clipped
    assert len(set(ref["grad_norms"])) == 3 and all(n > 0.05 for n in ref["grad_norms"])
    for rank in ranks:
        assert rank["fully_sharded"]
        assert_losses(rank["logged"], ref["logged"])
        assert_losses(rank["grad_norms"], ref["grad_norms"])
        assert len(rank["logged"]) == 6  # 3 optimizer steps x 2 accumulated micro-batches
        counts = rank["reduce_scatters"]
        assert counts[0::2] == [0, 0, 0], counts  # accumulating micro-steps: no gradient communication
        # the stepping micro-step: one reduce-scatter per FSDP unit of the stage (2 blocks + embedding/head
        # modules), once per schedule step, not once per pipeline micro-batch
        assert all(c == 4 for c in counts[1::2]), counts
    assert_same(merged(ranks), ref["state"])


# ---- resharding checkpoints across pipeline sizes ------------------------------------------------------
def test_pp2_zero1_checkpoint_resumes_under_pp1(single, pp2, pp1_resumes):
    saver = pp2["save"]
    assert_losses(saver[0]["logged"], single["ref6"]["logged"])  # the pp=2 run is the uninterrupted run
    saved, _ = consolidate_model_state(ckpt_path(single, "pp2_zero1"))
    check_resume([pp1_resumes["pp2"]], saver, saved)


@pytest.mark.parametrize("zero_stage", [1, 3])
def test_pp1_checkpoint_resumes_under_pp2(single, pp2, zero_stage):
    saved, _ = consolidate_model_state(ckpt_path(single, "pp1"))
    resumed = pp2["from_pp1"][zero_stage]
    assert resumed[0]["stages"] == [0] and resumed[1]["stages"] == [1]
    assert resumed[0]["restored"]["params"].keys().isdisjoint(resumed[1]["restored"]["params"].keys())
    check_resume(resumed, [single["ref6"]], saved)


@pytest.mark.slow
@pytest.mark.parametrize("zero_stage", [2, 3])
def test_pp2_dp2_zero_checkpoint_resumes_under_pp1(single, pp2_dp2, pp1_resumes, zero_stage):
    name = {2: "zero2", 3: "zero3_interleaved"}[zero_stage]
    saved, meta = consolidate_model_state(ckpt_path(single, f"pp2dp2_zero{zero_stage}"))
    layout = meta["lightning_npu"]
    assert (layout["pipeline_parallel_size"], layout["data_parallel_size"], layout["zero_stage"]) == (2, 2, zero_stage)
    check_resume([pp1_resumes[zero_stage]], pp2_dp2[name], saved)


# ---- configuration ----------------------------------------------------------------------------------------
def test_zero23_with_pp_accepted_also_with_tp():
    for stage in (2, 3):
        assert ParallelConfig(zero_stage=stage, pipeline_parallel_size=2).zero_stage == stage
        # pp x tp x zero 2/3: tests/test_pipeline_tp_checkpoint.py
        assert ParallelConfig(zero_stage=stage, pipeline_parallel_size=2, tensor_parallel_size=2).zero_stage == stage
