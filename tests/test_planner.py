"""`lightning_npu.planner` and `lightning-npu plan`: validated on published runs (the ZeRO paper's table, Narayanan
et al. 2021 Table 1, Llama 3 405B, BLOOM 176B, Megatron-Turing NLG 530B, MosaicML's MPT benchmarks, torchtitan's Llama
3.1 on H100, Pangu Ultra 135B on Ascend; sources in docs/planning.md), the bytes our own ranks hold (one 4-process
launch, four layouts), and `--calibrate` on measured CPU runs (one of them held out) and per software stack on the
published runs (each held out, predicted from its siblings)."""

from __future__ import annotations

import dataclasses
import json
import statistics
from pathlib import Path
from typing import Callable

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
from lightning_npu.planner.search import distinct_shapes
from lightning_npu.planner.timing import StepTime

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


# ---- the formulas (issue #32) -----------------------------------------------------------------------------------
def test_activations_are_korthikanti_without_dropout():
    # Korthikanti et al. 2022, bytes per layer: s b h (10 + 24/t + 5 a s / h t), and s b h / t (34 + 5 a s / h)
    # under sequence parallelism; dropout 0 removes 2 s b h of masks and 3 a s^2 b of the softmax's dropout
    from lightning_npu.planner.memory import layer_activation_bytes

    model = ModelSpec(layers=2, hidden=4096, heads=32, vocab=256, seq=2048, global_batch=8, attention="eager")
    h, a, s, t = 4096, 32, 2048, 8
    for sp, want in [(False, 8 * h + 24 * h / t + 2 * a * s / t), (True, (32 * h + 2 * a * s) / t)]:
        got = layer_activation_bytes(model, Layout(t, 1, 1, 0, 1, 1, None, sp), 2, None)
        assert got == pytest.approx(want, rel=1e-3), (sp, got / want)  # the norms' fp32 statistics: 16 B
    # op-level selective recomputation (torchtitan's SAC, ours) keeps matmul outputs: less memory, no matmul FLOPs
    flash = ModelSpec(layers=32, hidden=4096, heads=32, vocab=32000, seq=4096, global_batch=64, mlp="swiglu",
                      ffn=11008, norm="rmsnorm")
    plain, sac = (Layout(8, 1, 8, 1, 8, 1, rc, True) for rc in (None, "selective"))
    assert layer_activation_bytes(flash, sac, 2, "selective") < 0.7 * layer_activation_bytes(flash, plain, 2, None)
    cluster = ClusterSpec(devices=64)
    t_plain, t_sac = step_time(flash, cluster, plain), step_time(flash, cluster, sac)
    assert t_sac.flops_per_step == t_plain.flops_per_step and t_plain.step_s < t_sac.step_s < 1.05 * t_plain.step_s


def test_mfu_counts_model_flops_and_hfu_adds_recomputation():
    model = ModelSpec(layers=128, hidden=25600, heads=160, vocab=51200, seq=2048, global_batch=3072)
    full = step_time(model, ClusterSpec(devices=3072), Layout(8, 64, 6, 0, 512, 1, "full"))
    b, s, l, h, v = 3072, 2048, 128, 25600, 51200
    # Narayanan et al. 2021 (hardware: recomputation included) and Korthikanti et al. 2022 (model FLOPs)
    assert full.flops_per_step == pytest.approx(96 * b * s * l * h * h * (1 + s / (6 * h) + v / (16 * l * h)), rel=0.01)
    assert full.model_flops_per_step == pytest.approx(72 * b * s * l * h * h * (1 + s / (6 * h) + v / (12 * l * h)),
                                                      rel=0.01)
    assert full.hfu(3072, 280) / full.mfu(3072, 280) == pytest.approx(full.flops_per_step / full.model_flops_per_step)


def test_tp_never_straddles_nodes():
    model = ModelSpec(layers=8, hidden=1536, heads=24, vocab=1000, seq=512, global_batch=96)
    result = plan(model, ClusterSpec(devices=48, devices_per_node=8))
    assert {e.layout.tp for e in result.ranked} <= {1, 2, 4, 8}
    assert result.rejected["tp straddles nodes (tp does not divide devices_per_node=8)"] > 0  # tp 3, 6, 12, 24


def test_other_frameworks_keep_a_full_gradient_buffer_and_gathers_are_16_bit():
    n, d = 1e9, 64
    per_param = lambda parts: sum(parts.values()) / n  # noqa: E731
    # Megatron-LM's distributed-optimizer table: 18 / 6 + 12/d (bf16), 20 / 4 + 16/d (fp16), 16 / 8 + 8/d (fp32)
    for precision, plain, distributed in [("bf16-true", 18, 6 + 12 / d), ("16-true", 20, 4 + 16 / d),
                                          ("32-true", 16, 8 + 8 / d)]:
        assert per_param(model_state_bytes(n, d, 0, precision, "adam", "megatron")) == pytest.approx(plain)
        assert per_param(model_state_bytes(n, d, 1, precision, "adam", "megatron")) == pytest.approx(distributed)
    # DeepSpeed's (the paper's) ZeRO-1 keeps the 16-bit gradients whole; ours frees them into fp32 slices
    assert model_state_bytes(n, d, 1, "bf16-true", "adam", "deepspeed")["gradients"] == 2 * n
    assert model_state_bytes(n, d, 1, "bf16-true", "adam", "lightning-npu")["gradients"] == 4 * n / d
    # ZeRO-3 under bf16-mixed gathers bf16 weights: half the buffers and gather traffic of fp32
    model = ModelSpec(layers=32, hidden=4096, heads=32, vocab=32000, seq=2048, global_batch=64)
    layout, cluster = Layout(1, 1, 64, 3, 1, 1), ClusterSpec(devices=64, inter_node_Gbps=25)
    mixed, fp32 = (memory_by_stage(model, layout, p)[0].buffers for p in ("bf16-mixed", "32-true"))
    assert mixed == pytest.approx(fp32 / 2)
    assert step_time(model, cluster, layout, "bf16-mixed").dp_comm_s < step_time(model, cluster, layout,
                                                                                  "32-true").dp_comm_s


