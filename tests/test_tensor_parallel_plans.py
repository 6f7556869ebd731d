"""Tensor-parallel planning and validation: no processes needed, clear errors before any process group."""

import re

import pytest
import torch
from torch.distributed.tensor.parallel import ColwiseParallel

from examples.gpt.model import GPTModule
from lightning_npu import NPUHybridStrategy
from lightning_npu.launch import spawn
from lightning_npu.parallel.errors import ParallelConfigError
from lightning_npu.parallel.tensor_parallel.plan import plan_tensor_parallel
from lightning_npu.parallel.tensor_parallel.styles import _part_major, _rank_major
from tests._tp_workers import HFCausalLM, fit_expect_error

SMALL = dict(n_layer=1, n_head=4, n_embd=32, block_size=16, bias=False)


def test_auto_plan_example_gpt():
    plan = plan_tensor_parallel(GPTModule(**SMALL), 2, "auto")
    names = {fqn: name for fqn, (name, _) in plan.styles.items()}
    assert names == {
        "model.transformer.wte": "vocab",
        "model.transformer.h.0.attn.c_attn": "qkv",
        "model.transformer.h.0.attn.c_proj": "rowwise",
        "model.transformer.h.0.mlp.c_fc": "colwise",
        "model.transformer.h.0.mlp.c_proj": "rowwise",
        "model.lm_head": "vocab",
    }
    assert plan.vocab_parallel_head
    assert plan.local_heads == {"model.transformer.h.0.attn": {"n_head": (4, 2)}}
    assert "model.transformer.wpe" in plan.replicated and "model.transformer.ln_f" in plan.replicated


def test_tp3_with_8_heads_is_refused():
    with pytest.raises(ParallelConfigError, match=r"tensor_parallel_size=3 does not divide num_heads=8 "
                                                  r"\(module model\.transformer\.h\.0\.attn\)"):
        plan_tensor_parallel(GPTModule(**{**SMALL, "n_head": 8, "n_embd": 48}), 3, "auto")


def test_gqa_kv_heads_must_divide():
    model = HFCausalLM("llama")  # 4 query heads, 2 kv heads
    plan_tensor_parallel(model, 2, "auto")
    with pytest.raises(ParallelConfigError, match=r"tensor_parallel_size=4 does not divide num_kv_heads=2 "
                                                  r"\(module model\.model\.layers\.0\.self_attn\)"):
        plan_tensor_parallel(model, 4, "auto")


def test_ffn_and_vocab_must_divide():
    with pytest.raises(ParallelConfigError, match=r"does not divide vocab_size=255 .*pad it to a multiple of 2 "
                                                  r"\(e\.g\. vocab_size=256"):
        plan_tensor_parallel(GPTModule(**{**SMALL, "vocab_size": 255}), 2, "auto")
    model = GPTModule(**SMALL)
    with pytest.raises(ParallelConfigError, match=r"tensor_parallel_size=3 does not divide out_features=128 "
                                                  r"\(module model\.transformer\.h\.0\.mlp\.c_fc\)"):
        plan_tensor_parallel(model, 3, {"*.mlp.c_fc": "colwise"})


def test_unknown_module_is_refused_by_auto():
    model = GPTModule(**SMALL)
    model.model.adapter = torch.nn.Linear(32, 32)
    with pytest.raises(ParallelConfigError, match=r"tp_plan='auto' cannot shard module model\.adapter \(Linear\)"):
        plan_tensor_parallel(model, 2, "auto")
    # an explicit plan covers it
    plan = plan_tensor_parallel(model, 2, {"*.c_attn": "qkv", "model.adapter": "colwise_rep"})
    assert plan.styles["model.adapter"][0] == "colwise_rep"


