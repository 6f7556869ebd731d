"""What gradient compression costs in convergence: 300 AdamW steps of the example GPT at dp=2 (real processes, gloo).

Every arm trains the same small GPT (`SMALL_GPT`, AdamW lr 3e-3 with 10 warm-up steps, as the example trains) from the
same seed on the same unshuffled data (the example's built-in grammar corpus: structured, so the loss falls from
ln 256 = 5.55 to about 1.0 in 300 steps), through the real zero-0 gradient path (DDP comm hook -> `reduce_bucket`).
All arms run one after another in one 2-process launch.

Compared number: the mean of the last 10 logged (dp-mean) train losses, each arm against the uncompressed arm.
Those are the same 10 batches in every arm; the runs are deterministic (same numbers every run on one machine).

Measured with torch 2.13 on CPU (last-10 mean; uncompressed 1.023, first 10 steps 5.5): bf16 +0.23%, int8 +0.94%,
topk 0.1 +54.6%, onebit (30 warm-up steps) +68%, powersgd rank 1 +93% (+161% when it factorised the whole bucket
as one matrix; rank 4: +40%); topk 0.3 with error feedback +15.0%, without
+30%. topk, onebit and powersgd miss 3%: strict xfails below, so fixing them turns the test red until the
marks go. A likely cause: AdamW divides each coordinate by its own gradient RMS, so a coordinate that arrives rarely
and in bursts (sparsified with error feedback) or with a sign-inflated magnitude moves less than the same gradient
sent dense. AdamW rather than SGD: with
SGD+momentum (lr 0.15-0.3) this model sits on a plateau whose escape is chaotic, and bf16 rounding alone moved the
final loss by up to 3.5%, too much noise for a 3% bound.

What was tried (last-10 mean vs uncompressed, same runs): a 100-step dense warm-up alone: topk +10%, onebit +53%,
powersgd +74%; plus Adam's variance frozen after it, gradients still compressed: topk +9.5%, onebit +37%, powersgd
+75%; plus preconditioning (compressing g / sqrt(v)): no better. So the variance is not the whole cause: with a
linear (frozen-variance) update, error feedback on noisy gradients still lags. What closes the gap is 1-bit Adam
(Tang et al. 2021) in full: after the dense warm-up each rank's Adam *momentum* is compressed with error feedback and
the variance is frozen (`frozen_variance=True`): topk 0.962 (-6.0%), onebit 0.965 (-5.7%), both below the uncompressed
run by more than 3%, which is why their arms still xfail the two-sided bound: the frozen variance (larger than the
live one late in training) acts as a learning-rate decay (dense AdamW with the variance frozen at step 100 alone ends
-4.3%; frozen at step 130: +0.4%, and topk/onebit -3.3%/-3.7%; frozen at step 30 or 60 it diverges (nan, +80%)).
`test_one_bit_adam_no_worse_than_3_percent` checks the side that matters to a user. PowerSGD rank 1 stays +81% even
with 1-bit Adam (rank 4 +26%, rank 8 +6.6%: a rank-r factor of this model's 32-wide matrices carries too little).
"""

import math
import statistics

import pytest

from lightning_npu.launch import spawn
from tests._convergence_workers import train_arms

STEPS = 300
TAIL = 10
ARMS = {
    "none": None,
    "bf16": "bf16",
    "int8": "int8",
    # 1-bit Adam, as docs/communication.md recommends for Adam/AdamW (a 100-step dense warm-up, then the compressed
    # momentum with a frozen variance)
    "topk": {"mode": "topk", "ratio": 0.1, "warmup_steps": 100, "frozen_variance": True},
    "onebit": {"mode": "onebit", "warmup_steps": 100, "frozen_variance": True},
    "powersgd": {"mode": "powersgd", "rank": 1},
    # error feedback on vs off at a ratio where its effect on AdamW shows (measured: 1.177 vs 1.326, +12.7%)
    "topk30": {"mode": "topk", "ratio": 0.3},
    "topk30_no_ef": {"mode": "topk", "ratio": 0.3, "error_feedback": False},
}
_MISSES = "measured {}: misses 3% under AdamW (see the module docstring); a strict xfail until compression is fixed"
_BELOW = ("measured {}: 1-bit Adam ends more than 3% *below* the uncompressed run (its frozen variance acts as a "
          "learning-rate decay; see the module docstring); a strict xfail of the two-sided bound")


