"""Expert parallelism (`expert_parallel_size`): bad layouts refused at `Trainer(...)`, a checkpoint saved under one ep
size (ZeRO 0/1/3) resumed exactly under another, a dense model refused at setup, ep=2 x ZeRO-1 at dp=2 against one
process (in the same 2-process launch), and ep composed with ZeRO-1, ZeRO-3, tp and pp on 4 processes against one
process. ep=2 at dp=2, ZeRO-0, against one process is in tests/test_model_zoo.py (the "ep2" layout)."""

import pytest

from lightning_npu import NPUHybridStrategy
from lightning_npu.launch import spawn
from lightning_npu.parallel.config import ParallelConfig
from lightning_npu.parallel.errors import ParallelConfigError
from tests._expert_parallel_workers import resume_across_ep_sizes, run_layouts
from tests._model_zoo_workers import Case, run_zoo
from tests.test_model_zoo import LOSS_RTOL, MOE, STATE_ATOL, compare


def test_bad_expert_layouts_are_refused():
    with pytest.raises(ParallelConfigError, match=r"expert_parallel_size"):
        NPUHybridStrategy(expert_parallel_size=0, zero_stage=0)
    NPUHybridStrategy(expert_parallel_size=2)  # ZeRO-1 (the default) composes with ep


def test_ep_must_divide_dp():
    with pytest.raises(ParallelConfigError, match=r"`expert_parallel_size=4` does not divide the data-parallel size 2"):
        ParallelConfig(expert_parallel_size=4, zero_stage=0).resolve(2)


NORM_RTOL = 1e-5  # fp32: the layouts' global gradient norms agree to ~1e-7


@pytest.fixture(scope="module")
def reference():
    """The MoE models trained by one process: what every layout below must match."""
    return spawn(run_zoo, 1, {}, {m: Case(m) for m in MOE})[0]


@pytest.fixture(scope="module")
def ep2_launch(tmp_path_factory):
    """One 2-process launch: the resumes across ep sizes and the MoE models at ep=2 x ZeRO-1 (dp=2)."""
    return spawn(resume_across_ep_sizes, 2, str(tmp_path_factory.mktemp("ep")), MOE)[0]


def _expert_elements(state: dict) -> int:
    return sum(v.numel() for k, v in state.items() if ".experts." in k)


def _norm_diff(run: dict, ref: dict) -> float:
    """The largest relative difference of the global gradient norm that clipping used: each expert counted once (an
    expert's squared sum left unreduced over ep moves it by ~1e-4 here, while the weights still pass 1e-5)."""
    return max(abs(a - b) / b for a, b in zip(run["grad_norms"], ref["grad_norms"], strict=True))


def test_resume_across_expert_parallel_sizes(ep2_launch):
    out = ep2_launch
    whole = out["whole"]
    for form in ("ckpt", "dir"):
        assert out[f"ep2 {form}"] == pytest.approx(whole[:2], rel=1e-5)
        assert out[f"ep1 from {form}"] == pytest.approx(whole[2:], rel=1e-5), form
        assert out[f"ep2 from {form}"] == pytest.approx(whole[2:], rel=1e-5), form
    assert out["ep2 zero3 dir"] == pytest.approx(whole[:2], rel=1e-5)
    assert out["ep1 from zero3 dir"] == pytest.approx(whole[2:], rel=1e-5)
    # ZeRO-1 x ep: its sharded checkpoint resumes at ep=1, at ep=2 ZeRO-3, and it loads ZeRO-0's
    assert out["ep2 zero1 dir"] == pytest.approx(whole[:2], rel=1e-5)
    for resumed in ("ep1 from zero1 dir", "ep2 zero3 from zero1 dir", "ep2 zero1 from dir"):
        assert out[resumed] == pytest.approx(whole[2:], rel=1e-5), resumed
    assert "`expert_parallel_size=2` needs a mixture-of-experts model" in out["dense model"]


