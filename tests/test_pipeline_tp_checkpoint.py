"""Pipeline x tensor parallelism: DCP checkpoints that reshard across pp and tp sizes, and ZeRO 2/3 (FSDP2 over dp on
tensor-parallel pipeline stages).

* pp=2 x tp=2 (zero 1 at dp=1: plain local tp shards, saved as DTensor views) resumes under the same layout,
  pp=1 x tp=2 and pp=2 x tp=1; the fused q|k|v projections are stored rank-major for tp=2, so the tp=1 resume
  goes through the relayout step of `load_directory` with each stage reading only its own layers.
* pp=2 x dp=2 x tp=2 (8 processes) with ZeRO 3 and ZeRO 1 (`DistributedOptimizer`, 2-D masters) matches one
  process (ZeRO 2: tests/test_layouts.py); its ZeRO 3 and ZeRO 1 checkpoints resume under smaller layouts.

Every check is at fp32 tolerances (rtol 1e-5, atol 1e-6): a wrong or missing reduction, or a misplaced slice of a
fused projection, moves parameters by ~lr = 3e-3. Real processes on CPU/gloo; several Trainers per spawn.
"""

import pytest
import torch

from lightning_npu.launch import spawn
from lightning_npu.parallel.checkpoint.full_state import unfuse_full_tensors
from lightning_npu.parallel.checkpoint.sharded import consolidate_model_state
from lightning_npu.parallel.config import ParallelConfig
from tests._pp_tp_workers import run_many
from tests.test_pipeline_zero import STEP3, assert_losses, assert_same, merged

PP2 = {"pipeline_parallel_size": 2, "micro_batches": 2}
PP2_TP2 = {**PP2, "tensor_parallel_size": 2}
C_ATTN = "model.transformer.h.0.attn.c_attn.weight"  # a fused q|k|v projection (stage 0 under pp=2)


def ckpt(root, name: str):
    path = root / name / STEP3
    assert path.is_dir(), sorted(p.name for p in (root / name).iterdir())
    return path


def saved_state(path) -> tuple[dict, dict]:
    """The checkpoint's full model tensors in the unsharded model's layout (consolidation un-fuses the projections
    stored rank-major for the saving tp size, per the meta's ``fused`` map), and its layout entry."""
    tensors, meta = consolidate_model_state(path)
    return tensors, meta["lightning_npu"]


def raw_tensor(path, name: str) -> torch.Tensor:
    """One model tensor exactly as DCP stored it (no un-fusing)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader

    from lightning_npu.parallel.checkpoint.safe_load import checkpoint_tensor_metadata
    from lightning_npu.parallel.checkpoint.sharded import MODEL_KEY

    key = f"{MODEL_KEY}.{name}"
    md = checkpoint_tensor_metadata(path)[key]
    out = {key: torch.empty(tuple(md.size), dtype=md.properties.dtype)}
    dcp.load(out, storage_reader=FileSystemReader(str(path)), no_dist=True)
    return out[key]


def check_resume(resumed: list, uninterrupted: list, saved: dict) -> None:
    """Every rank restored exactly the saved values of its stage's parameters (all ranks together: every one);
    the steps after the resume log the uninterrupted run's losses and end at its parameters."""
    for rank in resumed:
        assert rank["restored"]["step"] == 3 and rank["global_step"] == 6
        for k, v in rank["restored"]["params"].items():
            torch.testing.assert_close(v, saved[k], rtol=0, atol=0, msg=lambda m: f"restored {k}: {m}")
        assert_losses(rank["logged"], uninterrupted[0]["logged"][3:])
    assert merged(resumed, restored=True).keys() == saved.keys()
    assert_same(merged(resumed), merged(uninterrupted))


# ---- runs ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("pp_tp")


@pytest.fixture(scope="module")
def single(root):
    """One process, no pipeline, no tp: the reference (6 steps, epochs of 3 batches as the checkpointing runs)."""
    return spawn(run_many, 1, [dict(steps=6, strategy_kwargs={"zero_stage": 0}, validate=True)])[0][0]


@pytest.fixture(scope="module")
def eight(root):
    """pp=2 x dp=2 x tp=2: ZeRO 3 (saves, validates after fit), ZeRO 1 (DistributedOptimizer, saves). (ZeRO 2:
    the layout table, tests/test_layouts.py.)"""
    ranks = spawn(run_many, 8, [
        dict(steps=6, strategy_kwargs={**PP2_TP2, "zero_stage": 3}, ckpt_dir=str(root / "pp2dp2tp2_zero3"),
             validate=True),
        dict(steps=6, strategy_kwargs={**PP2_TP2, "zero_stage": 1}, ckpt_dir=str(root / "pp2dp2tp2_zero1")),
    ])
    return {"zero3": [r[0] for r in ranks], "zero1": [r[1] for r in ranks]}


