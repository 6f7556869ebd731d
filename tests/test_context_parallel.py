"""Context parallelism (`context_parallel_size`): bad layouts refused at `Trainer(...)`; Llama, Qwen3 (its own loss,
ignored tokens spread unevenly over the cp ranks) and the example GPT at cp=2 equal one process; a cp=2 checkpoint
resumed at cp=1 x dp=2 continues the one-process losses; the GPT at cp2 x dp2 x ZeRO-3 and Llama at cp2 x tp2 on 4
processes equal one process. Llama and the GPT also with full activation checkpointing. Attention is ring
attention (the default; the GPT also with all-gathered K/V), and ring attention alone equals one SDPA (fp64) at
cp = 2 and 4. Bounds: per-step loss rtol 1e-4, final weights atol 1e-5
(fp32)."""

import pytest
import torch

from lightning_npu import NPUHybridStrategy
from lightning_npu.launch import spawn
from lightning_npu.parallel.config import ParallelConfig
from lightning_npu.parallel.context_parallel.layout import ChunkLayout, shift_labels, split_batch
from lightning_npu.parallel.errors import ParallelConfigError
from tests._context_parallel_workers import SEQ, four_process, run, two_process

LOSS_RTOL, STATE_ATOL = 1e-4, 1e-5


@pytest.mark.parametrize("kwargs, message", [
    ({"sequence_parallel": True, "tensor_parallel_size": 2}, r"`sequence_parallel=True` is not supported"),
    ({"gradient_compression": "bf16"}, r"`gradient_compression='bf16'`"),
    ({"activation_checkpointing": "selective"}, r"`activation_checkpointing='selective'` is not supported yet; set "
                                                r"activation_checkpointing='full' or an int N"),
    ({"fuse_ops": True}, r"`fuse_ops=True`"),
    ({"expert_parallel_size": 2, "zero_stage": 0}, r"`expert_parallel_size=2`"),
    ({"hierarchical_allreduce": True, "zero_stage": 0}, r"`hierarchical_allreduce=True`"),
    ({"context_parallel_attention": "ulysses"}, r"context_parallel_attention"),
])
def test_unsupported_combinations_are_refused(kwargs, message):
    with pytest.raises(ParallelConfigError, match=message):
        NPUHybridStrategy(context_parallel_size=2, **kwargs)


def test_world_size_must_divide():
    with pytest.raises(ParallelConfigError, match=r"not divisible by .*`context_parallel_size=4`"):
        ParallelConfig(context_parallel_size=4).resolve(6)
    cfg = ParallelConfig(context_parallel_size=2, tensor_parallel_size=2).resolve(8)
    assert (cfg.dp, cfg.replicas, cfg.mesh_shape) == (2, 4, (1, 2, 2, 2))
    assert ParallelConfig().resolve(4).mesh_shape == (1, 4, 1)  # cp = 1: the 3-D mesh, unchanged


def test_chunks_are_load_balanced_and_labels_shift_before_the_split():
    seq = torch.arange(16)[None]
    parts = [ChunkLayout(2, r).split(seq)[0].tolist() for r in range(2)]
    assert parts == [[0, 1, 2, 3, 12, 13, 14, 15], [4, 5, 6, 7, 8, 9, 10, 11]]
    assert [ChunkLayout(2, r).positions(16, "cpu").tolist() for r in range(2)] == parts
    assert ChunkLayout(2, 0).gathered_positions(16, "cpu").tolist() == parts[0] + parts[1]
    batch, length = split_batch({"input_ids": seq, "labels": seq}, ChunkLayout(2, 1))
    assert length == 16 and batch["labels"][0].tolist() == [5, 6, 7, 8, 9, 10, 11, 12]  # the next tokens'
    assert shift_labels(seq)[0, -1] == -100
    with pytest.raises(ValueError, match=r"sequence length is 14; make it a multiple of 4"):
        split_batch(seq[:, :14], ChunkLayout(2, 0))
    with pytest.raises(ValueError, match="padding masks"):
        split_batch({"input_ids": seq, "attention_mask": seq > 0}, ChunkLayout(2, 0))


def _compare(got: dict, ref: dict) -> None:
    assert "error" not in got, got.get("error")
    assert got["lengths"] == [SEQ // 2], got["lengths"]  # the model saw this rank's chunks only
    loss = max(abs(a - b) / abs(b) for a, b in zip(got["logged"], ref["logged"]))
    assert len(got["logged"]) == len(ref["logged"]) and loss <= LOSS_RTOL, (got["logged"], ref["logged"])
    state = max((got["state"][k] - ref["state"][k]).abs().max().item() for k in ref["state"])
    assert state <= STATE_ATOL, state


@pytest.fixture(scope="module")
def references():
    return spawn(run, 1, {kind: (kind, {"zero_stage": 0}) for kind in ("llama", "qwen3", "gpt")})[0]  # one process


def test_context_parallel_equals_one_process(tmp_path, references):
    got = spawn(two_process, 2, str(tmp_path))[0]
    for name in ("llama", "qwen3", "gpt"):
        _compare(got[f"{name} cp2"], references[name])
    _compare(got["gpt cp2 allgather"], references["gpt"])  # ring (the default) keeps less than all-gathered K/V
    assert got["gpt cp2"]["saved_bytes"] < got["gpt cp2 allgather"]["saved_bytes"]
    assert max(got["ring"].values()) < 1e-12, got["ring"]  # fp64, against one SDPA over the whole sequence
    for name in ("llama", "gpt"):  # full recompute: exact, and really recomputing (fewer bytes kept for backward)
        _compare(got[f"{name} cp2 ac"], references[name])
        assert "2 of 2 blocks" in got[f"{name} cp2 ac"]["recompute"]
        assert got[f"{name} cp2 ac"]["saved_bytes"] < got[f"{name} cp2"]["saved_bytes"]
    whole = references["llama"]["logged"]
    assert got["resume"]["cp2"] == pytest.approx(whole[:2], rel=LOSS_RTOL)
    assert got["resume"]["dp2 from cp2"] == pytest.approx(whole[2:], rel=LOSS_RTOL)
    refused = got["refusals"]
    assert "no module of _NoPositions takes `position_ids`" in refused["no position_ids"], refused
    assert "sequence length is 14; make it a multiple of 4" in refused["length"], refused


def test_context_parallel_composes_with_zero3_and_tp(references):
    got = spawn(four_process, 4)[0]
    _compare(got["gpt cp2 dp2 zero3"], references["gpt"])
    _compare(got["gpt pp2 cp2"], references["gpt"])
    _compare(got["llama cp2 tp2"], references["llama"])
    assert max(got["ring"].values()) < 1e-12, got["ring"]  # ring attention at cp = 4