def test_interleave_depth_is_searched():
    model = ModelSpec(layers=32, hidden=4096, heads=32, vocab=32000, seq=4096, global_batch=64)
    result = plan(model, ClusterSpec(devices=64), schedule="interleaved_1f1b", zero_stages=(1,), top=50)
    depths = {e.layout.v for e in result.ranked if e.layout.pp > 1}
    assert len(depths) > 1 and max(depths) > 2, depths


# ---- published runs: the layout that ran fits, is among the planner's top 3 shapes, within 25% of its speed ------
# Narayanan et al. 2021, Table 1: (billions of parameters, heads, hidden, layers, t, p, GPUs, batch, TFLOP/s per GPU)
NARAYANAN = [(1.7, 24, 2304, 24, 1, 1, 32, 512, 137), (3.6, 32, 3072, 30, 2, 1, 64, 512, 138),
             (7.5, 32, 4096, 36, 4, 1, 128, 512, 142), (18.4, 48, 6144, 40, 8, 1, 256, 1024, 135),
             (39.1, 64, 8192, 48, 8, 2, 512, 1536, 138), (76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140),
             (145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148), (310.1, 128, 16384, 96, 8, 16, 1920, 2160, 155),
             (529.6, 128, 20480, 105, 8, 35, 2520, 2520, 163), (1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 163)]
# A100-80GB (Selene): 312 TFLOP/s fp16, NVLink 300 GB/s per direction, one 200 Gb/s InfiniBand HCA per GPU
A100 = dict(devices_per_node=8, device_memory_gb=80, peak_tflops=312, intra_node_GBps=300, inter_node_Gbps=200)


def _check_published(model, cluster, published, measured, rate, **search):
    """The three checks of a published run: it fits, its shape is among the top 3, its speed within 25%."""
    accounting, precision = search["accounting"], search["precision"]
    peak = max(m.total for m in memory_by_stage(model, published, precision, "adam", accounting=accounting))
    assert peak <= cluster.usable_bytes, (published.describe(), peak / 1e9)
    shapes = distinct_shapes(plan(model, cluster, optimizer="adam", **search).ranked)
    shape = (published.tp, published.pp, published.dp)
    assert shape in shapes[:3], (shape, shapes[:3])
    estimate = rate(step_time(model, cluster, published, precision))
    assert abs(estimate / measured - 1) < 0.25, (published.describe(), estimate, measured)
    return estimate / measured