@pytest.fixture(scope="module")
def four(root, eight):
    """pp=2 x tp=2 x dp=1 ZeRO 1 saves and resumes in place; the 8-process checkpoints resume under 4 processes."""
    z3, z1 = str(ckpt(root, "pp2dp2tp2_zero3")), str(ckpt(root, "pp2dp2tp2_zero1"))
    ranks = spawn(run_many, 4, [
        dict(steps=6, strategy_kwargs={**PP2_TP2, "zero_stage": 1}, ckpt_dir=str(root / "pp2tp2_zero1")),
        dict(steps=6, strategy_kwargs={**PP2_TP2, "zero_stage": 1}, ckpt_in=str(root / "pp2tp2_zero1" / STEP3)),
        dict(steps=6, strategy_kwargs={"tensor_parallel_size": 2, "zero_stage": 3}, ckpt_in=z3),
        dict(steps=6, strategy_kwargs={**PP2_TP2, "zero_stage": 1}, ckpt_in=z3),
        dict(steps=6, strategy_kwargs={**PP2, "zero_stage": 1}, ckpt_in=z1),
        # bf16 compute with sequence parallelism: the SP norms are fp32 FSDP units on each stage
        dict(steps=3, strategy_kwargs={**PP2_TP2, "zero_stage": 3, "sequence_parallel": True},
             precision="bf16-mixed"),
    ])
    names = ["save", "same", "z3_to_pp1_tp2_dp2_zero3", "z3_to_pp2_tp2_zero1", "z1_to_pp2_tp1_dp2_zero1", "sp_bf16"]
    return {name: [r[i] for r in ranks] for i, name in enumerate(names)}


@pytest.fixture(scope="module")
def two(root, four):
    """The pp=2 x tp=2 ZeRO-1 checkpoint under pp=1 x tp=2 and under pp=2 x tp=1."""
    path = str(ckpt(root, "pp2tp2_zero1"))
    ranks = spawn(run_many, 2, [
        dict(steps=6, strategy_kwargs={"tensor_parallel_size": 2, "zero_stage": 1}, ckpt_in=path),
        dict(steps=6, strategy_kwargs={**PP2, "zero_stage": 1}, ckpt_in=path),
    ])
    return {"pp1_tp2": [r[0] for r in ranks], "pp2_tp1": [r[1] for r in ranks]}


# ---- pp x tp checkpoints (zero 0/1) ---------------------------------------------------------------------------
@pytest.mark.slow
def test_pp2_tp2_trains_as_one_process_and_saves_rank_major_qkv(root, single, four):
    saver = four["save"]
    assert [r["mesh"] for r in saver] == [(2, 1, 2)] * 4 and [r["stages"] for r in saver] == [[0], [0], [1], [1]]
    assert not any(r["fully_sharded"] for r in saver) and saver[0]["optimizer"] == "MixedPrecisionOptimizer"
    for rank in saver:
        assert_losses(rank["logged"], single["logged"])
    assert_same(merged(saver), single["state"])
    saved, layout = saved_state(ckpt(root, "pp2tp2_zero1"))
    assert (layout["pipeline_parallel_size"], layout["tensor_parallel_size"], layout["zero_stage"]) == (2, 2, 1)
    # every stage's fused projections are recorded (tp is applied to the whole model before the split)
    assert layout["fused"] == saver[0]["fused"]
    assert sorted(layout["fused"]) == [f"model.transformer.h.{i}.attn.c_attn.weight" for i in range(4)]
    raw = raw_tensor(ckpt(root, "pp2tp2_zero1"), C_ATTN)
    assert not torch.equal(raw, saved[C_ATTN])  # stored rank-major: q|k|v of tp rank 0, then of rank 1
    torch.testing.assert_close(unfuse_full_tensors({C_ATTN: raw}, layout["fused"])[C_ATTN], saved[C_ATTN], rtol=0, atol=0)


