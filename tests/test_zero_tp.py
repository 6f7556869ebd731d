"""ZeRO 2/3 (FSDP2 over mesh["dp"]) composed with tensor parallelism (DTensor over mesh["tp"]): dp=2 x tp=2.

Parity with one process (fp32), per-rank parameter bytes, DCP checkpoint resume, and loading across tp sizes.
"""

import pytest
import torch

from lightning_npu.launch import spawn
from lightning_npu.parallel.config import ParallelConfig
from tests._layouts import Layout, run_layout
from tests._zero_tp_workers import run_many

RTOL, ATOL = 1e-5, 1e-6  # see test_foundation_parity: a wrong reduction or shard moves params by ~lr = 3e-3


def zero_tp(stage: int, tp: int = 2) -> dict:
    return {"zero_stage": stage, "tensor_parallel_size": tp}


def assert_same_state(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].shape == b[k].shape, k
        torch.testing.assert_close(a[k], b[k], rtol=RTOL, atol=ATOL, msg=lambda m: f"{k}: {m}")


def assert_losses(got: list, ref: list) -> None:
    torch.testing.assert_close(torch.tensor(got), torch.tensor(ref), rtol=RTOL, atol=0)


@pytest.fixture(scope="module")
def reference():
    """One process, same seed and global batch (8), 5 steps."""
    return spawn(run_layout, 1, Layout("ref", 1, {"zero_stage": 0}, checks=(), clip=None))[0]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("zero_tp")
    tp2_dir, tp1_dir, z1_dir = root / "dp2_tp2_zero3", root / "dp4_tp1_zero3", root / "dp2_tp2_zero1"
    step3 = "epoch=0-step=3.ckpt"
    four = spawn(run_many, 4, [
        dict(strategy_kwargs=zero_tp(2), steps=5),
        dict(strategy_kwargs=zero_tp(3), steps=5),
        # checkpoints every 3 steps (epochs of 3 batches), then a new Trainer resumed from step 3
        dict(strategy_kwargs=zero_tp(3), steps=6, ckpt_dir=str(tp2_dir), limit_train_batches=3),
        dict(strategy_kwargs=zero_tp(3), steps=6, ckpt_in=str(tp2_dir / step3), limit_train_batches=3),
        # the other direction: saved at tp=1 (dp=4, zero 3), resumed at dp=2 x tp=2 x zero 3
        dict(strategy_kwargs=zero_tp(3, tp=1), steps=6, ckpt_dir=str(tp1_dir), limit_train_batches=3),
        dict(strategy_kwargs=zero_tp(3), steps=6, ckpt_in=str(tp1_dir / step3), limit_train_batches=3),
        # ZeRO 1 (DistributedOptimizer over dp, on plain tp shards) saves DCP too; resumed at dp2 x tp2 x zero 3
        dict(strategy_kwargs=zero_tp(1), steps=6, ckpt_dir=str(z1_dir), limit_train_batches=3),
        dict(strategy_kwargs=zero_tp(3), steps=6, ckpt_in=str(z1_dir / step3), limit_train_batches=3),
    ])
    # the dp2 x tp2 x zero3 checkpoint resumed at tp=1 x dp=2 (zero 3 and zero 1)
    two = spawn(run_many, 2, [
        dict(strategy_kwargs=zero_tp(3, tp=1), steps=6, ckpt_in=str(tp2_dir / step3), limit_train_batches=3),
        dict(strategy_kwargs=zero_tp(1, tp=1), steps=6, ckpt_in=str(tp2_dir / step3), limit_train_batches=3),
        # tp=2 x dp=1 with plain local tp shards (zero 1 is zero 0 at dp=1): DTensor views of the shards load in place
        dict(strategy_kwargs=zero_tp(1), steps=6, ckpt_in=str(tp2_dir / step3), limit_train_batches=3),
        # the dp2 x tp2 x zero1 checkpoint at tp=1 x dp=2 x zero 0 (fused q|k|v relaid, ZeRO-1 slices gathered)
        dict(strategy_kwargs=zero_tp(0, tp=1), steps=6, ckpt_in=str(z1_dir / step3), limit_train_batches=3),
    ])
    return {"four": four, "two": two, "tp2_ckpt": tp2_dir / step3, "z1_ckpt": z1_dir / step3}


@pytest.mark.slow
@pytest.mark.parametrize("stage", [2, 3])
def test_dp2_tp2_zero_matches_single_process(runs, reference, stage):
    ref = reference
    assert ref["logged"][-1] < ref["logged"][0]  # it trained
    for rank in runs["four"]:
        got = rank[stage - 2]
        assert got["mesh"] == (1, 2, 2) and got["fully_sharded"] and got["optimizer"] == "MixedPrecisionOptimizer"
        assert "model.transformer.h.0.attn.c_attn: qkv" in got["report"]
        # FSDP2 on top of TP: 2-D (dp, tp) DTensor parameters; replicated-over-tp norms are sharded over dp only
        assert got["placements"]["model.transformer.h.0.mlp.c_proj.weight"] == "(Shard(dim=0), Shard(dim=1))"
        assert got["placements"]["model.transformer.ln_f.weight"] == "(Shard(dim=0),)"
        assert_losses(got["logged"], ref["logged"])
        assert_same_state(got["state"], ref["state"])
        assert got["val_loss"] == pytest.approx(ref["val_loss"], rel=RTOL)


