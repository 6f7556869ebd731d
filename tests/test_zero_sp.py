"""ZeRO 2/3 (FSDP2 over mesh["dp"]) with sequence-parallel tensor parallelism: dp=2 x tp=2, sequence_parallel=True.

DCP checkpoints resumed under other layouts, and the fp32 tp reduction of the sequence-parallel norms' partial
gradients under bf16 compute. (fp32 parity with one process: the layout table, tests/test_layouts.py.)
"""

import pytest
import torch

from lightning_npu.launch import spawn
from lightning_npu.parallel.config import ParallelConfig, ParallelConfigError
from tests._zero_sp_workers import run_many, sp_norm_grad_check

RTOL, ATOL = 1e-5, 1e-6  # see test_foundation_parity: a wrong reduction or shard moves params by ~lr = 3e-3
STEP3 = "epoch=0-step=3.ckpt"


def layout(stage: int, tp: int = 2, sp: bool = True) -> dict:
    return {"zero_stage": stage, "tensor_parallel_size": tp, "sequence_parallel": sp}


def assert_same_state(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].shape == b[k].shape, k
        torch.testing.assert_close(a[k], b[k], rtol=RTOL, atol=ATOL, msg=lambda m: f"{k}: {m}")


def assert_losses(got: list, ref: list, rtol: float = RTOL) -> None:
    torch.testing.assert_close(torch.tensor(got), torch.tensor(ref), rtol=rtol, atol=0)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    ckpt_dir = tmp_path_factory.mktemp("zero_sp") / "dp2_tp2_sp_zero3"
    resume = dict(steps=6, ckpt_in=str(ckpt_dir / STEP3), limit_train_batches=3)
    four = spawn(run_many, 4, [
        # checkpoints every 3 steps (epochs of 3 batches), then new Trainers resume from step 3
        dict(strategy_kwargs=layout(3), steps=6, ckpt_dir=str(ckpt_dir), limit_train_batches=3),
        dict(strategy_kwargs=layout(2, sp=False), **resume),
        dict(strategy_kwargs=layout(2), **resume),
        # bf16 compute, with and without sequence parallelism
        dict(strategy_kwargs=layout(3), steps=3, precision="bf16-mixed"),
        dict(strategy_kwargs=layout(3, sp=False), steps=3, precision="bf16-mixed"),
    ])
    two = spawn(run_many, 2, [dict(strategy_kwargs=layout(3, tp=1, sp=False), **resume)])
    return {"four": four, "two": two, "ckpt": ckpt_dir / STEP3}


@pytest.mark.slow
@pytest.mark.parametrize("index", [1, 2], ids=["tp2_zero2_no_sp", "tp2_zero2_sp"])
def test_sequence_parallel_zero3_checkpoint_resumes_under_other_layouts(runs, index):
    assert runs["ckpt"].is_dir()  # a DCP directory: every rank wrote its (dp, tp) shards
    full = runs["four"][0][0]
    for rank in runs["four"]:
        got = rank[index]
        assert got["global_step"] == 6 and got["mesh"] == (1, 2, 2)
        assert (got["report"] is not None and "sequence parallel" in got["report"]) == (index == 2)
        assert_losses(got["logged"], full["logged"][3:])  # the next step's loss is the uninterrupted run's
        assert_same_state(got["state"], full["state"])


@pytest.mark.slow
def test_sequence_parallel_zero3_checkpoint_resumes_at_tp1(runs):
    full = runs["four"][0][0]
    for rank in runs["two"]:
        got = rank[0]
        assert got["global_step"] == 6 and got["mesh"] == (1, 2, 1) and got["report"] is None
        assert_losses(got["logged"], full["logged"][3:])
        assert_same_state(got["state"], full["state"])


@pytest.mark.slow
def test_sequence_parallel_zero3_bf16_gathers_norms_in_fp32(runs):
    """bf16 compute: the sequence-parallel norms are their own FSDP2 units gathered in fp32, so the tp
    all-reduce of their partial gradients is fp32; every other parameter is gathered in bf16."""
    for rank in runs["four"]:
        sp, plain = rank[3], rank[4]
        assert sp["fsdp_units"].count("FSDPLayerNorm") == 5  # ln_1, ln_2 of two blocks and ln_f
        assert sp["norm_weight_dtypes"] == ["torch.float32"]
        assert "FSDPLayerNorm" not in plain["fsdp_units"] and plain["norm_weight_dtypes"] == ["torch.bfloat16"]
        assert not [w for w in sp["warnings"] if "returned a view tensor" in w]
        assert_losses(sp["logged"], plain["logged"], rtol=2e-3)  # the same training up to bf16 rounding


@pytest.mark.slow
def test_sequence_parallel_norm_gradient_is_reduced_in_fp32():
    """A sequence-parallel LayerNorm under FSDP2 with bf16 gathering: output and the tp- and dp-reduced weight
    gradient equal an fp32 single-process reference (a bf16 reduction misses by ~1e-2)."""
    for rank in spawn(sp_norm_grad_check, 4, [2, 3]):
        for stage, got in rank.items():
            assert got["units"] == ["FSDPLayerNorm"] and got["grad_dtype"] == "torch.float32", stage
            assert got["grad_placements"] == "(Shard(dim=0), Replicate())"
            torch.testing.assert_close(got["out"], got["ref_out"], rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(got["grad"], got["ref_grad"], rtol=1e-5, atol=1e-5)


def test_zero23_with_sequence_parallel_accepted_clear_errors_remain():
    for stage in (2, 3):
        cfg = ParallelConfig(zero_stage=stage, tensor_parallel_size=2, sequence_parallel=True)
        assert cfg.sequence_parallel and cfg.zero_stage == stage
        with pytest.raises(ParallelConfigError, match=r"`sequence_parallel=True` .* needs `tensor_parallel_size>1`"):
            ParallelConfig(zero_stage=stage, sequence_parallel=True)
        # with pipeline parallelism too (tests/test_pipeline_tp_checkpoint.py: fp32 norm units under bf16)
        assert ParallelConfig(zero_stage=stage, tensor_parallel_size=2, pipeline_parallel_size=2,
                              sequence_parallel=True).sequence_parallel