@pytest.mark.slow
@pytest.mark.parametrize("target", ["same", "pp1_tp2", "pp2_tp1"])
def test_pp2_tp2_checkpoint_resumes(root, four, two, target):
    saved, _ = saved_state(ckpt(root, "pp2tp2_zero1"))
    resumed = four["same"] if target == "same" else two[target]
    expected_mesh = {"same": (2, 1, 2), "pp1_tp2": (1, 1, 2), "pp2_tp1": (2, 1, 1)}[target]
    assert all(r["mesh"] == expected_mesh for r in resumed)
    if target == "pp2_tp1":  # each stage restored only its own layers, through the tp-size relayout
        assert resumed[0]["restored"]["params"].keys().isdisjoint(resumed[1]["restored"]["params"].keys())
        assert C_ATTN in resumed[0]["restored"]["params"]
    check_resume(resumed, four["save"], saved)


# ---- ZeRO 2/3 x pp x tp -----------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("run", ["zero3", "zero1"])
def test_pp2_dp2_tp2_matches_single_process(single, eight, run):
    ranks = eight[run]
    assert [r["mesh"] for r in ranks] == [(2, 2, 2)] * 8
    assert [r["stages"] for r in ranks] == [[0]] * 4 + [[1]] * 4
    if run == "zero1":
        assert ranks[0]["optimizer"] == "DistributedOptimizer" and not ranks[0]["fully_sharded"]
    else:  # FSDP2 over dp on tensor-parallel stages: 2-D (dp, tp) parameters; replicated-over-tp ones dp-sharded
        assert all(r["fully_sharded"] and r["optimizer"] == "MixedPrecisionOptimizer" for r in ranks)
        assert ranks[0]["placements"]["model.transformer.h.0.attn.c_proj.weight"] == "(Shard(dim=0), Shard(dim=1))"
        assert ranks[0]["placements"]["model.transformer.h.0.ln_1.weight"] == "(Shard(dim=0),)"
        assert ranks[-1]["placements"]["model.transformer.ln_f.weight"] == "(Shard(dim=0),)"
    for rank in ranks:
        assert_losses(rank["logged"], single["logged"])
        assert rank["global_step"] == 6
        if rank["val_loss"] is not None:  # the eval schedule on FSDP x TP stages
            assert rank["val_loss"] == pytest.approx(single["val_loss"], rel=1e-5)
    assert single["logged"][-1] < single["logged"][0]
    assert_same(merged(ranks), single["state"])


@pytest.mark.slow
@pytest.mark.parametrize("target", ["z3_to_pp1_tp2_dp2_zero3", "z3_to_pp2_tp2_zero1", "z1_to_pp2_tp1_dp2_zero1"])
def test_pp2_dp2_tp2_checkpoint_resumes_on_four_ranks(root, eight, four, target):
    source = "zero3" if target.startswith("z3") else "zero1"
    saved, layout = saved_state(ckpt(root, f"pp2dp2tp2_{source}"))
    assert (layout["pipeline_parallel_size"], layout["data_parallel_size"], layout["tensor_parallel_size"]) == (2, 2, 2)
    resumed = four[target]
    expected = {"z3_to_pp1_tp2_dp2_zero3": ((1, 2, 2), True), "z3_to_pp2_tp2_zero1": ((2, 1, 2), False),
                "z1_to_pp2_tp1_dp2_zero1": ((2, 2, 1), False)}[target]
    assert all((r["mesh"], r["fully_sharded"]) == expected for r in resumed)
    check_resume(resumed, eight[source], saved)


@pytest.mark.slow
def test_pp2_tp2_zero3_sequence_parallel_bf16_keeps_norms_fp32(single, four):
    """bf16 gathering on tensor-parallel pipeline stages: every sequence-parallel norm (ln_1, ln_2 of the stage's two
    blocks; ln_f on the last stage) is its own FSDP2 unit gathered in fp32, so the tp all-reduce of its partial
    gradients is fp32; the training is the fp32 one up to bf16 rounding."""
    for rank in four["sp_bf16"]:
        assert rank["fully_sharded"] and rank["mesh"] == (2, 1, 2)
        last = rank["stages"] == [1]
        assert rank["fsdp_units"].count("FSDPLayerNorm") == 4 + last
        assert rank["norm_weight_dtypes"] == ["torch.float32"]
        torch.testing.assert_close(torch.tensor(rank["logged"]), torch.tensor(single["logged"][:3]), rtol=2e-3, atol=0)


def test_zero23_with_pp_and_tp_accepted():
    for stage in (2, 3):
        cfg = ParallelConfig(zero_stage=stage, pipeline_parallel_size=2, tensor_parallel_size=2)
        assert (cfg.zero_stage, cfg.pipeline_parallel_size, cfg.tensor_parallel_size) == (stage, 2, 2)