def test_dict_plan_errors():
    model = GPTModule(**SMALL)
    with pytest.raises(ParallelConfigError, match=r"`tp_plan\['\*\.nope'\]` matches no module"):
        plan_tensor_parallel(model, 2, {"*.nope": "colwise"})
    with pytest.raises(ParallelConfigError, match=r"is not a known style"):
        NPUHybridStrategy(tensor_parallel_size=2, tp_plan={"*.c_fc": "diagonal"})
    with pytest.raises(ParallelConfigError, match=r"needs an nn.Linear"):
        plan_tensor_parallel(model, 2, {"model.transformer.ln_f": "colwise"})


def test_fused_reorder_roundtrip():
    w = torch.arange(12.0).view(12, 1)  # q = 0..3, k = 4..7, v = 8..11
    rm = _rank_major(w, 0, 3, 2)
    assert rm.flatten().tolist() == [0, 1, 4, 5, 8, 9, 2, 3, 6, 7, 10, 11]  # rank 0: q0 k0 v0, rank 1: q1 k1 v1
    assert torch.equal(_part_major(rm, 0, 3, 2), w)


def test_fused_reorder_roundtrip_with_unequal_parts():
    w = torch.arange(8.0).view(8, 1)  # q = 0..3, k = 4..5, v = 6..7 (Phi-3 with grouped kv heads)
    rm = _rank_major(w, 0, (4, 2, 2), 2)
    assert rm.flatten().tolist() == [0, 1, 4, 6, 2, 3, 5, 7]  # rank 0: q0 k0 v0, rank 1: q1 k1 v1
    assert torch.equal(_part_major(rm, 0, (4, 2, 2), 2), w)


def _zoo(name: str) -> torch.nn.Module:
    from tests._model_zoo_workers import ZooModule

    return ZooModule(name)


def test_auto_uses_the_models_own_transformers_plan():
    plan = plan_tensor_parallel(_zoo("gemma3"), 2, "auto")
    names = {fqn: name for fqn, (name, _) in plan.styles.items()}
    assert plan.sources == ["model: transformers' tp_plan of Gemma3ForCausalLM"]
    assert names["model.model.layers.0.self_attn.q_norm"] == "replicate_sum_grad"
    # transformers gathers the head's logits ("colwise_gather_output"); here they stay vocab-sharded for the loss
    assert names["model.lm_head"] == "vocab" and names["model.model.embed_tokens"] == "vocab" and plan.vocab_parallel_head
    # Llama-style attention reads its head counts from the config only: localised there
    assert plan.local_heads["model.model.layers.0.self_attn"] == {
        "config.num_attention_heads": (4, 2), "config.num_key_value_heads": (2, 1)}
    # Phi-3's own plan gathers its fused projections; a dict splits them by heads, q/k/v sizes from the config
    names = {fqn: name for fqn, (name, _) in plan_tensor_parallel(_zoo("phi3"), 2, "auto").styles.items()}
    assert names["model.model.layers.0.self_attn.qkv_proj"] == "colwise_rep"
    assert names["model.model.layers.0.self_attn.o_proj"] == "rowwise_rep"
    split = plan_tensor_parallel(_zoo("phi3"), 2, {"*": "auto", "*.qkv_proj": "qkv", "*.self_attn.o_proj": "rowwise"})
    assert split.styles["model.model.layers.0.self_attn.qkv_proj"][1].fused == (32, 16, 16)


def test_name_rules_for_models_without_a_plan():
    names = {fqn: name for fqn, (name, _) in plan_tensor_parallel(_zoo("bert"), 2, "auto").styles.items()}
    assert names["model.bert.encoder.layer.0.attention.output.dense"] == "rowwise"
    assert names["model.bert.encoder.layer.0.intermediate.dense"] == "colwise"
    assert names["model.cls.predictions.decoder"] == "vocab"
    falcon = plan_tensor_parallel(_zoo("falcon"), 2, "auto")  # one k/v head: the attention stays whole
    assert falcon.styles["model.transformer.h.0.self_attention.query_key_value"][0] == "colwise_rep"
    assert falcon.styles["model.transformer.h.0.self_attention.dense"][0] == "rowwise_rep"
    assert "model.transformer.h.0.self_attention" not in falcon.local_heads