def test_zero1_with_expert_parallelism_matches_one_process(ep2_launch, reference):
    """ep=2 x ZeRO-1 at dp=2 (edp=1): each rank holds and steps half of the experts, the rest sliced over dp."""
    for name in MOE:
        run = ep2_launch["zoo ep2 zero1"][name]
        assert "error" not in run, f"{name}: {run.get('error')}"
        diff = compare(run, reference[name])
        assert diff["loss"] <= LOSS_RTOL and diff["state"] <= STATE_ATOL, (name, diff)
        assert _norm_diff(run, reference[name]) <= NORM_RTOL, name
        whole = _expert_elements(reference[name]["state"])
        assert run["local_experts"] == whole // 2, name
        assert run["expert_masters"] == {"masters": whole // 2, "exp_avg": whole // 2}, name


# 4 processes: (strategy, models). ZeRO-3 at dp=4 shards each rank's experts over the 2 ranks that hold them (edp=2);
# tp splits every expert inside its ep shard; pp keeps each stage's experts (DeepSeek-V3's first, dense layer on
# stage 0), also under ZeRO-3 (the stage's FSDP2 units around the experts' own)
COMPOSED = {
    "ep2 zero3 dp4": ({"expert_parallel_size": 2, "zero_stage": 3}, MOE),
    "ep2 pp2": ({"expert_parallel_size": 2, "zero_stage": 0, "pipeline_parallel_size": 2}, MOE),
    "ep2 pp2 zero3": ({"expert_parallel_size": 2, "zero_stage": 3, "pipeline_parallel_size": 2}, ["qwen3-moe"]),
    "ep2 tp2 zero3": ({"expert_parallel_size": 2, "zero_stage": 3, "tensor_parallel_size": 2}, ["mixtral"]),
    "ep2 tp2": ({"expert_parallel_size": 2, "zero_stage": 0, "tensor_parallel_size": 2}, ["qwen3-moe"]),
    # ZeRO-1 at dp=4: each rank's experts' masters and AdamW state sliced over edp=2 (Mixtral's 1 expert per rank
    # has 1 row: nothing to slice), and inside tp
    "ep2 zero1 dp4": ({"expert_parallel_size": 2, "zero_stage": 1}, ["qwen3-moe", "deepseek-v3"]),
    "ep2 tp2 zero1": ({"expert_parallel_size": 2, "zero_stage": 1, "tensor_parallel_size": 2}, ["mixtral"]),
}


def test_expert_parallelism_composes_with_zero1_zero3_tp_and_pp(reference):
    got = spawn(run_layouts, 4, COMPOSED)[0]
    for layout, (_, models) in COMPOSED.items():
        for name in models:
            run = got[layout][name]
            assert "error" not in run, f"{layout} {name}: {run.get('error')}"
            diff = compare(run, reference[name])
            assert diff["loss"] <= LOSS_RTOL and diff["state"] <= STATE_ATOL, (layout, name, diff)
            if "zero1" in layout:
                assert _norm_diff(run, reference[name]) <= NORM_RTOL, (layout, name)
    # rank 0 holds half of the experts under ep=2, a quarter with tp=2 inside (ZeRO-3 at dp=4: half again over edp,
    # Mixtral's 1 expert per rank then on one of the 2 edp ranks only)
    whole = {m: _expert_elements(reference[m]["state"]) for m in MOE}
    assert got["ep2 zero3 dp4"]["qwen3-moe"]["local_experts"] == whole["qwen3-moe"] // 4
    assert got["ep2 tp2 zero3"]["mixtral"]["local_experts"] == whole["mixtral"] // 4
    assert got["ep2 tp2"]["qwen3-moe"]["local_experts"] == whole["qwen3-moe"] // 4
    assert got["ep2 pp2"]["mixtral"]["local_experts"] == whole["mixtral"] // 4  # stage 0: 1 of 2 layers, half of it
    assert got["ep2 pp2 zero3"]["qwen3-moe"]["local_experts"] == whole["qwen3-moe"] // 4
    # ZeRO-1 at dp=4: half of the experts on rank 0, a quarter of their masters and state (1/ep x 1/edp)
    for name in ("qwen3-moe", "deepseek-v3"):
        run = got["ep2 zero1 dp4"][name]
        assert run["local_experts"] == whole[name] // 2, name
        assert run["expert_masters"] == {"masters": whole[name] // 4, "exp_avg": whole[name] // 4}, name
    assert got["ep2 tp2 zero1"]["mixtral"]["expert_masters"]["masters"] == whole["mixtral"] // 4