def _replicated_over_tp(name: str) -> bool:
    return ".ln_" in name or "wpe" in name


@pytest.mark.slow
@pytest.mark.parametrize("stage", [2, 3])
def test_per_rank_parameter_bytes_are_a_quarter(runs, reference, stage):
    """Between steps a rank holds 1/(dp*tp) of every tp-sharded parameter (both stages reshard after backward),
    and 1/dp of the norms and position embedding (replicated over tp, sharded over dp)."""
    full = {k: v.numel() * v.element_size() for k, v in reference["state"].items()}
    sharded_full = sum(b for k, b in full.items() if not _replicated_over_tp(k))
    assert sharded_full > 0.85 * sum(full.values())
    for rank in runs["four"]:
        per_param = rank[stage - 2]["param_bytes"]
        assert per_param.keys() == full.keys()
        sharded = sum(b for k, b in per_param.items() if not _replicated_over_tp(k))
        assert sharded == pytest.approx(sharded_full / 4, rel=0.05)
        replicated = sum(b for k, b in per_param.items() if _replicated_over_tp(k))
        assert replicated == pytest.approx(sum(b for k, b in full.items() if _replicated_over_tp(k)) / 2, rel=0.05)


@pytest.mark.slow
def test_resume_dp2_tp2_zero3(runs):
    full, resumed = runs["four"][0][2], runs["four"][0][3]
    assert runs["tp2_ckpt"].is_dir()  # a DCP directory: every rank wrote its (dp, tp) shards
    for rank in runs["four"]:
        resumed = rank[3]
        assert resumed["global_step"] == 6
        assert_losses(resumed["logged"], full["logged"][3:])
        assert_same_state(resumed["state"], full["state"])


@pytest.mark.slow
@pytest.mark.parametrize("index", [0, 1], ids=["tp1_dp2_zero3", "tp1_dp2_zero1"])
def test_dp2_tp2_zero3_checkpoint_loads_at_tp1(runs, index):
    """The fused q|k|v projections are stored rank-major for tp=2; loading at tp=1 restores their layout."""
    full = runs["four"][0][2]
    for rank in runs["two"]:
        got = rank[index]
        assert got["global_step"] == 6 and got["mesh"] == (1, 2, 1)
        assert_losses(got["logged"], full["logged"][3:])
        assert_same_state(got["state"], full["state"])


@pytest.mark.slow
def test_dp2_tp2_zero3_checkpoint_loads_at_tp2_zero1(runs):
    full = runs["four"][0][2]
    for rank in runs["two"]:
        got = rank[2]
        assert got["global_step"] == 6 and got["mesh"] == (1, 1, 2) and not got["fully_sharded"]
        assert_losses(got["logged"], full["logged"][3:])
        assert_same_state(got["state"], full["state"])


@pytest.mark.slow
def test_dp2_tp2_zero1_trains_saves_dcp_and_reshards(runs):
    """ZeRO-1 x TP trains as ZeRO-3 x TP does; its DCP checkpoint resumes as dp2 x tp2 x zero 3 and tp1 x zero 0."""
    z1 = runs["four"][0][6]
    assert z1["optimizer"] == "DistributedOptimizer"
    assert_losses(z1["logged"], runs["four"][0][2]["logged"])
    assert_same_state(z1["state"], runs["four"][0][2]["state"])
    assert runs["z1_ckpt"].is_dir()
    for rank in runs["four"]:
        got = rank[7]
        assert got["global_step"] == 6 and got["fully_sharded"]
        assert_losses(got["logged"], z1["logged"][3:])
        assert_same_state(got["state"], z1["state"])
    for rank in runs["two"]:
        got = rank[3]
        assert got["global_step"] == 6 and got["mesh"] == (1, 2, 1)
        assert_losses(got["logged"], z1["logged"][3:])
        assert_same_state(got["state"], z1["state"])


@pytest.mark.slow
def test_tp1_zero3_checkpoint_loads_at_dp2_tp2(runs):
    full = runs["four"][0][4]
    assert_losses(full["logged"], runs["four"][0][2]["logged"])  # dp4 x tp1 trains as dp2 x tp2 does
    for rank in runs["four"]:
        got = rank[5]
        assert got["global_step"] == 6 and got["mesh"] == (1, 2, 2)
        assert_losses(got["logged"], full["logged"][3:])
        assert_same_state(got["state"], full["state"])


def test_zero23_with_tp_accepted_also_with_pipeline():
    for stage in (2, 3):
        assert ParallelConfig(zero_stage=stage, tensor_parallel_size=2).tensor_parallel_size == 2
        # pp x tp x zero 2/3: tests/test_pipeline_tp_checkpoint.py
        assert ParallelConfig(zero_stage=stage, tensor_parallel_size=2, pipeline_parallel_size=2).zero_stage == stage
        # sequence parallelism composes too (tests/test_zero_sp.py)
        assert ParallelConfig(zero_stage=stage, tensor_parallel_size=2, sequence_parallel=True).sequence_parallel