def test_a_split_against_the_fused_layout_is_refused():
    with pytest.raises(ParallelConfigError, match=r"style 'colwise' for module .*self_attn\.qkv_proj does not match "
                                                  r"its layout: it is part-major, 'qkv' splits it"):
        plan_tensor_parallel(_zoo("phi3"), 2, {"*": "auto", "*.qkv_proj": "colwise", "*.self_attn.o_proj": "rowwise"})
    with pytest.raises(ParallelConfigError, match=r"style 'qkv' for module .*attention\.query_key_value does not "
                                                  r"match its layout: it is interleaved per head, 'colwise' splits it"):
        plan_tensor_parallel(_zoo("gpt-neox"), 2, {"*": "auto", "*.query_key_value": "qkv"})


def test_moe_experts_split_over_tp_or_kept_whole():
    # transformers' moe_tp_experts: every expert split over tp (trained against one process in test_model_zoo.py)
    plan = plan_tensor_parallel(_zoo("mixtral"), 2, "auto")
    assert plan.styles["model.model.layers.0.mlp.experts"][0] == "experts"
    assert "model.model.layers.0.mlp.gate" in plan.replicated  # the router
    plan = plan_tensor_parallel(_zoo("mixtral"), 2, {"*": "auto", "*.mlp.experts": "replicate"})
    assert "model.model.layers.0.mlp.experts" in plan.replicated
    with pytest.raises(ParallelConfigError, match=r"style 'colwise' for module model\.model\.layers\.0\.mlp\.experts "
                                                  r"needs an nn\.Linear"):
        plan_tensor_parallel(_zoo("mixtral"), 2, {"*": "auto", "*.mlp.experts": "colwise"})


def test_bad_layouts_fail_before_any_process_group():
    """Through Trainer.fit in real processes: the plan is validated before init_process_group."""
    for res in spawn(fit_expect_error, 2, 2, {"n_head": 4, "n_embd": 32}, True):
        assert res["type"] == "ParallelConfigError" and "model.adapter" in res["message"], res
        assert not res["pg"]


def test_sequence_parallel_scope():
    plan = plan_tensor_parallel(GPTModule(**SMALL), 2, "auto", sequence_parallel=True)
    names = {fqn: name for fqn, (name, _) in plan.styles.items()}
    assert names["model.transformer.ln_f"] == "norm" and names["model.transformer.h.0.mlp"] == "gather_seq"
    # transformers models: the sequence is split at the first block and gathered after the last, so the parent
    # derives positions and masks from the whole sequence (trained against one process in tests/test_model_zoo.py)
    hf = {fqn: name for fqn, (name, _) in
          plan_tensor_parallel(HFCausalLM("llama"), 2, "auto", sequence_parallel=True).styles.items()}
    layers = [f for f in hf if re.fullmatch(r"model\.model\.layers\.\d+", f)]
    assert hf[layers[0]] == "shard_seq" and hf[layers[-1]] == "gather_seq_output", hf
    assert hf["model.model.embed_tokens"] == "vocab" and "model.model.norm" not in hf  # whole sequence there
    assert hf["model.model.layers.0.input_layernorm"] == "norm" and hf["model.model.layers.0.mlp"] == "gather_seq"
    plan_tensor_parallel(GPTModule(**SMALL), 2, {"*": "auto", "*.c_fc": "colwise"}, sequence_parallel=True)
    with pytest.raises(ParallelConfigError, match=r"rewrites a plan of style names"):
        plan_tensor_parallel(GPTModule(**SMALL), 2, {"*": "auto", "*.c_fc": ColwiseParallel()}, sequence_parallel=True)
    with pytest.raises(ParallelConfigError, match=r"needs `tensor_parallel_size>1`"):
        NPUHybridStrategy(sequence_parallel=True)
