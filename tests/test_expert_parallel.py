"""Expert parallelism (`expert_parallel_size`): bad layouts refused at `Trainer(...)`, a checkpoint saved under one ep
size resumed exactly under another, a dense model refused at setup. Training against one process is in
tests/test_model_zoo.py (the "ep2" layout)."""

import pytest

from lightning_npu import NPUHybridStrategy
from lightning_npu.launch import spawn
from lightning_npu.parallel.config import ParallelConfig
from lightning_npu.parallel.errors import ParallelConfigError
from tests._expert_parallel_workers import resume_across_ep_sizes


@pytest.mark.parametrize("kwargs, message", [
    ({"expert_parallel_size": 2}, r"`expert_parallel_size=2` with `zero_stage=1`: .* set zero_stage=0"),
    ({"expert_parallel_size": 2, "zero_stage": 0, "tensor_parallel_size": 2},
     r"with `tensor_parallel_size=2`: .*tp_plan='auto' splits every expert over tp"),
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
    assert "`expert_parallel_size=2` needs a mixture-of-experts model" in out["dense model"]
