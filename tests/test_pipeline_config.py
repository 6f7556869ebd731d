"""Pipeline layouts that cannot work are refused with errors naming the argument, the value and the fix."""

import pytest
import torch.nn as nn

from examples.gpt.model import GPTModule
from lightning_npu import NPUHybridStrategy
from lightning_npu.launch import spawn
from lightning_npu.parallel.errors import ParallelConfigError
from lightning_npu.parallel.pipeline_parallel.plan import PipelineLayoutError, balance_blocks, plan_pipeline
from lightning_npu.parallel.pipeline_parallel.runner import bubble_fraction
from tests._pp_workers import PP_GPT, expect_errors


def gpt(n_layer: int = 4) -> GPTModule:
    return GPTModule(**{**PP_GPT, "n_layer": n_layer})


def test_pp_larger_than_blocks():
    with pytest.raises(PipelineLayoutError, match=r"pipeline_parallel_size=4` is larger than the 2 blocks of "
                                                  r"`model.transformer.h`.*pipeline_parallel_size<=2"):
        plan_pipeline(gpt(2), 4)
    with pytest.raises(PipelineLayoutError, match=r"x virtual_stages=2 .* = 4 stages is larger than the 3 blocks"):
        plan_pipeline(gpt(3), 2, "interleaved_1f1b")


def test_micro_batches_smaller_than_pp_with_1f1b():
    for schedule in ("1f1b", "interleaved_1f1b"):
        with pytest.raises(ParallelConfigError, match=r"micro_batches=2` is smaller than `pipeline_parallel_size=4"):
            NPUHybridStrategy(pipeline_parallel_size=4, micro_batches=2, pipeline_schedule=schedule)
    NPUHybridStrategy(pipeline_parallel_size=4, micro_batches=2, pipeline_schedule="gpipe")  # GPipe allows M < P


def test_module_without_pipeline_loss_gets_cross_entropy():
    import torch
    import torch.nn.functional as F

    from lightning_npu.parallel.pipeline_parallel.runner import default_pipeline_loss

    class NoLoss(GPTModule):
        pipeline_loss = None

    plan_pipeline(NoLoss(**PP_GPT), 2)  # accepted: the last stage's logits get cross-entropy
    logits, targets = torch.randn(2, 3, 5), torch.randint(0, 5, (2, 3))
    assert torch.equal(default_pipeline_loss("M", logits, targets), F.cross_entropy(logits.flatten(0, 1), targets.flatten()))
    with pytest.raises(PipelineLayoutError, match=r"M defines no `pipeline_loss\(self, output, target\)` .*\(2, 3\)"):
        default_pipeline_loss("M", logits[..., 0], targets)


def test_manual_optimization_is_refused():
    model = gpt(2)
    model.automatic_optimization = False
    with pytest.raises(PipelineLayoutError, match="automatic_optimization=False.*not supported"):
        plan_pipeline(model, 2)


def test_automatic_split_of_the_gpt_example():
    plan = plan_pipeline(gpt(4), 2)
    assert plan.blocks == "model.transformer.h"
    assert plan.embed == ["model.transformer.wte", "model.transformer.wpe"]
    assert plan.head == ["model.transformer.ln_f", "model.lm_head"]
    assert plan.stage_blocks == [[0, 1], [2, 3]]
    assert plan.modules_of_stage(0)[:2] == plan.embed and plan.modules_of_stage(1)[-2:] == plan.head
    interleaved = plan_pipeline(gpt(4), 2, "interleaved_1f1b")
    assert interleaved.num_stages == 4 and interleaved.stages_of(0) == [0, 2] and interleaved.stages_of(1) == [1, 3]


def test_balance_by_parameters_and_explicit_split():
    assert balance_blocks([1, 1, 1, 1], 2) == [2, 2]
    # stage 0 also carries a heavy embedding: it gets fewer blocks
    assert balance_blocks([10, 10, 10, 10], 2, first_extra=20) == [1, 3]
    model = gpt(4)
    model.pipeline_layout = {"balance": "params"}
    params_plan = plan_pipeline(model, 2)
    assert sum(map(len, params_plan.stage_blocks)) == 4
    model.pipeline_layout = {"split": [1, 3]}
    assert plan_pipeline(model, 2).stage_blocks == [[0], [1, 2, 3]]
    model.pipeline_layout = {"split": [2, 3]}
    with pytest.raises(PipelineLayoutError, match=r"split=\[2, 3\] must give 2 positive block counts summing to the 4"):
        plan_pipeline(model, 2)


def test_tied_weights_across_stages_are_planned():
    model = gpt(2)
    model.model.lm_head.weight = model.model.transformer.wte.weight
    plan = plan_pipeline(model, 2)
    assert plan.tied == [("model.transformer.wte.weight", "model.lm_head.weight")]
    assert "tied: model.transformer.wte.weight (stage 0) = model.lm_head.weight (stage 1)" in plan.report()


def test_unassigned_modules_are_refused():
    model = gpt(2)
    model.pipeline_layout = {"head": ["model.lm_head"]}  # forgot ln_f
    with pytest.raises(PipelineLayoutError, match=r"model.transformer.ln_f'\] are on no pipeline stage"):
        plan_pipeline(model, 2)


def test_bubble_model():
    assert bubble_fraction(2, 2) == pytest.approx(1 / 3)
    assert bubble_fraction(2, 8) == pytest.approx(1 / 9)
    assert bubble_fraction(4, 8, virtual_stages=2) == pytest.approx(3 / 19)


def test_fit_errors_in_real_processes():
    """pp=2 on a 1-block model: Trainer.fit raises in both processes before init_process_group; then a per-rank
    batch of 2 with micro_batches=3 is refused at the first training step."""
    cases = [({"pipeline_parallel_size": 2}, {"n_layer": 1}), ({"pipeline_parallel_size": 2, "micro_batches": 3}, {})]
    for too_deep, not_divisible in spawn(expect_errors, 2, 2, cases):
        assert too_deep["type"] == "PipelineLayoutError", too_deep
        assert "pipeline_parallel_size=2` is larger than the 1 blocks of `model.transformer.h`" in too_deep["message"]
        assert too_deep["pg"] is False
        assert not_divisible["type"] == "ParallelConfigError", not_divisible
        assert "per-rank batch of 2 samples is not divisible by `micro_batches=3`" in not_divisible["message"]


def test_block_lists_are_found_by_parameter_count():
    class Wrapper(GPTModule):
        def __init__(self):
            super().__init__(**PP_GPT)
            self.adapters = nn.ModuleList([nn.Identity()])  # no parameters: not the blocks

    assert plan_pipeline(Wrapper(), 2).blocks == "model.transformer.h"
