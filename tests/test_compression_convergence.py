"""What gradient compression costs in convergence: 300 AdamW steps of the example GPT at dp=2 (real processes, gloo).

Every arm trains the example GPT (`examples/gpt/config.yaml`'s model: 4 layers, 128 wide, AdamW lr 2e-3 with 20
warm-up steps, 8 sequences of 128 tokens per rank) from the same seed on the same unshuffled data (the example's
grammar corpus: the loss falls from 4.8 to 0.35 in 300 steps and flattens), in fp32 at zero 0 through the real
gradient path (DDP comm hook -> `reduce_bucket`). All arms run one after another in one 2-process launch (about 6
minutes), with two arms of `SMALL_GPT` (2 layers, 32 wide) for the error-feedback on/off check.

Compared number: the mean of the last 10 logged (dp-mean) train losses, each arm against the uncompressed arm.
Those are the same 10 batches in every arm; the runs are deterministic (same numbers every run on one machine).

Measured with torch 2.13 on CPU (uncompressed 0.3457): bf16 +1.4%, int8 -1.9%. With error feedback on the
gradients, as torch's PowerSGD and the top-k literature do it: topk 0.1 +93%, onebit (30 warm-up steps) +250%,
powersgd rank 1 +547% (measured on 2026-12-01; that arm is no longer re-run here: 70 s of the suite to re-confirm a
known miss, which the setup warning for powersgd with Adam states). AdamW divides each coordinate by its own gradient RMS, so a coordinate that arrives rarely
and in bursts (sparsified with error feedback) or with a sign-inflated magnitude moves less than the same gradient
sent dense. 1-bit Adam (Tang et al. 2021, `frozen_variance=True`: after a dense warm-up each rank's Adam *momentum*
is compressed with error feedback and the variance is frozen) closes the gap and overshoots it: topk 0.3247
(-6.1%), onebit 0.2920 (-15.5%); 150 warm-up steps: -6.7%, -14.8%. The frozen variance itself is what ends lower:
int8 under 1-bit Adam, a nearly lossless exchange, ends -8.8%. So every bound is one-sided (no worse than 3% above
the uncompressed run), the side that matters to a user; `test_one_bit_adam_no_worse_than_3_percent` checks topk and
onebit under 1-bit Adam. PowerSGD misses either
way (rank 4 under 1-bit Adam: +191%).

On `SMALL_GPT` (session 7's record, uncompressed 1.023): bf16 +0.23%, int8 +0.94%, topk +55%, onebit +68%,
powersgd +93%; 1-bit Adam topk -6.0%, onebit -5.7%; a 100-step dense warm-up alone (topk +10%) or a frozen variance
with compressed gradients (topk +9.5%) or compressing g / sqrt(v) does not close the gap. A cosine decay to 0.1x
(nanoGPT's) leaves that model far from converged at 300 steps (1.41) and 1-bit Adam ends 16-22% below it.
"""

import math
import statistics

import pytest

from lightning_npu.launch import spawn
from tests._convergence_workers import example_gpt, small_gpt, train_arms

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
}
# error feedback on vs off at a ratio where its effect on AdamW shows, on SMALL_GPT (measured: 1.177 vs 1.326, +12.7%)
FEEDBACK_ARMS = {
    "small_none": None,
    "topk30": {"mode": "topk", "ratio": 0.3},
    "topk30_no_ef": {"mode": "topk", "ratio": 0.3, "error_feedback": False},
}


@pytest.fixture(scope="module")
def runs():
    example, small = example_gpt(), small_gpt()
    arms = [dict(compression=c, steps=STEPS, model=example[0], data=example[1]) for c in ARMS.values()]
    arms += [dict(compression=c, steps=STEPS, model=small[0], data=small[1]) for c in FEEDBACK_ARMS.values()]
    out = dict(zip([*ARMS, *FEEDBACK_ARMS], spawn(train_arms, 2, arms)[0]))
    for name, run in out.items():  # shown with `pytest -s` (and kept for the record in the docs' numbers)
        base = statistics.fmean(out["small_none" if name in FEEDBACK_ARMS else "none"]["losses"][-TAIL:])
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
    assert first > 4.5 and last < first / 8, (first, last)  # measured 4.79 -> 0.346 (x13.8)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["bf16", "int8"])
def test_compressed_ends_no_worse_than_3_percent(runs, mode):
    base, got = tail(runs["none"]), tail(runs[mode])
    # compression was on: fewer gradient bytes than the uncompressed run (onebit's fp32 warm-up included)
    assert runs[mode]["bytes"] < 0.55 * runs["none"]["bytes"], (runs[mode]["bytes"], runs["none"]["bytes"])
    # one-sided, as for 1-bit Adam: the uncompressed run itself ends 0.3457 on an AVX2 CPU and 0.3690 on an AVX512
    # one (fp32 kernels' rounding, amplified over 300 AdamW steps), where bf16 and int8 end 6.5% and 9.4% below it
    assert got <= 1.03 * base, f"{mode}: last-{TAIL} mean {got:.4f} vs uncompressed {base:.4f}"


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["topk", "onebit"])
def test_one_bit_adam_no_worse_than_3_percent(runs, mode):
    """1-bit Adam (`frozen_variance=True`) costs no convergence: at most 3% above the uncompressed run (measured
    -6.1% and -15.5%), with onebit's payload at most 0.05 of fp32 after the warm-up."""
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
    assert runs["topk30"]["bytes"] == runs["topk30_no_ef"]["bytes"] < 0.65 * runs["small_none"]["bytes"]
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