@pytest.mark.parametrize("row", NARAYANAN, ids=[f"{r[0]}B" for r in NARAYANAN])
def test_narayanan_2021_table_1(row):
    billions, heads, hidden, layers, t, p, gpus, batch, tflops = row
    model = ModelSpec(layers=layers, hidden=hidden, heads=heads, vocab=51200, seq=2048, global_batch=batch, bias=True,
                      tied_embeddings=True, learned_positions=True, attention="eager")  # 2021: no fused attention
    assert round(model.num_params() / 1e9, 1) == billions  # the paper's 12 l h^2 (1 + 13/12h + (V + s)/12lh)
    cluster = ClusterSpec(devices=gpus, **A100)  # the default efficiency (0.5)
    d = gpus // (t * p)
    # what Megatron-LM had in 2021: fp16 with fp32 masters, no distributed optimizer nor sequence parallelism, full
    # recomputation, the interleaved schedule under pp; micro-batch 1 (the paper's choice for its large runs)
    published = Layout(t, p, d, 0, batch // d, 1, "full", schedule="interleaved_1f1b" if p > 1 else "1f1b")
    _check_published(model, cluster, published, tflops, lambda s: s.tflops_per_device(gpus), precision="16-true",
                     accounting="megatron", zero_stages=(0,), recompute=("full",), sequence_parallel=(False,),
                     schedule="interleaved_1f1b")


# Llama 3 405B (The Llama 3 Herd of Models, Table 4): 8K sequences, 16M tokens per step, H100-80GB (989 TFLOP/s bf16,
# NVLink 450 GB/s per direction, 400 Gb/s RoCE per GPU); tp 8 x pp 16 x dp 128 at 400 TFLOP/s (16K GPUs) and
# dp 64 at 430 TFLOP/s (8K GPUs), model FLOPs; FSDP keeping the weights after forward (our ZeRO-2), bf16
LLAMA3_405B = ModelSpec(layers=126, hidden=16384, heads=128, kv_heads=8, ffn=53248, vocab=128256, seq=8192,
                        global_batch=2048, mlp="swiglu", norm="rmsnorm")
H100 = dict(devices_per_node=8, device_memory_gb=80, peak_tflops=989, intra_node_GBps=450, inter_node_Gbps=400)


@pytest.mark.parametrize("gpus, dp, tflops", [(16384, 128, 400), (8192, 64, 430)])
def test_llama3_405b(gpus, dp, tflops):
    assert LLAMA3_405B.num_params() / 1e9 == pytest.approx(405, rel=0.01)
    cluster = ClusterSpec(devices=gpus, **H100)
    # micro-batch 1 (batch per dp rank = micro-batches); the depth v is not published: 7 is the deepest for 126
    # layers on 16 stages. The paper trained without activation checkpointing; our activation model needs
    # op-level selective recomputation to fit these layouts (see docs/planning.md)
    published = Layout(8, 16, dp, 2, 2048 // dp, 1, "selective", True, "interleaved_1f1b", 7)
    _check_published(LLAMA3_405B, cluster, published, tflops, lambda s: s.model_tflops_per_device(gpus),
                     precision="bf16-true", accounting="paper", zero_stages=(1, 2), schedule="interleaved_1f1b")


# BLOOM 176B (BigScience, Megatron-DeepSpeed): tr11-176B-ml's README and slurm script. 384 A100-80GB (48 nodes of 8,
# NVLink inside, four 100 Gb/s Omni-Path links per node: 50 Gb/s per GPU); tp 4 x pp 12 x dp 8, micro-batch 2, global
# batch 2048 x 2048 tokens, bf16 with DeepSpeed's BF16 optimizer (its ZeRO-1), full activation checkpointing, 1F1B,
# ALiBi, tied embeddings (vocab padded to 250880); "about 150 TFLOPs" per GPU, hardware FLOPs (their 4 x 2 coefficient)
BLOOM = ModelSpec(layers=70, hidden=14336, heads=112, vocab=250880, seq=2048, global_batch=2048, bias=True,
                  tied_embeddings=True, attention="eager")


def test_bloom_176b():
    assert round(BLOOM.num_params() / 1e9) == 176
    cluster = ClusterSpec(devices=384, inter_node_Gbps=50, **{k: A100[k] for k in A100 if k != "inter_node_Gbps"})
    published = Layout(4, 12, 8, 1, 128, 2, "full")
    ratio = _check_published(BLOOM, cluster, published, 150, lambda s: s.tflops_per_device(384),
                             precision="bf16-mixed", accounting="deepspeed", zero_stages=(0, 1), recompute=("full",),
                             sequence_parallel=(False,))
    assert 0.75 < ratio < 1.0  # 0.84: the estimate is below what they measured, as for Narayanan's large rows


# Megatron-Turing NLG 530B (Smith et al. 2022, section 2): the same shape as Narayanan's 529.6B row (105 layers, hidden
# 20480, 128 heads, seq 2048, vocab 51200 padded for tp 8) trained with DeepSpeed + Megatron on DGX A100s: tp 8 x pp
# 35 x dp 8/10/12 on 280/350/420 nodes, global batch 1920, 60.1/50.2/44.4 s per step, 126/121/113 TFLOP/s per GPU
# (hardware FLOPs: Megatron's count, recomputation included). DeepSpeed's 1F1B pipeline (not interleaved), its ZeRO-1,
# full recomputation, fused attention not yet (eager). The micro-batch is not in the sources found: the search picks it.
@pytest.mark.parametrize("gpus, step_s, tflops", [(2240, 60.1, 126), (2800, 50.2, 121), (3360, 44.4, 113)])
def test_megatron_turing_nlg_530b(gpus, step_s, tflops):
    model = ModelSpec(layers=105, hidden=20480, heads=128, vocab=51200, seq=2048, global_batch=1920, bias=True,
                      tied_embeddings=True, learned_positions=True, attention="eager")
    assert round(model.num_params() / 1e9) == 530
    cluster = ClusterSpec(devices=gpus, **A100)
    dp = gpus // (8 * 35)
    published = Layout(8, 35, dp, 1, 1920 // dp, 1, "full")
    ratio = _check_published(model, cluster, published, tflops, lambda s: s.tflops_per_device(gpus),
                             precision="bf16-mixed", accounting="deepspeed", zero_stages=(0, 1), recompute=("full",),
                             sequence_parallel=(False,))
    assert 0.9 < ratio <= 1.0  # 0.95, 0.96, 1.00: the step times 62.9, 52.0, 44.7 s against 60.1, 50.2, 44.4
    assert step_time(model, cluster, published, "bf16-mixed").step_s == pytest.approx(step_s, rel=0.06)


# Pangu Ultra 135B (Yin et al. 2025, the technical report, sections 2, 3.1.3 and 4): trained on 8,192 Ascend NPUs of
# Atlas 800T A2 servers (8 per node on an HCCS full mesh, 64 GB each, 200 Gb/s RoCE between nodes) with MindSpeed and
# Megatron. 94 layers, hidden 12288, SwiGLU 28672, 96 query and 8 key/value heads, vocab 153376 (the tokenizer's),
# untied, RMSNorm (their sandwich norm adds two norms per layer: 2.3M parameters, not counted), seq 4096, global batch
# 2048 (the main phase). tp 8 with sequence parallelism x pp 8 x dp 128 "with ZeRO" (Megatron's distributed
# optimizer: our ZeRO-1, its accounting), interleaved with 6 virtual stages. The micro-batch follows from their bubble
# ratios: (p - 1)/(p - 1 + n) = 30.45% gives n = 16 micro-batches per dp rank, so micro-batch 1 of the 16 sequences
# per rank, and 7/(7 + 6 x 16) = 6.8%, their interleaved figure. Published MFU (PaLM's definition): about 43% for
# this layout (section 4.2), over 52% after kernel fusion, MC2 (tp communication overlapped with the matmuls) and the
# rest of section 4.3, which the planner does not model; the check is against the 43%. Recomputation is not stated:
# the layout fits without it, so none. The report gives no peak: 313 TFLOP/s is the 16-bit figure FlagPerf's Ascend
# training configs use (sources in docs/planning.md); MFU is a ratio, and the result barely moves across 280-376.
PANGU_ULTRA = ModelSpec(layers=94, hidden=12288, heads=96, kv_heads=8, ffn=28672, vocab=153376, seq=4096,
                        global_batch=2048, mlp="swiglu", norm="rmsnorm")


@pytest.mark.parametrize("peak, want", [(313, 0.92), (280, 0.94), (376, 0.90)])
def test_pangu_ultra_135b_on_ascend(peak, want):
    assert PANGU_ULTRA.num_params() / 1e9 == pytest.approx(135, rel=0.01)  # 133.9B
    cluster = ClusterSpec(devices=8192, devices_per_node=8, device_memory_gb=64, peak_tflops=peak,
                          intra_node_GBps=392, inter_node_Gbps=200)
    published = Layout(8, 8, 128, 1, 16, 1, None, True, "interleaved_1f1b", 6)
    ratio = _check_published(PANGU_ULTRA, cluster, published, 0.43, lambda s: s.mfu(8192, peak),
                             precision="bf16-true", accounting="megatron", zero_stages=(1,),
                             schedule="interleaved_1f1b")
    assert ratio == pytest.approx(want, abs=0.01)  # below the published, as for the large Megatron rows
    shapes = distinct_shapes(plan(PANGU_ULTRA, cluster, optimizer="adam", precision="bf16-true", accounting="megatron",
                                  zero_stages=(1,), schedule="interleaved_1f1b").ranked)
    assert shapes[:2] == [(8, 4, 256), (8, 8, 128)]  # second, after pp 4 x dp 256


# MosaicML's llm-foundry benchmarks (scripts/train/benchmarking/README.md): MPT models under PyTorch FSDP FULL_SHARD
# (our ZeRO-3, dp only), bf16, seq 2048, vocab 50368, tied embeddings; their parameter count (biases and 2048 learned
# positions included) is the one below, to the parameter. Per row: (name, layers, hidden, heads, GPU, GPUs,
# micro-batch, accumulation, global batch, activation checkpointing, published MFU %). Composer trains dp only, so
# the shape check is the recomputation policy the planner picks for that shape.
MPT = [("70b", 80, 8192, 64, "h100", 64, 8, 4, 2048, True, 42.57),
       ("30b", 48, 7168, 64, "h100", 32, 14, 3, 1344, True, 43.92),
       ("7b", 32, 4096, 32, "h100", 8, 6, 1, 48, False, 46.44),
       ("13b", 40, 5120, 40, "a100", 8, 2, 3, 48, False, 59.57),
       pytest.param(("70b", 80, 8192, 64, "a100", 64, 8, 4, 2048, True, 53.33), marks=pytest.mark.xfail(
           strict=True, reason="estimated 0.70x: the estimate is all compute (ZeRO-3's traffic hides behind each "
                               "micro-batch), so it runs at HFU = gemm_efficiency = 0.5, and the published HFU is "
                               "71.1% (0.5 / 0.711 = 0.70); coming within 25% needs gemm_efficiency >= 0.534. See "
                               "test_mosaicml_a100_70b_is_bound_by_the_efficiency and docs/planning.md"))]
MPT_PARAMS = {"70b": 64862437376, "30b": 29975214080, "7b": 6658859008, "13b": 12853954560}


@pytest.mark.parametrize("row", MPT, ids=lambda r: f"mpt-{r[0]}-{r[4]}x{r[5]}")
def test_mosaicml_mpt_under_fsdp(row):
    name, layers, hidden, heads, gpu, gpus, mbs, accumulate, batch, checkpointing, mfu = row
    model = ModelSpec(layers=layers, hidden=hidden, heads=heads, vocab=50368, seq=2048, global_batch=batch, bias=True,
                      tied_embeddings=True, learned_positions=True)
    assert model.num_params() == MPT_PARAMS[name]
    device = dict(A100, inter_node_Gbps=200) if gpu == "a100" else dict(H100)  # 1600 Gb/s RoCE per 8-GPU node
    cluster = ClusterSpec(devices=gpus, **device)
    published = Layout(1, 1, gpus, 3, accumulate, mbs, "full" if checkpointing else None)
    peak = max(m.total for m in memory_by_stage(model, published, "bf16-mixed", "adam", accounting="paper"))
    assert peak <= cluster.usable_bytes, peak / 1e9
    ranked = plan(model, cluster, optimizer="adam", zero_stages=(3,), recompute=(None, "full"),
                  sequence_parallel=(False,), micro_batch_sizes=(mbs,), accounting="paper").ranked
    best = next(e.layout for e in ranked if (e.layout.tp, e.layout.pp) == (1, 1))
    assert best.recompute == published.recompute, best.describe()  # full recomputation exactly where they needed it
    estimate = step_time(model, cluster, published, "bf16-mixed").mfu(gpus, device["peak_tflops"])
    assert abs(estimate / (mfu / 100) - 1) < 0.25, (estimate, mfu)


def test_mosaicml_a100_70b_is_bound_by_the_efficiency():
    """Why the A100 70B row is 0.70x (its xfail above): no communication is exposed (FSDP's bf16 gathers and fp32
    reduce-scatters of 65 B parameters take 20 s per micro-batch on 200 Gb/s per GPU; 8 x 2048 tokens compute for 57 s),
    so the estimate runs at HFU = gemm_efficiency. The row's "bf16 / PURE" (gradients reduced in bf16) changes nothing.
    MosaicML's 53.3% MFU is 71.1% HFU with full recomputation: within 25% needs an efficiency of 0.534 or more."""
    model = ModelSpec(layers=80, hidden=8192, heads=64, vocab=50368, seq=2048, global_batch=2048, bias=True,
                      tied_embeddings=True, learned_positions=True)
    published = Layout(1, 1, 64, 3, 4, 8, "full")
    for precision in ("bf16-mixed", "bf16-true"):
        time = step_time(model, ClusterSpec(devices=64, **A100), published, precision)
        assert time.dp_comm_s == time.tp_comm_s == time.pipeline_s == 0 and time.step_s == time.compute_s
        assert time.hfu(64, 312) == pytest.approx(0.5) and time.mfu(64, 312) / 0.5333 == pytest.approx(0.704, abs=1e-3)
    for efficiency, within in ((0.53, False), (0.54, True)):
        time = step_time(model, ClusterSpec(devices=64, gemm_efficiency=efficiency, **A100), published)
        assert (time.mfu(64, 312) / 0.5333 > 0.75) == within


# torchtitan's Llama 3.1 405B run (docs/performance.md, its "Llama 3.1 performance numbers"): 128 H100 (Grand Teton:
# 8 per host on NVLink, 400 Gb/s RDMA per GPU, 95 GB HBM2e, 500 W), FSDP2 16 x TP 8 (with sequence parallelism), local
# batch 2 of 8192 tokens (global 32), full activation checkpointing, bf16 (FSDP2 gathers bf16, reduces fp32), no
# Float8: 109 tokens/s per GPU, 29.0% MFU against the SXM peak (989). Their footnote: the power-capped HBM2e parts'
# real peak lies between the SXM's and the NVL's (835), exact value unknown; the test runs both. Searched as
# torchtitan's FSDP2 ran then: ZeRO-2/3 (reshard after forward or not), everything else open.
@pytest.mark.parametrize("peak, rank, want", [(989, 0, 1.17), (835, 1, 1.00)])
def test_torchtitan_llama31_405b_on_h100(peak, rank, want):
    model = dataclasses.replace(LLAMA3_405B, global_batch=32)
    cluster = ClusterSpec(devices=128, **dict(H100, device_memory_gb=95, peak_tflops=peak))
    published = Layout(8, 1, 16, 3, 1, 2, "full", True)
    ratio = _check_published(model, cluster, published, 109, lambda s: 32 * 8192 / s.step_s / 128,
                             precision="bf16-mixed", accounting="lightning-npu", zero_stages=(2, 3))
    assert ratio == pytest.approx(want, abs=0.01)
    assert distinct_shapes(plan(model, cluster, zero_stages=(2, 3)).ranked).index((8, 1, 16)) == rank
    # the same model FLOPs as theirs: 109 tokens/s per GPU is 29.0% of 989
    time = step_time(model, cluster, published)
    assert time.mfu(128, 989) * 109 / (32 * 8192 / time.step_s / 128) == pytest.approx(0.290, abs=0.002)


# torchtitan's op-level selective checkpointing (their Llama 3.1 8B row below): every matmul output is saved but every
# second one of a block in forward order (wq, wk, wv, wo, w1, w3, w2: wk, wo and w3 are replayed)
TT_8B = ModelSpec(layers=32, hidden=4096, heads=32, kv_heads=8, ffn=14336, vocab=128256, seq=8192, global_batch=16,
                  mlp="swiglu", norm="rmsnorm")


def test_torchtitan_op_level_checkpointing_replays_every_second_matmul():
    from lightning_npu.planner.memory import layer_activation_bytes

    h, kv, f, tokens = 4096, 1024, 14336, 16 * 8192
    cluster = ClusterSpec(devices=8, **H100)
    ours, theirs = (Layout(1, 1, 8, 3, 1, 2, rc) for rc in ("selective", "selective_alternate"))
    t_ours, t_theirs = step_time(TT_8B, cluster, ours), step_time(TT_8B, cluster, theirs)
    # one more forward of wk, wo and w3 per block: hardware FLOPs, not model FLOPs
    assert t_theirs.flops_per_step - t_ours.flops_per_step == pytest.approx(2 * h * (kv + h + f) * 32 * tokens)
    assert t_theirs.model_flops_per_step == t_ours.model_flops_per_step
    assert t_theirs.flops_per_step / t_ours.flops_per_step == pytest.approx(1.088, abs=1e-3)
    # their outputs are not kept: k, wo's output and w3's (bf16), per token and block
    assert layer_activation_bytes(TT_8B, ours, 2, "selective") - layer_activation_bytes(
        TT_8B, theirs, 2, "selective_alternate") == pytest.approx(2 * (kv + h + f))
    # under tp, replaying wo replays its all-reduce (one more per block; GELU's down projection a second)
    tp = [step_time(TT_8B, cluster, Layout(8, 1, 1, 1, 16, 1, rc)).tp_comm_s for rc in ("selective",
                                                                                       "selective_alternate")]
    assert tp[1] / tp[0] == pytest.approx(5 / 4)
    # costed for other frameworks' runs, never proposed: the strategy's activation_checkpointing does not run it
    with pytest.raises(PlannerError, match="'selective_alternate' .* not searched: the strategy"):
        plan(TT_8B, cluster, recompute=(None, "selective_alternate"))


# docs/performance.md, Table 1: Llama 3.1 8B, FSDP on 8 GPUs, local batch 2 (global 16), selective (op) AC, no
# torch.compile nor Float8: 5,762 tokens/s per GPU (33.7% MFU at 989), 82.4 GiB. Their footnote puts the 500 W parts'
# peak between the NVL's 835 and the SXM's 989 TFLOP/s: at 835 the estimate is 1.13x; at 989, 1.33x (strict xfail)
@pytest.mark.parametrize("peak, want", [
    (835, 1.13),
    pytest.param(989, 1.33, marks=pytest.mark.xfail(
        strict=True, reason="estimated 1.33x of the 5,762 tokens/s per GPU at the SXM's 989 TFLOP/s (1.13x at the "
                            "NVL's 835: the 500 W parts' peak lies between, their footnote says)"))])
def test_torchtitan_llama31_8b_fsdp_on_8_h100(peak, want):
    cluster = ClusterSpec(devices=8, **dict(H100, device_memory_gb=95, peak_tflops=peak))
    ratio = _check_published(TT_8B, cluster, Layout(1, 1, 8, 3, 1, 2, "selective_alternate"), 5762,
                             lambda s: 16 * 8192 / s.step_s / 8, precision="bf16-mixed", accounting="lightning-npu",
                             zero_stages=(2, 3))
    assert ratio == pytest.approx(want, abs=0.01)


# ---- calibrated on sibling runs: one efficiency per software stack (issue #32) -------------------------------------
# No single gemm_efficiency fits every stack (0.37-0.71 above); --calibrate fits one. Here each published run is held
# out in turn and predicted at the efficiency the planner's own fit (`fit_efficiency`, what --calibrate computes from
# a measured step) gives on its siblings: the other runs of the same software on the same GPU (their median where
# there are several; the one sibling's in a pair). Pangu Ultra has one run (its three peaks are one run): no sibling.
@dataclasses.dataclass(frozen=True)
class _Run:
    """A published run as `_check_published` takes it; `search`: what its framework could run (plan()'s keywords)."""

    name: str
    model: ModelSpec
    cluster: ClusterSpec
    layout: Layout
    published: float
    rate: Callable[[StepTime], float]
    search: dict

    def fitted_efficiency(self) -> float:
        """The efficiency --calibrate would fit to this run: its step time is what the published figure implies
        (every figure here is a constant over the step time)."""
        from lightning_npu.planner.calibrate import fit_efficiency

        time = step_time(self.model, self.cluster, self.layout, self.search["precision"])
        return fit_efficiency(self.model, self.cluster, self.layout, time.step_s * self.rate(time) / self.published,
                              self.search["precision"])

    def check(self, efficiency: float) -> float:
        return _check_published(self.model, dataclasses.replace(self.cluster, gemm_efficiency=efficiency),
                                self.layout, self.published, self.rate, **self.search)


def _stacks() -> dict[str, list[_Run]]:
    """The published runs above, by software stack and GPU (the same inputs as their own tests)."""
    per_device = lambda gpus, model_flops=False: (  # noqa: E731
        lambda s: s.model_tflops_per_device(gpus) if model_flops else s.tflops_per_device(gpus))
    megatron = dict(precision="16-true", accounting="megatron", zero_stages=(0,), recompute=("full",),
                    sequence_parallel=(False,), schedule="interleaved_1f1b")
    deepspeed = dict(precision="bf16-mixed", accounting="deepspeed", zero_stages=(0, 1), recompute=("full",),
                     sequence_parallel=(False,))
    out: dict[str, list[_Run]] = {"Megatron-LM, A100": [], "DeepSpeed + Megatron, A100": [], "Llama 3 (Meta), H100": [],
                                  "llm-foundry, A100": [], "llm-foundry, H100": []}
    for billions, heads, hidden, layers, t, p, gpus, batch, tflops in NARAYANAN:
        model = ModelSpec(layers=layers, hidden=hidden, heads=heads, vocab=51200, seq=2048, global_batch=batch,
                          bias=True, tied_embeddings=True, learned_positions=True, attention="eager")
        d = gpus // (t * p)
        layout = Layout(t, p, d, 0, batch // d, 1, "full", schedule="interleaved_1f1b" if p > 1 else "1f1b")
        out["Megatron-LM, A100"].append(_Run(f"{billions}B", model, ClusterSpec(devices=gpus, **A100), layout, tflops,
                                             per_device(gpus), megatron))
    bloom_cluster = ClusterSpec(devices=384, inter_node_Gbps=50, **{k: A100[k] for k in A100 if k != "inter_node_Gbps"})
    out["DeepSpeed + Megatron, A100"].append(_Run("BLOOM 176B", BLOOM, bloom_cluster,
                                                  Layout(4, 12, 8, 1, 128, 2, "full"), 150, per_device(384), deepspeed))
    mtnlg = ModelSpec(layers=105, hidden=20480, heads=128, vocab=51200, seq=2048, global_batch=1920, bias=True,
                      tied_embeddings=True, learned_positions=True, attention="eager")
    for gpus, tflops in [(2240, 126), (2800, 121), (3360, 113)]:
        dp = gpus // (8 * 35)
        out["DeepSpeed + Megatron, A100"].append(_Run(f"MT-NLG x{gpus}", mtnlg, ClusterSpec(devices=gpus, **A100),
                                                      Layout(8, 35, dp, 1, 1920 // dp, 1, "full"), tflops,
                                                      per_device(gpus), deepspeed))
    for gpus, dp, tflops in [(16384, 128, 400), (8192, 64, 430)]:
        out["Llama 3 (Meta), H100"].append(_Run(
            f"405B x{gpus}", LLAMA3_405B, ClusterSpec(devices=gpus, **H100),
            Layout(8, 16, dp, 2, 2048 // dp, 1, "selective", True, "interleaved_1f1b", 7), tflops,
            per_device(gpus, model_flops=True),
            dict(precision="bf16-true", accounting="paper", zero_stages=(1, 2), schedule="interleaved_1f1b")))
    for row in MPT:
        name, layers, hidden, heads, gpu, gpus, mbs, accumulate, batch, checkpointing, mfu = getattr(row, "values",
                                                                                                     (row,))[0]
        model = ModelSpec(layers=layers, hidden=hidden, heads=heads, vocab=50368, seq=2048, global_batch=batch,
                          bias=True, tied_embeddings=True, learned_positions=True)
        device = dict(A100, inter_node_Gbps=200) if gpu == "a100" else dict(H100)
        out[f"llm-foundry, {gpu.upper()}"].append(_Run(
            f"MPT {name}", model, ClusterSpec(devices=gpus, **device),
            Layout(1, 1, gpus, 3, accumulate, mbs, "full" if checkpointing else None), mfu / 100,
            (lambda g, peak: lambda s: s.mfu(g, peak))(gpus, device["peak_tflops"]),
            dict(precision="bf16-mixed", accounting="paper", zero_stages=(3,), recompute=(None, "full"),
                 sequence_parallel=(False,), micro_batch_sizes=(mbs,))))
    titan = dict(precision="bf16-mixed", accounting="lightning-npu", zero_stages=(2, 3))
    for peak in (989, 835):
        device = dict(H100, device_memory_gb=95, peak_tflops=peak)
        out[f"torchtitan, H100 at {peak}"] = [
            _Run("405B", dataclasses.replace(LLAMA3_405B, global_batch=32), ClusterSpec(devices=128, **device),
                 Layout(8, 1, 16, 3, 1, 2, "full", True), 109, lambda s: 32 * 8192 / s.step_s / 128, titan),
            _Run("8B", TT_8B, ClusterSpec(devices=8, **device), Layout(1, 1, 8, 3, 1, 2, "selective_alternate"), 5762,
                 lambda s: 16 * 8192 / s.step_s / 8, titan)]
    return out


def _sibling_efficiency(runs: list[_Run], held: _Run) -> float:
    return statistics.median(r.fitted_efficiency() for r in runs if r is not held)


# estimated / published after calibrating on the siblings: the default's two misses (strict xfails above) among them
CALIBRATED = {"llm-foundry, A100": {"MPT 70b": 0.84, "MPT 13b": 1.19},
              "torchtitan, H100 at 989": {"8B": 1.13, "405B": 0.90}}


@pytest.mark.parametrize("stack", ["Megatron-LM, A100", "DeepSpeed + Megatron, A100", "Llama 3 (Meta), H100",
                                   "llm-foundry, A100", "llm-foundry, H100", "torchtitan, H100 at 989",
                                   "torchtitan, H100 at 835"])
def test_calibrated_on_its_siblings_every_published_run_is_predicted(stack):
    """Every run of the stack held out in turn: it fits, its shape is among the top 3 and its speed within 25% at
    the efficiency fitted on the other runs of its stack, never on itself."""
    runs = _stacks()[stack]
    assert len(runs) >= 2
    ratios = {}
    for held in runs:
        efficiency = _sibling_efficiency(runs, held)
        ratios[held.name] = held.check(efficiency)
        print(f"{stack}: {held.name} at {efficiency:.3f} (fitted on its siblings): {ratios[held.name]:.3f}x")
    for name, want in CALIBRATED.get(stack, {}).items():
        assert ratios[name] == pytest.approx(want, abs=0.01), (name, ratios[name])


def test_an_efficiency_calibrated_on_another_stack_misses():
    """The bound can fail: the same GPU, another software stack. MosaicML's H100 runs at torchtitan's efficiency
    (fitted at 989, their SXM peak) come out too slow, torchtitan's 8B at MosaicML's too fast: beyond 25%."""
    stacks = _stacks()
    titan, mosaic = stacks["torchtitan, H100 at 989"], stacks["llm-foundry, H100"]
    at_titan = statistics.median(r.fitted_efficiency() for r in titan)
    at_mosaic = statistics.median(r.fitted_efficiency() for r in mosaic)
    misses = {}
    for run, efficiency in [*((r, at_titan) for r in mosaic), (titan[1], at_mosaic)]:
        time = step_time(run.model, dataclasses.replace(run.cluster, gemm_efficiency=efficiency), run.layout,
                         run.search["precision"])
        misses[run.name] = round(run.rate(time) / run.published, 2)
    print(f"torchtitan's {at_titan:.3f} and MosaicML's {at_mosaic:.3f}: estimated / published {misses}")
    assert misses["MPT 70b"] < 0.75 and misses["MPT 30b"] < 0.75 and misses["8B"] > 1.25, misses


def test_context_parallelism_is_searched_where_the_strategy_composes_it(capsys):
    """cp splits each sequence: activations per rank 1/cp (ring attention keeps only the rank's keys and values),
    model state sharded over dp x cp, K/V passed around the ring per block; searched with pp, without sp, ep or
    selective recomputation."""
    model = ModelSpec(layers=32, hidden=4096, heads=32, kv_heads=8, ffn=14336, vocab=128256, seq=131072, global_batch=8,
                      mlp="swiglu", norm="rmsnorm")
    cluster = ClusterSpec(devices=64, **H100)
    whole, half = (memory_by_stage(model, Layout(8, 1, dp, 1, 8 // dp, 1, cp=cp))[0] for dp, cp in ((8, 1), (4, 2)))
    assert half.activations / whole.activations == pytest.approx(0.5, abs=0.01)
    assert half.optimizer == whole.optimizer  # ZeRO-1 over dp x cp = 8 ranks in both
    assert step_time(model, cluster, Layout(8, 1, 4, 1, 2, 1, cp=2)).tp_comm_s > \
        step_time(model, cluster, Layout(8, 1, 8, 1, 1, 1)).tp_comm_s  # + the K/V ring passes
    ranked = plan(model, cluster).ranked
    split = [e.layout for e in ranked if e.layout.cp > 1]
    assert split and ranked[0].layout.cp == 1  # ranked among the rest (4th here: cp8 x tp2, 0.99x the best)
    assert all(not lay.sequence_parallel and lay.recompute != "selective" for lay in split)
    assert {"context_parallel_size": split[0].cp}.items() <= split[0].strategy_init_args().items()
    eager = plan(dict(vars(model), attention="eager", seq=8192), ClusterSpec(devices=8, **H100)).ranked
    assert all(e.layout.cp == 1 for e in eager)  # the strategy's context parallelism needs SDPA attention
    plan_main(["--layers", "32", "--hidden", "4096", "--heads", "32", "--kv-heads", "8", "--ffn", "14336", "--vocab",
               "128256", "--seq", "131072", "--global-batch", "8", "--mlp", "swiglu", "--devices", "64", "--top", "8"])
    out = capsys.readouterr().out  # the CLI's default device (64 GB): cp x tp ranks first, a cp column, the block
    assert " cp " in next(line for line in out.splitlines() if line.startswith("#  tp"))
    assert "context_parallel_size: " in out


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
    assert out["model"]["global_batch"] == 32  # data batch_size 8 x 4 devices
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
        (transformers.MixtralConfig(hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
                                    num_key_value_heads=2, vocab_size=256, max_position_embeddings=128,
                                    num_local_experts=4, num_experts_per_tok=2),
         transformers.MixtralForCausalLM, "swiglu"),
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


def test_expert_parallelism_is_searched_with_its_memory_and_all_to_all():
    """A MoE model: ep splits each layer's experts (their weights, gradients and optimizer state: ZeRO shards them over
    the dp / ep ranks that hold the same experts), costs all-to-alls, and is searched where the strategy runs it."""
    mixtral = ModelSpec(layers=32, hidden=4096, heads=32, kv_heads=8, ffn=14336, vocab=32000, seq=4096,
                        global_batch=512, mlp="swiglu", norm="rmsnorm", experts=8, experts_per_token=2)
    assert mixtral.num_params() == pytest.approx(46.70e9, rel=1e-3)  # Mixtral 8x7B
    # 2 of 8 experts per token: the step's FLOPs follow the active parameters (12.9B of 46.7B), not all of them
    active = mixtral.layers * mixtral.layer_active_params() + mixtral.embedding_params() + mixtral.head_params()
    assert active == pytest.approx(12.88e9, rel=1e-3)
    cluster = ClusterSpec(devices=64, device_memory_gb=80, peak_tflops=989)
    base = Layout(tp=1, pp=4, dp=16, zero_stage=0, micro_batches=32, micro_batch_size=1)
    experts = mixtral.layers / 4 * mixtral.layer_expert_params()  # one stage's experts, whole
    for ep in (2, 8):
        split = Layout(1, 4, 16, 0, 32, 1, ep=ep)
        one, many = memory_by_stage(mixtral, base, "bf16-mixed")[0], memory_by_stage(mixtral, split, "bf16-mixed")[0]
        assert one.parameters - many.parameters == pytest.approx(experts * (1 - 1 / ep) * 4)  # fp32 weights
        assert one.optimizer - many.optimizer == pytest.approx(experts * (1 - 1 / ep) * 8)
        assert step_time(mixtral, cluster, split).tp_comm_s > step_time(mixtral, cluster, base).tp_comm_s  # all-to-all
    # ZeRO-3 shards the experts over dp / ep = 2 ranks, the rest over dp = 16
    z3 = memory_by_stage(mixtral, Layout(1, 1, 16, 3, 32, 1, ep=8), "bf16-mixed")[0]
    dense = mixtral.num_params() - mixtral.layers * mixtral.layer_expert_params()
    assert z3.parameters == pytest.approx(dense * 4 / 16 + mixtral.layers * mixtral.layer_expert_params() / 8 * 4 / 2)
    # ZeRO-1: the experts' fp32 masters and AdamW moments (12 bytes a parameter) over ep x (dp / ep) = dp ranks, their
    # bf16 weights and fp32 gradients whole on each ep rank; the rest over dp = 16
    z1 = memory_by_stage(mixtral, Layout(1, 1, 16, 1, 32, 1, ep=8), "bf16-mixed")[0]
    no_ep = memory_by_stage(mixtral, Layout(1, 1, 16, 1, 32, 1), "bf16-mixed")[0]
    local = mixtral.layers * mixtral.layer_expert_params() / 8
    assert z1.optimizer == pytest.approx(dense * 12 / 16 + local * 12 / 2)
    assert no_ep.optimizer - z1.optimizer == pytest.approx(mixtral.layers * mixtral.layer_expert_params() * 12 / 16
                                                        - local * 12 / 2)
    result = plan(mixtral, cluster)
    eps = {e.layout.zero_stage for e in result.ranked if e.layout.ep > 1}
    assert 1 in eps, eps  # ZeRO-1 (the default) is searched with ep, as the strategy composes it
    best_ep = next(e for e in result.ranked if e.layout.ep > 1)
    assert best_ep.layout.strategy_init_args()["expert_parallel_size"] == best_ep.layout.ep
    assert f"ep{best_ep.layout.ep}" in best_ep.layout.describe()


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
        estimate = memory_by_stage(model, layout, "32-true", "adamw", accounting="lightning-npu-gloo")  # CPU runs
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


# ---- --calibrate: a measured 2-process CPU run -----------------------------------------------------------------------
def _train_example_gpt(root_dir, *overrides: str) -> None:
    """`lightning-npu fit` of the example GPT (2 CPU processes) for 10 steps, logging every step, with MemoryMonitor."""
    import subprocess
    import sys

    from tests._callbacks_helpers import clean_env

    script = Path(sys.executable).with_name("lightning-npu")
    cmd = [str(script)] if script.exists() else [sys.executable, "-m", "lightning_npu.cli"]
    cmd += ["fit", "--config", str(ROOT / "examples/gpt/config.yaml"), "--trainer.max_steps", "10",
            "--trainer.limit_val_batches", "0", "--trainer.log_every_n_steps", "1",
            "--trainer.enable_progress_bar", "false", "--trainer.default_root_dir", str(root_dir),
            "--trainer.callbacks+=lightning_npu.callbacks.MemoryMonitor", *overrides]
    proc = subprocess.run(cmd, cwd=ROOT, env=clean_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]


def test_calibrate_on_a_measured_cpu_run(tmp_path, capsys):
    _train_example_gpt(tmp_path, "--model.init_args.n_layer", "2", "--model.init_args.n_embd", "32",
                       "--data.init_args.block_size", "32", "--model.init_args.block_size", "32")
    assert plan_main(["--calibrate", str(tmp_path), "--json", "--top", "3"]) == 0
    out = json.loads(capsys.readouterr().out)
    cal = out["calibration"]
    assert cal["layout"].startswith("tp1 pp2 dp1")  # the example config's pipeline, read from the run's config.yaml
    # before: the default 280 TFLOP/s device at 50%, far off for a CPU; after: the run's median step within 25%
    assert cal["uncalibrated_step_s"] < 0.1 * cal["measured_step_s"]
    assert abs(cal["predicted_step_s"] / cal["measured_step_s"] - 1) < 0.25, cal
    assert 0.8 < cal["memory_overhead"] < 1.25, cal  # the tensors MemoryMonitor counts against the estimate's
    assert out["layouts"] and out["cluster"]["gemm_efficiency"] == pytest.approx(cal["efficiency"])
    with pytest.raises(SystemExit):
        plan_main(["--calibrate", str(tmp_path / "nowhere")])
    assert "no such directory" in capsys.readouterr().err


def test_calibration_predicts_a_held_out_run(tmp_path):
    """Calibrate on one measured run (dp 2, ZeRO-1, 8 sequences per rank) and predict another (dp 2, ZeRO-3, 16 per
    rank: FSDP2's per-step gathers, twice the tokens) within 25%. Steps are timed in CPU time
    (`throughput_clock=process`): the wall time of a CPU shared with other jobs varies 2x between runs."""
    import dataclasses

    from lightning_npu.planner.calibrate import calibrate, estimate

    common = ("--trainer.precision", "32-true", "--trainer.strategy.init_args.pipeline_parallel_size", "1",
              "--model.init_args.n_layer", "2", "--model.init_args.n_embd", "256", "--model.init_args.throughput_clock",
              "process")
    runs = {"zero1": ("1", "8"), "zero3": ("3", "16")}
    for name, (zero, batch) in runs.items():
        _train_example_gpt(tmp_path / name, *common, "--trainer.strategy.init_args.zero_stage", zero,
                           "--data.init_args.batch_size", batch)
    base = ClusterSpec(devices=2)
    fitted = calibrate(tmp_path / "zero1", base)
    held = calibrate(tmp_path / "zero3", fitted.cluster(base))  # its `uncalibrated_step_s`: at zero1's efficiency
    assert held.layout.describe().startswith("tp1 pp1 dp2 zero3 M1x16"), held.layout.describe()
    ratio = held.uncalibrated_step_s / held.measured_step_s
    print(f"held out: predicted {held.uncalibrated_step_s:.4f} s, measured {held.measured_step_s:.4f} s ({ratio:.3f}x)")
    assert abs(ratio - 1) < 0.25, (held.uncalibrated_step_s, held.measured_step_s, fitted.efficiency)
    # the bound can fail: a model whose step did not follow the tokens (zero3 costed at zero1's 8 sequences) misses it
    wrong = estimate(held.model, fitted.cluster(base), dataclasses.replace(held.layout, micro_batch_size=8),
                     held.precision)[0].step_s
    assert abs(wrong / held.measured_step_s - 1) > 0.25, wrong / held.measured_step_s


def test_the_example_gpt_refuses_an_unknown_throughput_clock():
    from examples.gpt.model import GPTModule

    with pytest.raises(ValueError, match="throughput_clock='cpu'.*choose one of 'wall'"):
        GPTModule(throughput_clock="cpu")
    assert GPTModule(n_layer=1, n_embd=32, throughput_clock="process").hparams.throughput_clock == "process"
