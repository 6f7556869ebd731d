"""Expert parallelism (`expert_parallel_size`): bad layouts refused at `Trainer(...)`, a checkpoint saved under one ep
size resumed exactly under another, a dense model refused at setup, and ep composed with ZeRO-3, tp and pp on 4
processes against one process. ep=2 at dp=2 against one process is in tests/test_model_zoo.py (the "ep2" layout)."""

import pytest

from lightning_npu import NPUHybridStrategy
from lightning_npu.launch import spawn
from lightning_npu.parallel.config import ParallelConfig
from lightning_npu.parallel.errors import ParallelConfigError
from tests._expert_parallel_workers import resume_across_ep_sizes, run_layouts
from tests._model_zoo_workers import Case, run_zoo
from tests.test_model_zoo import LOSS_RTOL, MOE, STATE_ATOL, compare


@pytest.mark.parametrize("kwargs, message", [
    ({"expert_parallel_size": 2}, r"`expert_parallel_size=2` with `zero_stage=1`: .* set zero_stage=0"),
    ({"expert_parallel_size": 0, "zero_stage": 0}, r"expert_parallel_size"),
])
def test_bad_expert_layouts_are_refused(kwargs, message):
    with pytest.raises(ParallelConfigError, match=message):
        NPUHybridStrategy(**kwargs)


def test_ep_must_divide_dp():
    with pytest.raises(ParallelConfigError, match=r"`expert_parallel_size=4` does not divide the data-parallel size 2"):
        ParallelConfig(expert_parallel_size=4, zero_stage=0).resolve(2)


def test_resume_across_expert_parallel_sizes(tmp_path):
    out = spawn(resume_across_ep_sizes, 2, str(tmp_path))[0]
    whole = out["whole"]
    for form in ("ckpt", "dir"):
        assert out[f"ep2 {form}"] == pytest.approx(whole[:2], rel=1e-5)
        assert out[f"ep1 from {form}"] == pytest.approx(whole[2:], rel=1e-5), form
        assert out[f"ep2 from {form}"] == pytest.approx(whole[2:], rel=1e-5), form
    assert out["ep2 zero3 dir"] == pytest.approx(whole[:2], rel=1e-5)
    assert out["ep1 from zero3 dir"] == pytest.approx(whole[2:], rel=1e-5)
    assert "`expert_parallel_size=2` needs a mixture-of-experts model" in out["dense model"]


# 4 processes: (strategy, models). ZeRO-3 at dp=4 shards each rank's experts over the 2 ranks that hold them (edp=2);
# tp splits every expert inside its ep shard; pp keeps each stage's experts (DeepSeek-V3's first, dense layer on
# stage 0), also under ZeRO-3 (the stage's FSDP2 units around the experts' own)
COMPOSED = {
    "ep2 zero3 dp4": ({"expert_parallel_size": 2, "zero_stage": 3}, MOE),
    "ep2 pp2": ({"expert_parallel_size": 2, "zero_stage": 0, "pipeline_parallel_size": 2}, MOE),
    "ep2 pp2 zero3": ({"expert_parallel_size": 2, "zero_stage": 3, "pipeline_parallel_size": 2}, ["qwen3-moe"]),
    "ep2 tp2 zero3": ({"expert_parallel_size": 2, "zero_stage": 3, "tensor_parallel_size": 2}, ["mixtral"]),
    "ep2 tp2": ({"expert_parallel_size": 2, "zero_stage": 0, "tensor_parallel_size": 2}, ["qwen3-moe"]),
}


def test_expert_parallelism_composes_with_zero3_tp_and_pp():
    reference = spawn(run_zoo, 1, {}, {m: Case(m) for m in MOE})[0]
    got = spawn(run_layouts, 4, COMPOSED)[0]
    for layout, (_, models) in COMPOSED.items():
        for name in models:
            run = got[layout][name]
            assert "error" not in run, f"{layout} {name}: {run.get('error')}"
            diff = compare(run, reference[name])
            assert diff["loss"] <= LOSS_RTOL and diff["state"] <= STATE_ATOL, (layout, name, diff)
    # rank 0 holds half of the experts under ep=2, a quarter with tp=2 inside (ZeRO-3 at dp=4: half again over edp,
    # Mixtral's 1 expert per rank then on one of the 2 edp ranks only)
    whole = {m: sum(v.numel() for k, v in reference[m]["state"].items() if ".experts." in k) for m in MOE}
    assert got["ep2 zero3 dp4"]["qwen3-moe"]["local_experts"] == whole["qwen3-moe"] // 4
    assert got["ep2 tp2 zero3"]["mixtral"]["local_experts"] == whole["mixtral"] // 4
    assert got["ep2 tp2"]["qwen3-moe"]["local_experts"] == whole["qwen3-moe"] // 4
    assert got["ep2 pp2"]["mixtral"]["local_experts"] == whole["mixtral"] // 4  # stage 0: 1 of 2 layers, half of it
    assert got["ep2 pp2 zero3"]["qwen3-moe"]["local_experts"] == whole["qwen3-moe"] // 4
