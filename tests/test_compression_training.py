"""Gradient compression through the real training path (dp=2, gloo): bytes on the wire and losses vs uncompressed."""

import math

import pytest
import torch

from tests._compression_workers import run_many, run_many_branches, unmatched_glob_error
from tests._layouts import launch_calls

STEPS, ACC = 4, 2
MODES = [None, "bf16", {"mode": "topk", "ratio": 0.05}]  # the last one is TOPK_EF
SCENARIOS = [dict(zero_stage=z, compression=c, steps=STEPS, accumulate=ACC) for z in (0, 1) for c in MODES]


TOPK_EF = {"mode": "topk", "ratio": 0.05}


@pytest.fixture(scope="module")
def launch(tmp_path_factory):
    """The module's every run in one 2-process launch (start-up and imports paid once): the GPT scenarios, the
    two-branch glob scenarios, then the refused glob; per call, each rank's result."""
    ckpt = tmp_path_factory.mktemp("ckpt")
    resume = [dict(zero_stage=1, compression=TOPK_EF, steps=2, accumulate=ACC, ckpt_dir=str(ckpt)),
              dict(zero_stage=1, compression=TOPK_EF, steps=4, accumulate=ACC, ckpt_in=str(ckpt / "epoch=0-step=2.ckpt"))]
    powersgd = [dict(zero_stage=z, compression={"mode": "powersgd", "rank": 2}, steps=STEPS, accumulate=ACC)
                for z in (0, 1)]
    # zero 0: DDP rebuilds its buckets after the first step, and the resumed run starts from the initial ones again
    resume0 = [dict(zero_stage=0, compression=TOPK_EF, steps=2, accumulate=ACC, ckpt_dir=str(ckpt / "z0")),
               dict(zero_stage=0, compression=TOPK_EF, steps=4, accumulate=ACC,
                    ckpt_in=str(ckpt / "z0" / "epoch=0-step=2.ckpt"))]
    branches = [dict(zero_stage=z, compression=c, steps=s) for z in (0, 1) for c, s in
                ((None, 1), (INT8_TEXT, 1), (INT8_TEXT, 3))]
    return launch_calls(2, [
        (run_many, dict(scenarios=SCENARIOS + resume + powersgd + resume0)),
        (run_many_branches, dict(scenarios=branches)),
        # a failed `fit` last: nothing runs after it in this process group
        (unmatched_glob_error, dict(compression={"text.*": "int8", "txet.*": None})),
    ])


@pytest.fixture(scope="module")
def runs(launch):
    return launch[0][0]


@pytest.mark.parametrize("zero", [0, 1])
def test_powersgd_factorises_each_weight_on_the_real_path(runs, zero):
    """DDP's buckets (zero 0) and ZeRO-1's rank-major ones hand PowerSGD their parameters' shapes: one warm-start Q
    per weight matrix (the GPT's 2-D weights), biases and norms sent uncompressed; once per optimizer step."""
    plain, psgd = runs[3 * zero], runs[8 + zero]
    matrices = [n for n, numel in psgd["numel"].items() if n.endswith("weight") and "ln" not in n]
    assert len(psgd["q_factors"]) >= len(matrices) - 1, psgd["q_factors"]  # (a tied embedding/head counts once)
    assert set(psgd["calls"].values()) == {STEPS}, psgd["calls"]
    assert psgd["bytes"] <= 0.15 * plain["bytes"], (psgd["bytes"], plain["bytes"])
    assert psgd["losses"] == pytest.approx(plain["losses"], rel=0.05)


@pytest.mark.parametrize("zero", [0, 1])
def test_resume_restores_compressor_state(runs, zero):
    """Each parameter keeps its own error-feedback residual whatever bucket holds it (under zero 0 the residuals
    used to follow DDP's bucket index: after DDP rebuilt its buckets, and on resume, a bucket of the same size got
    another layout's residual, and the resumed losses drifted by 2e-4)."""
    uninterrupted, first, resumed = (runs[5], runs[6], runs[7]) if zero else (runs[2], runs[10], runs[11])
    assert first["losses"] + resumed["losses"] == pytest.approx(uninterrupted["losses"], rel=1e-5)
    assert resumed["calls"] == uninterrupted["calls"]  # the step counts (warm-up) carried over: 2 saved + 2 run


@pytest.mark.parametrize("zero", [0, 1])
def test_compressed_bytes_and_losses(runs, zero):
    plain, bf16, topk = runs[3 * zero: 3 * zero + 3]
    assert plain["bytes"] > 0 and plain["calls"] is None
    assert bf16["bytes"] <= 0.52 * plain["bytes"], (bf16["bytes"], plain["bytes"])
    assert topk["bytes"] <= 0.15 * plain["bytes"], (topk["bytes"], plain["bytes"])
    # compressed once per optimizer step: each bucket's compressor ran STEPS times, not STEPS * ACC
    for run in (bf16, topk):
        assert run["calls"] and set(run["calls"].values()) == {STEPS}, run["calls"]
    # bf16 rounding barely moves a 4-step run; every run trains (finite losses)
    assert all(math.isfinite(x) for r in (plain, bf16, topk) for x in r["losses"])
    assert bf16["losses"] == pytest.approx(plain["losses"], rel=1e-2)


# ---- per-module globs: one branch compressed, the other not ---------------------------------------------------
INT8_TEXT = {"text.*": "int8", "vision.*": None}


def _int8_bytes(n: int) -> int:
    chunks = math.ceil(n / 256)
    return chunks * 256 + 4 * chunks  # int8 values padded to whole chunks, a fp32 scale per chunk


@pytest.fixture(scope="module")
def branches(launch):
    return launch[1]


@pytest.mark.parametrize("zero", [0, 1])
def test_globs_compress_one_branch(branches, zero):
    for rank in branches:
        plain, glob, longer = rank[3 * zero: 3 * zero + 3]
        text, vision = plain["numel"]["text"], plain["numel"]["vision"]
        # one step: plain sends both branches in fp32; the glob run sends vision in fp32 and text as int8
        assert plain["bytes"] == 4 * (text + vision)
        assert glob["bytes"] == 4 * vision + _int8_bytes(text), (glob["bytes"], 4 * vision, _int8_bytes(text))
        assert longer["bytes"] == 3 * glob["bytes"]
        assert set(glob["calls"].values()) == {1} and set(longer["calls"].values()) == {3}
        assert len(glob["calls"]) == 1  # one compressed segment (zero 0) / bucket (zero 1): the text branch
        # after one step the uncompressed branch is bit-identical to the uncompressed run, the compressed one is not
        for name, value in plain["params"].items():
            if name.startswith("vision."):
                torch.testing.assert_close(glob["params"][name], value, rtol=0, atol=0, msg=name)
        assert any(not torch.equal(glob["params"][n], v) for n, v in plain["params"].items() if n.startswith("text."))
        assert all(math.isfinite(x) for x in longer["losses"])
    assert branches[0][3 * zero + 2]["calls"] == branches[1][3 * zero + 2]["calls"]


def test_a_glob_that_matches_no_parameter_is_refused(launch):
    for err in launch[2]:
        assert err.startswith("ParallelConfigError: `gradient_compression['txet.*']` matches no parameter of TwoBranches"), err