@pytest.fixture(scope="module")
def runs():
    arms = [dict(compression=c, steps=STEPS) for c in ARMS.values()]
    out = dict(zip(ARMS, spawn(train_arms, 2, arms)[0]))
    base = statistics.fmean(out["none"]["losses"][-TAIL:])
    for name, run in out.items():  # shown with `pytest -s` (and kept for the record in the docs' numbers)
        last = statistics.fmean(run["losses"][-TAIL:])
        print(f"{name:14s} last-{TAIL} mean {last:.4f} ({last / base - 1:+.2%})  gradient bytes {run['bytes']:,}")
    return out


def tail(run):
    assert len(run["losses"]) == STEPS
    return statistics.fmean(run["losses"][-TAIL:])


@pytest.mark.slow
def test_uncompressed_loss_falls(runs):
    losses = runs["none"]["losses"]
    assert all(math.isfinite(x) for x in losses)
    first, last = statistics.fmean(losses[:TAIL]), tail(runs["none"])
    assert first > 5.0 and last < first / 4, (first, last)  # measured 5.5 -> 1.02 (x5.4)


@pytest.mark.slow
@pytest.mark.parametrize("mode", [
    "bf16", "int8",
    pytest.param("topk", marks=pytest.mark.xfail(strict=True, reason=_BELOW.format("-6.0%"))),
    pytest.param("onebit", marks=pytest.mark.xfail(strict=True, reason=_BELOW.format("-5.7%"))),
    pytest.param("powersgd", marks=pytest.mark.xfail(strict=True, reason=_MISSES.format("+93%"))),
])
def test_compressed_ends_within_3_percent(runs, mode):
    base, got = tail(runs["none"]), tail(runs[mode])
    # compression was on: fewer gradient bytes than the uncompressed run (onebit's fp32 warm-up included)
    assert runs[mode]["bytes"] < 0.55 * runs["none"]["bytes"], (runs[mode]["bytes"], runs["none"]["bytes"])
    assert abs(got / base - 1) <= 0.03, f"{mode}: last-{TAIL} mean {got:.4f} vs uncompressed {base:.4f}"


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["topk", "onebit"])
def test_one_bit_adam_no_worse_than_3_percent(runs, mode):
    """1-bit Adam (`frozen_variance=True`) costs no convergence: at most 3% above the uncompressed run (measured
    -6.0% and -5.7%), with onebit's payload at most 0.05 of fp32 after the warm-up."""
    base, got = tail(runs["none"]), tail(runs[mode])
    assert runs[mode]["bytes"] < 0.55 * runs["none"]["bytes"], (runs[mode]["bytes"], runs["none"]["bytes"])
    if mode == "onebit":  # the 100 dense warm-up steps at fp32, then the 1-bit momentum
        per_step = runs["none"]["bytes"] / STEPS
        after = (runs[mode]["bytes"] - 100 * per_step) / (STEPS - 100)
        assert after <= 0.05 * per_step, after / per_step
    assert got <= 1.03 * base, f"{mode}: last-{TAIL} mean {got:.4f} vs uncompressed {base:.4f}"


@pytest.mark.slow
def test_topk_without_error_feedback_is_worse(runs):
    ef, no_ef = tail(runs["topk30"]), tail(runs["topk30_no_ef"])
    # same bytes: only the residual differs (a no-op compressor would make the two identical)
    assert runs["topk30"]["bytes"] == runs["topk30_no_ef"]["bytes"] < 0.65 * runs["none"]["bytes"]
    # measured 1.326 vs 1.177 (+12.7%); asserted with under half of that as slack
    assert no_ef > 1.05 * ef, (no_ef, ef)


def test_communication_benchmark_quick(tmp_path):
    """`benchmarks/communication.py --quick` (dp=2, 12 steps per arm; 15 s idle, 19-28 s at load 5-11)."""
    from benchmarks.communication import main

    out = main(["--quick", "--out", str(tmp_path / "c.json"), "--plot", str(tmp_path / "c.png")])
    rows = out["results"]["dp2"]
    assert (tmp_path / "c.json").exists() and (tmp_path / "c.png").stat().st_size > 0
    assert rows["compute_only"]["payload_bytes"] == 0 < rows["none"]["payload_bytes"]
    ratio = {m: rows[m]["payload_ratio_vs_none"] for m in ("bf16", "int8", "topk", "onebit", "powersgd")}
    assert ratio["bf16"] == 0.5  # measured: 0.5, 0.254, 0.200, 0.035, 0.023 (the per-rank payload vs fp32)
    assert ratio["int8"] < 0.26 and ratio["topk"] < 0.21 and ratio["onebit"] < 0.04 and ratio["powersgd"] < 0.03, ratio
    assert all(r["step_ms"] > 0 and math.isfinite(r["exposed_comm_ms"]) for r in rows.values())
