"""Stock `transformers` models (tiny configs, no weights) under tp=2 (with and without sequence parallelism), pp=2 and
dp with ZeRO 1 and 3, on 2 CPU processes (gloo), compared step by step with one process reading the same samples (fp32,
every step clipped by the global gradient norm).

One launch per layout trains every model in turn (tests/_model_zoo_workers.py). A case either matches one process
(EXACT: every step's logged loss within rtol 1e-4, the final full state within 1e-5 of a 1e-3 learning rate's
step) or is refused at setup with a message naming the fix, as `REFUSED` expects. docs/layouts.md shows the matrix
`matrix_markdown` makes of these cases (`LNPU_WRITE_ZOO_DOCS=1` rewrites it from a run).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from tests._layouts import launch_calls
from tests._model_zoo_workers import MODELS, Case, run_zoo

LOSS_RTOL, STATE_ATOL = 1e-4, 1e-5
DOCS = Path(__file__).resolve().parents[1] / "docs" / "layouts.md"
DOCS_BEGIN, DOCS_END = "<!-- model-zoo: begin (tests/test_model_zoo.py) -->", "<!-- model-zoo: end -->"

DP_MODELS = ["llama", "qwen2", "qwen3", "mistral", "gemma3", "phi3", "gpt2", "gpt-neox", "opt", "falcon", "bert", "vit",
             "clip", "mixtral", "qwen3-moe", "deepseek-v3"]
DECODERS = ["llama", "qwen2", "qwen3", "mistral", "gemma3", "phi3", "gpt2", "gpt-neox", "opt", "falcon", "mixtral",
            "qwen3-moe", "deepseek-v3"]
MOE = ["mixtral", "qwen3-moe", "deepseek-v3"]
EXPERTS_REPLICATED = {"tp_plan": {"*": "auto", "*.mlp.experts": "replicate"}}
# Phi-3 with its q|k|v split by heads (the model's own plan gathers qkv_proj's output instead): unequal parts
PHI3_SPLIT = {"tp_plan": {"*": "auto", "*.qkv_proj": "qkv", "*.self_attn.o_proj": "rowwise",
                          "*.gate_up_proj": "gate_up", "*.mlp.down_proj": "rowwise"}}
TP_CASES = {
    **{name: Case(name) for name in MODELS},
    "phi3 (qkv split)": Case("phi3", PHI3_SPLIT),
    "phi3-mha (qkv split)": Case("phi3-mha", PHI3_SPLIT),
    # ZeRO 3 on top of tp: FSDP2 over the tp DTensors (per-head norms' partial gradients, CLIP's scalar left out)
    "gemma3 zero3": Case("gemma3", {"zero_stage": 3}),
    "clip zero3": Case("clip", {"zero_stage": 3}),
    "mixtral (experts replicated)": Case("mixtral", EXPERTS_REPLICATED),
    "mixtral (colwise experts)": Case("mixtral", {"tp_plan": {"*": "auto", "*.mlp.experts": "colwise"}}),
    "error in a sharded forward": Case("llama", model_cls="RaisesInShardedForward"),
}
# sequence parallelism: the decoders (MoE experts split over tp, their tokens gathered), and experts replicated
SP_CASES = {**{name: Case(name) for name in DECODERS},
            "mixtral (experts replicated)": Case("mixtral", EXPERTS_REPLICATED)}
LAYOUTS = {
    "tp2": ({"tensor_parallel_size": 2}, TP_CASES),
    "tp2-sp": ({"tensor_parallel_size": 2, "sequence_parallel": True}, SP_CASES),
    "pp2": ({"pipeline_parallel_size": 2}, {name: Case(name) for name in DECODERS}),
    # expert parallelism: each MoE layer's experts split over the 2 dp ranks (all-to-all dispatch)
    "ep2": ({"expert_parallel_size": 2, "zero_stage": 0}, {name: Case(name) for name in MOE}),
    "dp2-zero1": ({"zero_stage": 1}, {name: Case(name) for name in DP_MODELS}),
    "dp2-zero3": ({"zero_stage": 3}, {name: Case(name) for name in DP_MODELS}),
}
# bf16-mixed against a bf16-mixed process: the loss within 2e-4 relative, the weights within 2 x lr x steps (AdamW
# moves each weight by about lr a step, so two runs whose gradients differ in rounding drift apart by at most that)
BF16 = {"precision": "bf16-mixed"}
BF16_LOSS_RTOL, BF16_STATE_ATOL = 2e-4, 2 * 1e-3 * 3
BF16_LAYOUTS = {
    "pp2 bf16": ({"pipeline_parallel_size": 2, **BF16}, {name: Case(name) for name in DECODERS}),
    "tp2-sp bf16": ({"tensor_parallel_size": 2, "sequence_parallel": True, **BF16}, SP_CASES),
    "dp2-zero3 bf16": ({"zero_stage": 3, **BF16}, {name: Case(name) for name in DECODERS}),
}
LAYOUTS.update(BF16_LAYOUTS)
TITLES = {"tp2": "tp=2", "tp2-sp": "tp=2, sequence parallel", "pp2": "pp=2", "ep2": "ep=2 (dp=2, ZeRO-0)",
          "dp2-zero1": "dp=2, ZeRO-1",
          "dp2-zero3": "dp=2, ZeRO-3", "pp2 bf16": "pp=2, bf16", "tp2-sp bf16": "tp=2 + sp, bf16",
          "dp2-zero3 bf16": "ZeRO-3, bf16"}
REFUSED = {  # (layout, case) -> what the error must say
    ("tp2", "mixtral (colwise experts)"): r"ParallelConfigError: tp_plan style 'colwise' for module "
                                          r"model\.model\.layers\.0\.mlp\.experts needs an nn\.Linear",
}


@pytest.fixture(scope="module")
def zoo() -> dict:
    """Two launches (start-up and imports paid once each): the one-process references (fp32, bf16), then every
    2-process layout in turn in one process group."""
    (reference,), (reference_bf16,) = launch_calls(1, [
        (run_zoo, dict(strategy_kwargs={"zero_stage": 0}, cases={name: Case(name) for name in MODELS})),
        (run_zoo, dict(strategy_kwargs={"zero_stage": 0, **BF16}, cases={name: Case(name) for name in DECODERS})),
    ])
    got = launch_calls(2, [(run_zoo, dict(strategy_kwargs=strategy, cases=cases)) for strategy, cases in LAYOUTS.values()])
    return {"reference": reference, "reference bf16": reference_bf16, **dict(zip(LAYOUTS, got))}


def reference_of(zoo: dict, layout: str) -> dict:
    return zoo["reference bf16" if layout in BF16_LAYOUTS else "reference"]


def compare(got: dict, ref: dict) -> dict:
    """The largest relative loss difference over the steps and absolute state difference over the tensors."""
    assert len(got["logged"]) == len(ref["logged"])
    loss = max(abs(a - b) / abs(b) for a, b in zip(got["logged"], ref["logged"]))
    assert got["state"].keys() == ref["state"].keys()
    state = max((got["state"][k] - ref["state"][k]).abs().max().item() for k in ref["state"])
    return {"loss": loss, "state": state}


def cell(zoo: dict, layout: str, name: str) -> str:
    """EXACT (max differences) or the refusal, as the docs show it."""
    got = zoo[layout][0][name]
    if "error" in got:
        return "refused"
    diff = compare(got, reference_of(zoo, layout)[LAYOUTS[layout][1][name].model])
    if layout in BF16_LAYOUTS:
        return f"bf16 bound ({diff['loss']:.0e}, {diff['state']:.0e})"
    return f"exact ({max(diff['loss'], diff['state']):.0e})"


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_every_model_matches_one_process(zoo, layout):
    ref = reference_of(zoo, layout)
    assert all(r["logged"][-1] != r["logged"][0] for r in ref.values())  # it trained
    loss_rtol, state_atol = (BF16_LOSS_RTOL, BF16_STATE_ATOL) if layout in BF16_LAYOUTS else (LOSS_RTOL, STATE_ATOL)
    for name, case in LAYOUTS[layout][1].items():
        if (layout, name) in REFUSED or case.model_cls != "ZooModule":
            continue
        for rank, results in enumerate(zoo[layout]):
            got = results[name]
            assert "error" not in got, f"{layout} {name} (rank {rank}): {got['error']}"
            diff = compare(got, ref[case.model])
            assert diff["loss"] <= loss_rtol and diff["state"] <= state_atol, f"{layout} {name}: {diff}"


def test_refusals_come_at_setup_naming_the_fix(zoo):
    for (layout, name), message in REFUSED.items():
        for results in zoo[layout]:
            assert re.search(message, results[name].get("error", "")), results[name]


def test_an_error_inside_a_sharded_forward_surfaces_as_itself(zoo):
    # not Lightning's teardown failing on half-swapped parameters ("_apply(): Couldn't swap Linear.weight")
    for results in zoo["tp2"]:
        error = results["error in a sharded forward"]["error"]
        assert error.startswith("RuntimeError: a and b must have same reduction dim, but got [2, 7]"), error


def test_plans_come_from_the_model(zoo):
    reports = {name: zoo["tp2"][0][name]["report"] for name in TP_CASES if "report" in zoo["tp2"][0][name]}
    assert "from model: transformers' tp_plan of Gemma3ForCausalLM" in reports["gemma3"]
    assert "self_attn.q_norm: replicate_sum_grad" in reports["gemma3"]
    assert "model.lm_head: vocab" in reports["phi3"] and "self_attn.qkv_proj: colwise_rep" in reports["phi3"]
    assert "self_attn.qkv_proj: qkv (32, 16, 16)" in reports["phi3 (qkv split)"]
    assert "config.num_attention_heads 4 -> 2" in reports["phi3-mha (qkv split)"]
    assert "attention.query_key_value: colwise" in reports["gpt-neox"]
    # Falcon's one k/v head stays whole (gathered); its grouped-kv architecture splits by kv group
    assert "self_attention.query_key_value: colwise_rep" in reports["falcon"]
    assert "self_attention: num_heads 4 -> 2, num_kv_heads 2 -> 1" in reports["falcon-gqa"]
    assert "from name rules" in reports["bert"] and "model.cls.predictions.decoder: vocab" in reports["bert"]
    # MoE experts split over tp where the model's ep plan names them (transformers >= 5.2x left them out of its tp
    # plans); MLA's shared rotary key summed over tp in backward (without it DeepSeek-V3's weights drift by 3e-3)
    assert "model.model.layers.0.mlp.experts: experts" in reports["mixtral"]
    assert "self_attn.kv_a_proj_with_mqa: shared_rope_key" in reports["deepseek-v3"]
    # buffers of sharded modules stay plain tensors (Gemma-3's embed_scale)
    assert zoo["tp2"][0]["gemma3"]["buffers"]["model.model.embed_tokens.embed_scale"] == "Tensor"


def matrix_markdown(zoo: dict) -> str:
    rows = ["| model | " + " | ".join(TITLES[layout] for layout in LAYOUTS) + " |",
            "| --- |" + " --- |" * len(LAYOUTS)]
    names = list(dict.fromkeys(n for _, cases in LAYOUTS.values() for n, c in cases.items()
                               if c.model_cls == "ZooModule"))
    for name in names:
        cells = [cell(zoo, layout, name) if name in LAYOUTS[layout][1] else "" for layout in LAYOUTS]
        rows.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def test_layouts_are_what_they_say(zoo):
    """The pp and sp cells ran split: stages own disjoint blocks, tied embeddings are summed between the ends, the
    sequence is split at the first block (not silently a replicated run)."""
    pp = {name: [zoo["pp2"][rank][name]["report"] for rank in range(2)] for name in DECODERS}
    assert "stage 1 (pp rank 1): blocks 1..1 + head model.model.norm,model.lm_head" in pp["llama"][0]
    assert "tied: model.transformer.wte.weight (stage 0) = model.lm_head.weight (stage 1)" in pp["gpt2"][0]
    # OPT registers final_layer_norm before its layers; it is applied after them, on the last stage
    assert "head model.model.decoder.final_layer_norm,model.lm_head" in pp["opt"][0]
    sp = zoo["tp2-sp"][0]["llama"]["report"]
    assert "model.model.layers.0: shard_seq" in sp and "model.model.layers.1: gather_seq_output" in sp
    assert "model.model.layers.0.input_layernorm: norm" in sp
    # DeepSeek-V3's attention follows the model's plan (heads split, its input gathered); the router sees shards
    ds = zoo["tp2-sp"][0]["deepseek-v3"]["report"]
    assert "model.model.layers.1.self_attn: gather_seq" in ds and "layers.1.mlp.gate: replicate_sum_grad" in ds
    assert "layers.1.self_attn.kv_a_proj_with_mqa: shared_rope_key" in ds
    # a block's part the plan leaves whole runs on the gathered sequence
    whole = zoo["tp2-sp"][0]["mixtral (experts replicated)"]["report"]
    assert "model.model.layers.0.mlp: full_sequence" in whole, whole
    # expert tensor parallelism (transformers' moe_tp_experts): each tp rank holds half of every expert; expert
    # parallelism: each ep rank half of the experts
    for name in MOE:
        assert "mlp.experts: experts" in zoo["tp2"][0][name]["report"], name
        whole = sum(v.numel() for k, v in zoo["reference"][name]["state"].items() if ".experts." in k)
        for layout in ("tp2", "tp2-sp", "ep2"):
            assert [zoo[layout][rank][name]["local_experts"] for rank in range(2)] == [whole // 2] * 2, (layout, name)
    # RouterMonitor on rank 0 reports every MoE layer, also those of the other pipeline stage
    for name in MOE:
        layers = zoo["reference"][name]["router_layers"]
        assert layers and all(zoo[layout][0][name]["router_layers"] == layers for layout in ("pp2", "tp2", "ep2")), name


def test_docs_show_the_measured_matrix(zoo):
    table = matrix_markdown(zoo)
    text = DOCS.read_text()
    if os.environ.get("LNPU_WRITE_ZOO_DOCS"):
        begin, end = text.index(DOCS_BEGIN) + len(DOCS_BEGIN), text.index(DOCS_END)
        DOCS.write_text(text[:begin] + "\n" + table + "\n" + text[end:])
        text = DOCS.read_text()
    begin, end = text.index(DOCS_BEGIN) + len(DOCS_BEGIN), text.index(DOCS_END)
    # the cells' verdicts must match (the differences printed may move in the last digit between machines)
    def verdicts(md: str) -> str:
        return re.sub(r" \([\d.e+\-, ]+\)", "", md)

    assert verdicts(table) == verdicts(text[begin:end].strip()), table

