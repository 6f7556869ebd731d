"""Under tensor parallelism the model's outputs work in ordinary code, and logging/metrics reduce over dp.

One tp=2 launch (and one dp2 x tp2) of a `transformers` Llama whose steps use the logits as a Lightning user's code
does, compared with one process: torchmetrics Perplexity / MulticlassAccuracy, ``argmax == y``, ``self.log(...,
sync_dist=True)`` of a logits statistic and of a DTensor (on step and on epoch), a SumMetric of tokens,
``all_gather`` of a DTensor, greedy ``generate`` with the KV cache, a ``{"*": "auto", ...}`` override, and the
loss/parameter parity and the vocab-parallel loss's memory (logits-sized tensors saved for backward per rank).
"""

import pytest
import torch

from lightning_npu.launch import spawn
from tests._tp_outputs_workers import run_outputs
from tests.test_tensor_parallel import assert_same_state

RTOL = 1e-5
_ref: dict = {}


def reference() -> dict:
    if not _ref:
        _ref.update(spawn(run_outputs, 1, 1, 1)[0])
    return _ref


def check_against_reference(rank: dict, ref: dict, devices: int, tp: int) -> None:
    # training is unchanged: losses and parameters as one process
    torch.testing.assert_close(torch.tensor(rank["logged"]), torch.tensor(ref["logged"]), rtol=RTOL, atol=0)
    assert_same_state(rank["state"], ref["state"])
    # the loss stayed vocab-parallel: never gathered; logits-sized memory saved for backward is 1/tp of a
    # (per-rank batch) full copy
    assert rank["logits_types"] == ["VocabParallelLogits"] and ref["logits_types"] == ["Tensor"]
    assert not any(rank["gathered_for_loss"])
    assert ref["logits_bytes"][0] == 8 * 32 * 256 * 4  # one fp32 copy of the logits (log-softmax's output)
    assert [b * devices for b in rank["logits_bytes"]] == ref["logits_bytes"]  # per rank: 1/(tp x dp)
    # ordinary code on the logits: per-step logs (sync_dist, incl. a DTensor) and epoch-end metrics
    for row, ref_row in zip(rank["rows"], ref["rows"], strict=True):
        for key, value in ref_row.items():
            assert row[key] == pytest.approx(value, rel=RTOL, abs=1e-7), key
    for key, value in ref["val"].items():  # on-epoch accumulation of a DTensor and of a loss
        assert rank["val"][key] == pytest.approx(value, rel=RTOL, abs=1e-7), key
    assert rank["ppl"] == pytest.approx(ref["ppl"], rel=RTOL)
    assert rank["acc"] == pytest.approx(ref["acc"], rel=RTOL)
    # torchmetrics sync over dp only: each token counted once (tp peers read the same batch)
    assert rank["tokens"] == ref["tokens"] == 3 * 8 * 32
    assert rank["metric_group_size"] == devices // tp and ref["metric_group_size"] is None
    # all_gather: one row per rank (Lightning's contract), a DTensor's full value in each
    for gathered, ref_value in zip(rank["gathered"], ref["gathered"], strict=True):
        assert gathered.shape == (devices,)
        assert float(gathered.mean()) == pytest.approx(float(ref_value), rel=RTOL, abs=1e-7)
    # greedy generation through the KV cache picks the tokens one process picks
    assert torch.equal(rank["generated"], ref["generated"])
    # decisions stay world-wide (Lightning's reduce_boolean_decision): "any" sees rank 0, "all" does not
    assert rank["any_rank0"] and not rank["all_rank0"]


def test_tp2_outputs_metrics_and_logging_match_one_process():
    ref = reference()
    ranks = spawn(run_outputs, 2, 2, 2, True)
    for rank in ranks:
        check_against_reference(rank, ref, devices=2, tp=2)
        # a dict plan on top of "auto": the head replicated, full plain logits, same losses
        override = rank["override"]
        assert override["logits_types"] == ["Tensor"]
        assert "model.lm_head" in override["report"].split("replicated:")[1]
        assert "model.model.layers.0.self_attn.q_proj: colwise" in override["report"]
        torch.testing.assert_close(torch.tensor(override["logged"]), torch.tensor(ref["logged"][:2]), rtol=RTOL,
                                   atol=0)


@pytest.mark.slow
def test_dp2_tp2_outputs_metrics_and_logging_match_one_process():
    ref = reference()
    for rank in spawn(run_outputs, 4, 4, 2):
        check_against_reference(rank, ref, devices=4, tp=2)


def test_auto_plan_overrides_and_their_errors():
    """`{"*": "auto", ...}`: the automatic plan with single modules overridden (later entries win); wrong spellings
    are refused before any process group, naming the fix."""
    from examples.gpt.model import GPTModule
    from lightning_npu import NPUHybridStrategy
    from lightning_npu.parallel.config import ParallelConfigError
    from lightning_npu.parallel.tensor_parallel.plan import plan_tensor_parallel
    from lightning_npu.parallel.tensor_parallel.styles import VocabParallelHead

    model = GPTModule(n_layer=1, n_head=4, n_embd=32, block_size=16, bias=False)
    auto = plan_tensor_parallel(model, 2, "auto")
    same = plan_tensor_parallel(model, 2, {"*": "auto"})
    assert {k: n for k, (n, _) in same.styles.items()} == {k: n for k, (n, _) in auto.styles.items()}
    assert isinstance(auto.styles["model.lm_head"][1], VocabParallelHead) and auto.vocab_parallel_head
    kept = plan_tensor_parallel(model, 2, {"*": "auto", "model.lm_head": "replicate"})
    assert "model.lm_head" not in kept.styles and "model.lm_head" in kept.replicated and not kept.vocab_parallel_head
    assert kept.styles["model.transformer.h.0.attn.c_attn"][0] == "qkv"
    gathered = plan_tensor_parallel(model, 2, {"*": "auto", "*.lm_head": "colwise_rep"})
    assert gathered.styles["model.lm_head"][0] == "colwise_rep" and not gathered.vocab_parallel_head
    model.model.adapter = torch.nn.Linear(32, 32)  # unknown to "auto": refused by name, unless overridden
    with pytest.raises(ParallelConfigError, match=r"the 'auto' entry of tp_plan cannot shard module model\.adapter "
                                                  r".*\{'\*': 'auto', '<module glob>'"):
        plan_tensor_parallel(model, 2, {"*": "auto"})
    assert plan_tensor_parallel(model, 2, {"*": "auto", "model.adapter": "colwise_rep"}).styles["model.adapter"][0] \
        == "colwise_rep"
    for plan, message in [
        ({"auto": True}, r"`tp_plan\['auto'\]`: dict keys are module-name globs.*\{'\*': 'auto', 'model.lm_head'"),
        ({"*": "auto", "model.lm_head": None}, r"`tp_plan\['model.lm_head'\]=None`: .* use the style 'replicate'"),
        ({"*": "automatic"}, r"`tp_plan\['\*'\]='automatic'` is not a known style"),
    ]:
        with pytest.raises(ParallelConfigError, match=message):
            NPUHybridStrategy(tensor_parallel_size=2, tp_plan=plan)
