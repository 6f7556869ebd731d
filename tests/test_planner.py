"""`lightning_npu.planner` and `lightning-npu plan`: validated on the ZeRO paper's table, Megatron-LM's
trillion-parameter run, and the bytes our own ranks hold (one 4-process launch, four layouts)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lightning_npu.planner import (
    ClusterSpec,
    Layout,
    ModelSpec,
    PlannerError,
    memory_by_stage,
    model_state_bytes,
    plan,
    round_gb,
    step_time,
)
from lightning_npu.planner.cli import main as plan_main

ROOT = Path(__file__).resolve().parents[1]


# ---- the ZeRO paper (Rajbhandari et al. 2020, Figure 1 / Table 1): 7.5B parameters, 64 devices, K=12 -----------
@pytest.mark.parametrize("stage, gb", [(0, 120.0), (1, 31.4), (2, 16.6), (3, 1.9)])
def test_zero_paper_table_exactly(stage, gb, capsys):
    # the paper's "DP" column (120 GB) is stage 0, plain data parallelism: (2 + 2 + 12) x 7.5e9 bytes
    parts = model_state_bytes(7.5e9, 64, stage, "bf16-true", "adam")
    assert round_gb(sum(parts.values())) == gb
    assert plan_main(["--memory-only", "--params", "7.5e9", "--devices", "64", "--zero-stage", str(stage),
                      "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["total_gb_rounded"] == gb and out["bytes_per_param"] == {"weights": 2, "gradients": 2, "optimizer_K": 12}
    assert plan_main(["--memory-only", "--params", "7.5e9", "--devices", "64", "--zero-stage", str(stage)]) == 0
    assert f"= {gb:.1f} GB per device" in capsys.readouterr().out


# ---- Megatron-LM's trillion-parameter run (Narayanan et al. 2021, Table 1) ---------------------------------------
TRILLION = ModelSpec(layers=128, hidden=25600, heads=160, vocab=51200, seq=2048, global_batch=3072,
                     learned_positions=True, attention="eager")  # 2021: no fused attention
# A100-80GB: 312 TFLOP/s bf16/fp16, NVLink 300 GB/s per direction, one 200 Gb/s InfiniBand HCA per GPU.
# GEMM efficiency: a single A100 reached ~150 TFLOP/s (48% of peak) in the Megatron-LM README table of the time
# (quoted in NVIDIA/Megatron-LM#76); the paper's 163 TFLOP/s on 3072 GPUs is 52%.
A100_CLUSTER = dict(devices=3072, devices_per_node=8, device_memory_gb=80, peak_tflops=312, intra_node_GBps=300,
                    inter_node_Gbps=200, gemm_efficiency=150 / 312)
PAPER = dict(precision="16-true", optimizer="adam")  # fp16 weights + fp32 master copies and Adam moments


def test_megatron_trillion_run():
    assert abs(TRILLION.num_params() / 1e12 - 1.008) < 0.002  # the paper's 1008B
    cluster = ClusterSpec(**A100_CLUSTER)
    for schedule in ("1f1b", "interleaved_1f1b"):
        ranked = plan(TRILLION, cluster, schedule=schedule, **PAPER).ranked
        assert any(e.layout.tp == 8 for e in ranked[:5]), [e.layout.describe() for e in ranked[:5]]
    # the published layout: t=8, p=64, d=6, micro-batch 1, full recomputation, interleaved schedule with the
    # scatter/gather p2p optimisation (sequence parallelism sends the same 1/t of the activations)
    published = Layout(8, 64, 6, zero_stage=0, micro_batches=512, micro_batch_size=1, recompute="full",
                       sequence_parallel=True, schedule="interleaved_1f1b")
    estimate = step_time(TRILLION, cluster, published, PAPER["precision"])
    tflops = estimate.tflops_per_device(3072)
    assert abs(tflops - 163) / 163 < 0.25, tflops
    # Megatron's FLOP count for the step: 96 B s l h^2 (1 + s/6h + V/16lh)
    b, s, l, h, v = 3072, 2048, 128, 25600, 51200
    megatron = 96 * b * s * l * h * h * (1 + s / (6 * h) + v / (16 * l * h))
    assert estimate.flops_per_step == pytest.approx(megatron, rel=0.01)
    peak = max(m.total for m in memory_by_stage(TRILLION, published, **PAPER))
    assert peak < 80e9  # it ran on 80 GB devices


# ---- bad input ----------------------------------------------------------------------------------------------------
SMALL = dict(layers=2, hidden=64, heads=4, vocab=256, seq=64, global_batch=8)


@pytest.mark.parametrize("kwargs, words", [
    (dict(SMALL, layers=-2), "`layers=-2` must be a positive integer"),
    (dict(SMALL, hidden=0), "`hidden=0` must be a positive integer"),
    (dict(SMALL, heads=6), "`heads=6` does not divide `hidden=64`"),
    (dict(SMALL, kv_heads=3), "`kv_heads=3` does not divide `heads=4`"),
    (dict(SMALL, mlp="relu"), "`mlp='relu'` is unknown"),
])
def test_bad_model_sizes(kwargs, words):
    with pytest.raises(PlannerError, match=words.replace("(", r"\(").replace(")", r"\)")):
        ModelSpec(**kwargs)


def test_more_devices_than_the_model_can_use_and_other_errors(capsys):
    # tp <= 4 (heads), pp <= 2 (layers), dp <= 8 (global batch): 64 ranks at most
    with pytest.raises(PlannerError, match=r"`devices=128` is more than any layout can use: at most .* = 64 ranks"):
        plan(ModelSpec(**SMALL), ClusterSpec(devices=128))
    with pytest.raises(PlannerError, match="`precision='fp8'` is unknown"):
        plan(ModelSpec(**SMALL), ClusterSpec(devices=8), precision="fp8")
    with pytest.raises(PlannerError, match="`gemm_efficiency=50` is a fraction"):
        ClusterSpec(devices=8, gemm_efficiency=50)
    with pytest.raises(PlannerError, match="not a whole number of nodes"):
        ClusterSpec(devices=12, devices_per_node=8)
    for argv, words in [
        (["--layers", "-1", "--hidden", "64", "--heads", "4", "--vocab", "8", "--seq", "8", "--global-batch", "8",
          "--devices", "2"], "`layers=-1` must be a positive integer"),
        (["--hidden", "64", "--devices", "2"], "missing --layers --heads --vocab --seq --global-batch"),
        (["--model", "nowhere.yaml", "--devices", "2"], "no such file"),
        (["--memory-only", "--params", "-5", "--devices", "64", "--zero-stage", "1"], "needs --params > 0"),
    ]:
        with pytest.raises(SystemExit) as exit_info:
            plan_main(argv)
        assert exit_info.value.code == 2
        assert words in capsys.readouterr().err


def test_nothing_fits_says_why(capsys):
    argv = ["--layers", "2", "--hidden", "8192", "--heads", "64", "--vocab", "32000", "--seq", "4096",
            "--global-batch", "8", "--devices", "2", "--device-memory-gb", "1"]
    assert plan_main(argv) == 1
    out = capsys.readouterr().out
    assert "no layout fits" in out and "does not fit in 0.9 GB usable per device" in out


# ---- the command line on the example configs ----------------------------------------------------------------------
def test_plan_llama_config_json_and_strategy_block(capsys, monkeypatch):
    from lightning_npu import cli

    monkeypatch.chdir(ROOT)
    cli.main(["plan", "--model", "examples/llama/config.yaml", "--devices", "8", "--json"])
    out = json.loads(capsys.readouterr().out)
    # a transformers model: the strategy refuses sequence parallelism for it, so no layout may propose it
    assert out["layouts"] and not any(r["layout"]["sequence_parallel"] for r in out["layouts"])
    assert out["model"]["attention"] == "flash"  # attn_implementation defaults to sdpa
    out["layouts"] = out["layouts"][:3]
    # the config's model block: LlamaModule(hidden_size=64, intermediate_size=176, 2 layers, 4 heads, 2 kv heads)
    assert {k: out["model"][k] for k in ("layers", "hidden", "heads", "kv_heads", "ffn", "mlp", "seq")} == dict(
        layers=2, hidden=64, heads=4, kv_heads=2, ffn=176, mlp="swiglu", seq=128)
    assert out["model"]["global_batch"] == 16  # data batch_size 8 x 2 devices
    assert len(out["layouts"]) == 3
    for row in out["layouts"]:
        assert set(row["memory_gb"]) == {"parameters", "gradients", "optimizer", "activations", "buffers", "total"}
        assert row["step_time_s"] > 0 and row["tokens_per_s"] > 0
        assert row["layout"]["tp"] <= 2  # tp must divide the 2 key/value heads
    speeds = [r["tokens_per_s"] for r in out["layouts"]]
    assert speeds == sorted(speeds, reverse=True)
    block = out["strategy_block"]
    assert "class_path: lightning_npu.NPUHybridStrategy" in block and "  strategy:" in block


def test_plan_reads_a_transformers_config_json_and_counts_its_parameters_exactly(tmp_path, capsys):
    transformers = pytest.importorskip("transformers")
    configs = [
        (transformers.LlamaConfig(hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
                                  num_key_value_heads=2, vocab_size=256, max_position_embeddings=128),
         transformers.LlamaForCausalLM, "swiglu"),
        (transformers.GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=256, n_positions=128),
         transformers.GPT2LMHeadModel, "gelu"),
    ]
    for config, cls, mlp in configs:
        config.to_json_file(tmp_path / "config.json")  # what save_pretrained writes
        assert plan_main(["--model", str(tmp_path / "config.json"), "--global-batch", "8", "--devices", "2",
                          "--json"]) == 0
        out = json.loads(capsys.readouterr().out)
        assert out["model"]["params"] == cls(config).num_parameters(), cls.__name__
        assert out["model"]["mlp"] == mlp and out["model"]["seq"] == 128  # max_position_embeddings by default
        assert not any(r["layout"]["sequence_parallel"] for r in out["layouts"])
    # the batch is the run's, not the model's: asked for by name
    with pytest.raises(SystemExit):
        plan_main(["--model", str(tmp_path / "config.json"), "--devices", "2"])
    err = capsys.readouterr().err
    assert "a transformers config.json does not give global_batch" in err and "pass --global-batch N" in err, err


def test_plan_text_uses_readable_counts_and_one_memory_unit(capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    assert plan_main(["--model", "examples/llama/config.yaml", "--devices", "2", "--top", "3"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("model: 125 K parameters (2 layers"), lines[0]
    assert lines[1].endswith("(memory per device of the stage that needs the most, in MB: 10^6 bytes):"), lines[1]
    assert "weights MB" in lines[2] and "total MB" in lines[2] and "GB" not in lines[1] + lines[2]
    assert "MB per device" in next(line for line in lines if line.startswith("# lightning-npu plan:"))


def test_strategy_block_builds_the_strategy(capsys):
    import yaml

    from lightning_npu import NPUHybridStrategy

    assert plan_main(["--model", "examples/gpt/config.yaml", "--devices", "4", "--precision", "32-true"]) == 0
    text = capsys.readouterr().out
    block = yaml.safe_load(text.split("LightningCLI config for the best layout:\n", 1)[1])
    assert block["trainer"]["devices"] == 4 and block["trainer"]["precision"] == "32-true"
    args = block["trainer"]["strategy"]["init_args"]
    strategy = NPUHybridStrategy(**args)
    cfg = strategy.parallel_config
    assert cfg.tensor_parallel_size * cfg.pipeline_parallel_size * cfg.data_parallel_size == 4


# ---- against our own runs: exact bytes per rank, four layouts, one launch ----------------------------------------
# (tp, pp, dp, zero stage, micro-batches) of the example GPT on 4 CPU processes
MEASURED = [(1, 1, 4, 1, 1), (2, 1, 2, 3, 1), (1, 2, 2, 1, 2), (2, 2, 1, 0, 2)]


@pytest.fixture(scope="module")
def measured():
    from lightning_npu.launch import spawn
    from tests._planner_workers import measure

    layouts = [dict(tensor_parallel_size=tp, pipeline_parallel_size=pp, zero_stage=z,
                    **({"micro_batches": m} if pp > 1 else {})) for tp, pp, _, z, m in MEASURED]
    return spawn(measure, 4, layouts, threads=1)


def test_memory_estimate_within_15_percent_of_measured_bytes(measured):
    from tests._planner_workers import MODEL, PER_DP_BATCH

    model = ModelSpec(layers=MODEL["n_layer"], hidden=MODEL["n_embd"], heads=MODEL["n_head"],
                      vocab=MODEL["vocab_size"], seq=MODEL["block_size"], global_batch=16, attention="flash",
                      learned_positions=True)
    worst = {}
    for i, (tp, pp, dp, zero, m) in enumerate(MEASURED):
        layout = Layout(tp, pp, dp, zero, micro_batches=m, micro_batch_size=PER_DP_BATCH // m)
        estimate = memory_by_stage(model, layout, "32-true", "adamw")
        stages = set()
        for rank in range(4):
            got = measured[rank][i]
            stages.add(got["stage"])
            for part in ("parameters", "gradients", "optimizer", "activations"):
                want = getattr(estimate[got["stage"]], part)
                assert got[part] > 0
                err = abs(want - got[part]) / got[part]
                worst[part] = max(worst.get(part, 0.0), err)
                assert err < 0.15, (layout.describe(), rank, part, want, got[part])
        assert stages == set(range(pp))
    print("largest relative error per component:", {k: round(v, 4) for k, v in worst.items()})
