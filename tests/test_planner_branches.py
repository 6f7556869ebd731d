"""The planner on multi-branch models (`branch_layouts`, issue #29/#32): CLIP's towers read from a config, each
tower's bytes and seconds against hand-computed values, the ranking on CLIP ViT-L/14 and ViT-bigG/14 shapes,
everything ranked buildable by the strategy, and `--calibrate` on a measured 2-process run of examples/clip."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import pytest

from lightning_npu.planner import ClusterSpec, Layout, PlannerError, model_from_config, plan
from lightning_npu.planner.branches.cost import branch_costs, branched_memory, branched_step_time
from lightning_npu.planner.branches.model import BranchedModel, clip_model
from lightning_npu.planner.cli import main as plan_main
from lightning_npu.planner.spec import BranchChoice

ROOT = Path(__file__).resolve().parents[1]
VISION, TEXT = "model.vision_model", "model.text_model"
TOWER = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)
# tests/_model_zoo_workers.py's CLIP (the model tests/test_branch_layouts.py trains)
ZOO = dict(text=dict(vocab_size=128, max_position_embeddings=16, **TOWER),
           vision=dict(image_size=16, patch_size=4, num_channels=3, **TOWER), projection_dim=16)
VIT_L14 = dict(text=dict(hidden_size=768, intermediate_size=3072, num_attention_heads=12, num_hidden_layers=12),
               vision=dict(hidden_size=1024, intermediate_size=4096, num_attention_heads=16, num_hidden_layers=24,
                           patch_size=14), projection_dim=768)
VIT_BIGG14 = dict(text=dict(hidden_size=1280, intermediate_size=5120, num_attention_heads=20, num_hidden_layers=32),
                  vision=dict(hidden_size=1664, intermediate_size=8192, num_attention_heads=16, num_hidden_layers=48,
                              patch_size=14), projection_dim=1280)


def _clip(sizes: dict, global_batch: int, text_compression=None) -> BranchedModel:
    model = clip_model(sizes["text"], sizes["vision"], sizes["projection_dim"], global_batch)
    return model.with_compression({TEXT: text_compression}) if text_compression else model


def _save_clip_config(sizes: dict, directory: Path) -> Path:
    transformers = pytest.importorskip("transformers")
    config = transformers.CLIPConfig(text_config=sizes["text"], vision_config=sizes["vision"],
                                     projection_dim=sizes["projection_dim"])
    config.save_pretrained(directory)  # leaves out what equals transformers' defaults
    return directory / "config.json"


# ---- reading a two-tower model ----------------------------------------------------------------------------------
@pytest.mark.parametrize("sizes, expected", [(VIT_L14, 427_616_513), (ZOO, None)])
def test_clip_config_json_counts_parameters_exactly(sizes, expected, tmp_path):
    import torch
    transformers = pytest.importorskip("transformers")
    path = _save_clip_config(sizes, tmp_path)
    model = model_from_config(path, global_batch=64)
    assert isinstance(model, BranchedModel) and [t.glob for t in model.towers] == [VISION, TEXT]
    config = transformers.CLIPConfig.from_pretrained(tmp_path)
    with torch.device("meta"):
        hf = transformers.CLIPModel(config)
    count = lambda m: sum(p.numel() for p in m.parameters())  # noqa: E731
    assert model.num_params() == count(hf) == (expected or count(hf))
    assert [t.model.num_params() for t in model.towers] == [count(hf.vision_model), count(hf.text_model)]
    assert model.towers[0].model.seq == 257 if sizes is VIT_L14 else 17  # patches + the class token


def test_the_example_clip_config_is_read_with_its_layout_and_compression():
    model = model_from_config(ROOT / "examples/clip/config.yaml")
    assert isinstance(model, BranchedModel) and model.global_batch == 32  # batch 32, tp 2 on 2 devices: dp 1
    assert {t.glob: t.compression for t in model.towers} == {VISION: None, TEXT: "onebit"}
    assert model.num_params() == 165_121  # examples.clip.model.CLIPModule(), counted by transformers


@pytest.mark.parametrize("top, branch_layouts, zeros", [
    (1, {VISION: {"tensor_parallel_size": 2}, TEXT: {"tensor_parallel_size": 1, "zero_stage": 3}}, (0, 3)),
    (3, {VISION: {"tensor_parallel_size": 2}, TEXT: {"tensor_parallel_size": 1, "zero_stage": 2}}, (3, 2)),
    (0, {TEXT: {"tensor_parallel_size": 1}}, (0, 0)),
    (0, {TEXT: {"tensor_parallel_size": 1, "zero_stage": 1}}, (0, 1)),
])
def test_calibrate_reads_each_towers_zero_stage_from_the_run(top, branch_layouts, zeros):
    """A run's branch ZeRO 1-3 is costed as such (a tower without its own stage under a top-level 2/3 takes it)."""
    from lightning_npu.planner.calibrate import layout_from_config

    model = model_from_config(ROOT / "examples/clip/config.yaml")
    strategy = {"init_args": {"tensor_parallel_size": 2, "zero_stage": top, "branch_layouts": branch_layouts}}
    layout, _, _ = layout_from_config({"trainer": {"devices": 4, "strategy": strategy}}, model)
    assert tuple(b.zero_stage for b in layout.branches) == zeros
    assert tuple(b.glob for b in layout.branches) == (VISION, TEXT)


# ---- each tower's bytes and seconds, by hand ------------------------------------------------------------------------
@pytest.mark.parametrize("compression, sent", [(None, 87_040), ("onebit", 3_060)])
def test_branch_costs_equal_hand_computed_values(compression, sent):
    """The zoo CLIP on 2 ranks: vision at tp 2, text at tp 1 over 2 branch-dp ranks, fp32, ZeRO 0, one micro-batch of
    4 pairs. `sent` is what tests/test_branch_layouts.py measured the strategy sending per step (docs/layouts.md)."""
    model = _clip(ZOO, 4, compression)
    cluster = ClusterSpec(devices=2, peak_tflops=1.0, gemm_efficiency=0.5, intra_node_GBps=392.0, intra_latency_us=2.0)
    layout = Layout(2, 1, 1, 0, 1, 4, branches=(BranchChoice(VISION, 2), BranchChoice(TEXT, 1, compression)))
    vision, text = branch_costs(model, cluster, layout, "32-true", "adamw")
    h, f, rate, bw, lat = 32, 64, 0.5e12, 392e9, 2e-6
    ring = lambda nbytes, n, factor: factor * (n - 1) * lat + factor * (n - 1) / n * nbytes / bw  # noqa: E731

    block = 4 * h * h + 2 * h * f + (5 * h + f)  # q, k, v, out, fc1, fc2 with their biases
    # the patch conv, class token, pre-norm and positions whole; the row-parallel biases (out_proj, fc2) whole
    assert vision.params == 3 * 16 * 32 + h + 2 * h + 17 * h + 2 * ((block - 2 * h) / 2 + 2 * h + 4 * h) + 2 * h \
        == 10_976
    assert text.params == 128 * h + 16 * h + 2 * (block + 4 * h) + 2 * h == 21_760
    assert (text.bdp, text.samples_per_micro_batch, vision.bdp) == (2, 2, 1)
    for c in (vision, text):
        assert c.parameters + c.gradients + c.optimizer == 16 * c.params  # fp32 weights, grads, Adam's two moments
    # saved per token: 4h (norm inputs/outputs) + (3h + h)/t (q, k, v, attention output) + 2f/t (MLP), fp32, plus
    # the norms' fp32 statistics; then the final norm (2h) and the token ids (8 bytes)
    per_token = lambda t: 2 * (4 * (4 * h + 4 * h / t + 2 * f / t) + 16) + 4 * 2 * h + 8  # noqa: E731
    assert vision.activations == 4 * 17 * per_token(2) == 159_392
    assert text.activations == 2 * 16 * per_token(1) == 107_776
    assert (vision.gathered_output, text.gathered_output) == (0, 4 * (16 + 1) * h * 4)
    # 6 FLOPs per parameter per token + 12 h s for attention, at half of a 1 TFLOP/s peak
    assert vision.compute_s == pytest.approx(2 * (6 * block + 12 * h * 17) * 4 * 17 / 2 / rate, rel=1e-12)
    assert text.compute_s == pytest.approx(2 * (6 * block + 12 * h * 16) * 2 * 16 / rate, rel=1e-12)
    assert vision.tp_comm_s == pytest.approx(2 * 4 * ring(4 * 17 * h * 4, 2, 2), rel=1e-12) and text.tp_comm_s == 0
    assert text.gather_s == pytest.approx(ring(4 * 17 * h * 4, 2, 1), rel=1e-12) and vision.gather_s == 0
    assert text.grad_sum_bytes == sent == (4 * 21_760 if compression is None else math.ceil(21_760 / 256) * 36)
    want = ring(sent, 2, 2) if compression is None else ring(2 * sent, 2, 1)  # all-reduce / all-gather of payloads
    assert text.grad_sum_s == pytest.approx(want, rel=1e-12) and vision.grad_sum_s == 0
    step = branched_step_time(model, cluster, layout, [vision, text], "32-true")
    assert step.step_s == pytest.approx(sum(c.compute_s + c.tp_comm_s + c.gather_s + c.grad_sum_s
                                            for c in (vision, text)), rel=1e-12)  # dp 1: no top-level reduction
    memory = branched_memory(model, layout, [vision, text], "32-true", "adamw")
    trunk = 16 * (h + h) + 1
    assert memory.parameters + memory.gradients + memory.optimizer == 16 * (10_976 + 21_760 + trunk)
    assert memory.buffers == text.gathered_output  # dp 1: no gradient buckets


@pytest.mark.parametrize("zero", [3, 2])
def test_a_branch_zero_stage_costs_equal_hand_computed_values(zero):
    """The zoo CLIP on 4 ranks (dp 2 x tp 2), fp32, ZeRO 0, 2 micro-batches of 4 pairs: vision at tp 2 as before, text
    at tp 1 with its own ZeRO 3 (or 2) over fdp = dp 2 x branch dp 2 = 4 ranks. Its states shard over fdp, one
    reduce-scatter of its fp32 gradients per step replaces its branch-dp sum and the top-level dp reduction, and its
    parameters are all-gathered twice (ZeRO-3) or once (ZeRO-2) per micro-batch, hidden under its compute."""
    model = _clip(ZOO, 16)
    cluster = ClusterSpec(devices=4, peak_tflops=1.0, gemm_efficiency=0.5, intra_node_GBps=392.0, intra_latency_us=2.0)
    layout = Layout(2, 1, 2, 0, 2, 4, branches=(BranchChoice(VISION, 2), BranchChoice(TEXT, 1, None, zero)))
    vision, text = branch_costs(model, cluster, layout, "32-true", "adamw")
    h, f, rate, bw, lat = 32, 64, 0.5e12, 392e9, 2e-6
    ring = lambda nbytes, n, factor: factor * (n - 1) * lat + factor * (n - 1) / n * nbytes / bw  # noqa: E731
    block = 4 * h * h + 2 * h * f + (5 * h + f)

    assert (text.params, text.zero_stage, text.fdp, text.bdp, vision.zero_stage, vision.fdp) == (21_760, zero, 4, 2,
                                                                                                  0, 1)
    # fp32 weights (sharded at 3 only), gradients and Adam's two moments sharded over fdp 4
    assert (text.parameters, text.gradients, text.optimizer) == ((21_760 if zero == 3 else 87_040), 21_760, 43_520)
    assert text.fsdp_buffers == 2 * block * 4 == 67_328  # FSDP2's two gathered blocks in flight, fp32
    assert text.grad_sum_bytes == 4 * 21_760 == 87_040  # the reduce-scatter's fp32 gradients, once per step
    mb_compute = 2 * (6 * block + 12 * h * 16) * 2 * 16 / rate  # 2 samples x 16 tokens per micro-batch
    assert text.compute_s == pytest.approx(2 * mb_compute, rel=1e-12)
    assert mb_compute == pytest.approx(7.249_92e-6, rel=1e-9)
    reduce_scatter = ring(87_040, 4, 1)
    assert text.grad_sum_s == pytest.approx(reduce_scatter - mb_compute * 2 / 3, rel=1e-12)  # past the backward
    assert text.grad_sum_s == pytest.approx(1.33325e-6, rel=1e-5)
    gathers = (2 if zero == 3 else 1) * ring(4 * 21_760, 4, 1)
    assert text.param_gather_s == pytest.approx(2 * max(0.0, gathers - mb_compute), rel=1e-12)
    assert text.param_gather_s == pytest.approx(1.01663e-5 if zero == 3 else 0.0, rel=1e-5, abs=1e-15)
    assert text.gather_s == pytest.approx(2 * ring(4 * 17 * h * 4, 2, 1), rel=1e-12)  # the output gather, unchanged

    memory = branched_memory(model, layout, [vision, text], "32-true", "adamw")
    trunk = 16 * (h + h) + 1
    assert memory.parameters + memory.gradients + memory.optimizer == \
        16 * (10_976 + trunk) + (87_040 if zero == 3 else 152_320)
    assert memory.buffers == 2 * 25 * 2**20 + text.gathered_output + 67_328  # the dp buckets now carry no text
    step = branched_step_time(model, cluster, layout, [vision, text], "32-true")
    towers = sum(c.compute_s + c.tp_comm_s + c.gather_s + c.grad_sum_s + c.param_gather_s for c in (vision, text))
    window = (vision.compute_s + text.compute_s) / 2 * 2 / 3
    top_dp = max(0.0, ring((10_976 + trunk) * 4, 2, 2) - window)  # vision and the trunk only
    assert step.step_s == pytest.approx(towers + top_dp, rel=1e-12)
    assert layout.strategy_init_args()["branch_layouts"] == {TEXT: {"tensor_parallel_size": 1, "zero_stage": zero}}


def test_a_branch_zero1_costs_equal_hand_computed_values():
    """The same CLIP and layout with the text tower at its own ZeRO-1 over fdp 4: its fp32 weights and gradient buffer
    whole, its fp32 masters and Adam's moments sharded over fdp (4 + 8 bytes / 4 per parameter); one reduce-scatter
    of its fp32 gradients per step as at ZeRO 2/3, and one all-gather of its stepped fp32 weights, not hidden. The
    rest of the model, stepped by the same ZeRO-1 optimizer under the top-level ZeRO 0, holds whole fp32 masters."""
    model = _clip(ZOO, 16)
    cluster = ClusterSpec(devices=4, peak_tflops=1.0, gemm_efficiency=0.5, intra_node_GBps=392.0, intra_latency_us=2.0)
    layout = Layout(2, 1, 2, 0, 2, 4, branches=(BranchChoice(VISION, 2), BranchChoice(TEXT, 1, None, 1)))
    vision, text = branch_costs(model, cluster, layout, "32-true", "adamw")
    h, bw, lat = 32, 392e9, 2e-6
    ring = lambda nbytes, n, factor: factor * (n - 1) * lat + factor * (n - 1) / n * nbytes / bw  # noqa: E731
    assert (text.params, text.zero_stage, text.fdp, text.bdp) == (21_760, 1, 4, 2)
    assert (text.parameters, text.gradients, text.optimizer, text.fsdp_buffers) == (87_040, 87_040, 65_280, 0.0)
    assert text.grad_sum_bytes == 87_040
    assert text.grad_sum_s == pytest.approx(1.33325e-6, rel=1e-5)  # the reduce-scatter past the backward, as at 2/3
    assert text.param_gather_s == pytest.approx(ring(4 * 21_760, 4, 1), rel=1e-12)
    memory = branched_memory(model, layout, [vision, text], "32-true", "adamw")
    trunk = 16 * (h + h) + 1
    # the rest (vision, the trunk) gets whole fp32 masters from ZeRO-1's optimizer at the top-level ZeRO 0
    assert memory.parameters + memory.gradients + memory.optimizer == (16 + 4) * (10_976 + trunk) + 239_360
    step = branched_step_time(model, cluster, layout, [vision, text], "32-true")
    towers = sum(c.compute_s + c.tp_comm_s + c.gather_s + c.grad_sum_s + c.param_gather_s for c in (vision, text))
    window = (vision.compute_s + text.compute_s) / 2 * 2 / 3
    assert step.step_s == pytest.approx(towers + max(0.0, ring((10_976 + trunk) * 4, 2, 2) - window), rel=1e-12)
    assert layout.strategy_init_args()["branch_layouts"] == {TEXT: {"tensor_parallel_size": 1, "zero_stage": 1}}
    from lightning_npu import NPUHybridStrategy

    NPUHybridStrategy(**layout.strategy_init_args())  # the strategy builds it


def test_a_branch_zero3_layout_is_the_one_that_fits():
    """ViT-L/14 + its text tower, 4096 pairs on 8 devices of 1.25 GB: at branch ZeRO 0 under the top-level ZeRO 0/1,
    nothing fits; with the branch ZeRO searched, every fitting layout shards a tower over its fdp, and the best runs
    both towers at tp 2 with their own ZeRO-3 over fdp 4 (top-level dp 4 at ZeRO 0)."""
    model, cluster = _clip(VIT_L14, 4096), ClusterSpec(devices=8, device_memory_gb=1.25)
    assert plan(model, cluster, zero_stages=(0, 1)).ranked == []
    result = plan(model, cluster)
    assert len(result.ranked) == 24 and all(any(b.zero_stage for b in e.layout.branches) for e in result.ranked)
    best = result.best
    assert best.layout.describe() == "tp2 pp1 dp4 zero0 M1024x1 vision_model:tp2+zero3 text_model:tp2+zero3"
    assert [(c.zero_stage, c.fdp) for c in best.branches] == [(3, 4), (3, 4)]
    assert best.memory.total <= cluster.usable_bytes
    assert best.layout.strategy_init_args()["branch_layouts"] == {
        VISION: {"tensor_parallel_size": 2, "zero_stage": 3}, TEXT: {"tensor_parallel_size": 2, "zero_stage": 3}}


ADAM1BIT = {"mode": "onebit", "warmup_steps": 12, "frozen_variance": True}  # tests/test_branch_layouts.py's


def test_one_bit_adam_on_a_tower_is_costed_as_onebit_and_searched_at_zero_0_only():
    """1-bit Adam on the text tower (``frozen_variance``): after its warm-up each rank sends its momentum in onebit's
    payload, so a layout costs what it costs with onebit (3_060 bytes per step on the zoo CLIP, what the strategy
    measured); the search keeps exactly onebit's layouts that the strategy builds with it (the top-level ZeRO 0
    wherever the tower has branch dp), counts the rest as refused, and every ranked layout builds the strategy."""
    from lightning_npu import NPUHybridStrategy

    cluster = ClusterSpec(devices=2, peak_tflops=1.0, gemm_efficiency=0.5, intra_node_GBps=392.0, intra_latency_us=2.0)
    costs = {}
    for compression in ("onebit", ADAM1BIT):
        layout = Layout(2, 1, 1, 0, 1, 4, branches=(BranchChoice(VISION, 2), BranchChoice(TEXT, 1, compression)))
        costs[str(compression)] = branch_costs(_clip(ZOO, 4, compression), cluster, layout, "32-true", "adamw")
    assert [c.to_dict() for c in costs[str(ADAM1BIT)]] == [c.to_dict() for c in costs["onebit"]]
    assert costs[str(ADAM1BIT)][1].grad_sum_bytes == 3_060
    assert layout.describe().endswith("text_model:tp1+onebit-adam")
    assert layout.strategy_init_args()["branch_layouts"][TEXT]["gradient_compression"] == ADAM1BIT
    NPUHybridStrategy(**layout.strategy_init_args())
    with pytest.raises(PlannerError, match=r"frozen_variance=True \(1-bit Adam\) at the top-level zero_stage 1"):
        branch_costs(_clip(ZOO, 16, ADAM1BIT), ClusterSpec(devices=4),
                     Layout(2, 1, 2, 1, 1, 8, branches=(BranchChoice(VISION, 2), BranchChoice(TEXT, 1, ADAM1BIT))))

    model, big = _clip(VIT_L14, 4096, ADAM1BIT), ClusterSpec(devices=8, device_memory_gb=4.0)
    adam, onebit = plan(model, big), plan(_clip(VIT_L14, 4096, "onebit"), big)

    def ranked(result, keep=lambda e: True):
        return [(e.layout.describe().replace("+onebit-adam", "+onebit"), e.time.step_s) for e in result.ranked
                if keep(e)]

    buildable = lambda e: e.layout.zero_stage == 0 or e.layout.branches[1].tp == e.layout.tp  # noqa: E731
    assert ranked(adam) == ranked(onebit, buildable) and len(ranked(adam)) < len(ranked(onebit))
    assert adam.rejected["1-bit Adam (frozen_variance) on a tower needs the top-level zero_stage 0"] > 0
    for e in adam.ranked:
        NPUHybridStrategy(**e.layout.strategy_init_args())


# ---- the ranking on CLIP-size models -------------------------------------------------------------------------------
def _tps(estimate) -> tuple[int, int]:
    return tuple(b.tp for b in estimate.layout.branches)


@pytest.mark.parametrize("zero_stages, memory_gb", [((0,), 2.0), ((0, 1), 1.5)])
def test_memory_gives_the_vision_tower_the_larger_tp(zero_stages, memory_gb):
    """ViT-L/14 + its text tower (428 M), 4096 pairs per step on 8 devices: at ZeRO 0 (examples/clip's zero_stage) on
    2 GB, or with ZeRO-1 searched too on 1.5 GB, only a split vision tower fits. The text tower's 12 heads stop at tp
    4; the vision tower's 303 M parameters need tp 8, so every fitting layout has vision tp >= text tp. (The text
    tower's own ZeRO-1 over its 2 branch-dp ranks would halve its optimizer state, but at the top-level dp of 1 its
    ZeRO-1 optimizer gives the vision tower whole fp32 masters: that does not fit.)"""
    result = plan(_clip(VIT_L14, 4096), ClusterSpec(devices=8, device_memory_gb=memory_gb), zero_stages=zero_stages)
    assert _tps(result.best) == (8, 4)
    assert all(v >= t for v, t in map(_tps, result.ranked))
    args = result.best.layout.strategy_init_args()
    assert args["tensor_parallel_size"] == 8 and args["branch_layouts"] == {TEXT: {"tensor_parallel_size": 4}}


def test_time_gives_branch_dp_to_the_token_heavy_tower():
    """At ZeRO 0 on 4 GB, a top-level tp of 4 is needed but the towers have room to choose: tensor parallelism moves
    activations (4 all-reduces of b s h per block), branch dp moves gradients once per step (its parameters).
    ViT-L/14's tower has 257 tokens per sample and 24 blocks (8.9x the text tower's tp traffic for 2.5x its
    parameters), so the planner gives the vision tower branch dp and keeps the text tower at tp 4. (With ZeRO-1
    searched, dp 8 at tp 1 fits on 4 GB and ranks first: ZeRO frees the memory tp was for. With ZeRO 2/3 searched too,
    both towers shard themselves over fdp 8 instead: their gathers hide under compute, ZeRO-1's fp32 gather does
    not.)"""
    model, cluster = _clip(VIT_L14, 4096), ClusterSpec(devices=8, device_memory_gb=4.0)
    result = plan(model, cluster, zero_stages=(0,))
    assert (result.best.layout.tp, _tps(result.best)) == (4, (2, 4))
    assert plan(model, cluster, zero_stages=(0, 1)).best.layout.describe().startswith("tp1 pp1 dp8 zero1")
    assert plan(model, cluster).best.layout.describe() == \
        "tp1 pp1 dp8 zero0 M64x8 vision_model:tp1+zero3 text_model:tp1+zero3"

    def step(v, t):
        lay = Layout(4, 1, 2, 0, 256, 8, branches=(BranchChoice(VISION, v), BranchChoice(TEXT, t)))
        costs = branch_costs(model, cluster, lay)
        return branched_step_time(model, cluster, lay, costs).step_s, costs

    (s44, c44), (s24, c24), (s42, c42) = step(4, 4), step(2, 4), step(4, 2)
    assert s24 < s42 < s44  # lowering the vision tower's tp saves more than lowering the text tower's
    saved_vision = c44[0].tp_comm_s - c24[0].tp_comm_s - c24[0].gather_s - c24[0].grad_sum_s
    saved_text = c44[1].tp_comm_s - c42[1].tp_comm_s - c42[1].gather_s - c42[1].grad_sum_s
    assert saved_vision > 3 * saved_text > 0


def test_a_tower_whose_heads_stop_its_tp_runs_as_a_branch():
    """OpenCLIP ViT-bigG/14's shape (2.54 B): its text tower has 20 heads, so tp 8 cannot split it; on 8 devices of
    8 GB the vision tower needs tp 8 and the text tower runs at tp 4 over 2 branch-dp ranks, with its onebit sum (ZeRO
    0/1 searched: no branch ZeRO). With ZeRO 2/3 searched, the vision tower shards itself at tp 1 over fdp 8 instead."""
    model, cluster = _clip(VIT_BIGG14, 4096, "onebit"), ClusterSpec(devices=8, device_memory_gb=8.0)
    assert plan(model, cluster).best.layout.describe() == \
        "tp4 pp1 dp2 zero1 M512x4 vision_model:tp1+zero3 text_model:tp4"
    result = plan(model, cluster, zero_stages=(0, 1))
    assert _tps(result.best) == (8, 4)
    args = result.best.layout.strategy_init_args()
    assert args["branch_layouts"] == {TEXT: {"tensor_parallel_size": 4, "gradient_compression": "onebit"}}
    text = result.best.branches[1]
    assert text.grad_sum_bytes == math.ceil(text.params / 256) * 36  # 28x fewer than the 4 bytes per value of fp32


def test_every_ranked_layout_builds_the_strategy():
    """What the planner proposes, `NPUHybridStrategy` accepts (branch tp dividing the top level's, no pp/ep/cp/sp,
    a branch zero_stage 0-3 under the top-level ZeRO 0/1, 2/3 under 2/3), with and without text compression."""
    from lightning_npu import NPUHybridStrategy

    seen = set()
    for sizes, memory in ((VIT_L14, 4.0), (VIT_BIGG14, 8.0), (ZOO, 64.0)):
        for compression in ("onebit", None):
            result = plan(_clip(sizes, 512, compression), ClusterSpec(devices=8, device_memory_gb=memory))
            assert result.ranked
            for e in result.ranked:
                args = e.layout.strategy_init_args()
                assert args["pipeline_parallel_size"] == 1
                for entry in (args.get("branch_layouts") or {}).values():
                    assert entry.get("zero_stage", 0) in (0, 1, 2, 3)
                    seen.add((args["zero_stage"], entry.get("zero_stage", 0)))
                NPUHybridStrategy(**args)
    # every top-level stage with the branch stages it composes with
    assert seen == {(0, 0), (0, 1), (0, 2), (0, 3), (1, 0), (1, 1), (1, 2), (1, 3), (2, 2), (2, 3), (3, 2), (3, 3)}


def test_cli_prints_per_tower_costs_and_the_branch_layouts_block(tmp_path, capsys):
    path = _save_clip_config(VIT_BIGG14, tmp_path)
    args = ["--model", str(path), "--global-batch", "4096", "--devices", "8", "--device-memory-gb", "8",
            "--branch-compression", f"{TEXT}=onebit", "--top", "3"]
    assert plan_main(args) == 0
    out = capsys.readouterr().out
    assert "vision_model tp" in out and "text_model tp" in out and "per tower" in out
    # the best layout (test_a_tower_whose_heads_stop_its_tp_runs_as_a_branch): vision at its own ZeRO-3 over fdp 8
    assert f'branch_layouts: {{"{VISION}": {{"tensor_parallel_size": 1, "zero_stage": 3}}}}' in out
    assert "vision_model: tp 1 x branch dp 4, zero 3 over fdp 8" in out
    assert plan_main([*args, "--json"]) == 0
    best = json.loads(capsys.readouterr().out)["layouts"][0]
    assert [(b["tp"], b["zero_stage"], b["fdp"]) for b in best["branches"]] == [(1, 3, 8), (4, 0, 1)]
    assert best["strategy"]["branch_layouts"] == {VISION: {"tensor_parallel_size": 1, "zero_stage": 3}}
    assert best["step_time_breakdown_s"]["branches"] > 0


@pytest.mark.parametrize("extra, words", [
    (["--branch-compression", "model.audio=onebit"], "no tower 'model.audio'"),
    (["--branch-compression", "onebit"], "write GLOB=MODE"),
    (["--branch-compression", f"{TEXT}=powersgd"], "not powersgd"),
    (["--layers", "4"], "drop --layers"),
])
def test_bad_branch_arguments_say_what_to_pass(extra, words, tmp_path, capsys):
    path = _save_clip_config(ZOO, tmp_path)
    with pytest.raises(SystemExit):
        plan_main(["--model", str(path), "--global-batch", "64", "--devices", "2", *extra])
    assert words in capsys.readouterr().err


def test_what_branches_do_not_compose_with_is_refused_by_name(tmp_path, capsys):
    model, cluster = _clip(ZOO, 64), ClusterSpec(devices=2)
    for kwargs in (dict(schedule="interleaved_1f1b"), dict(recompute=("full",)), dict(context_parallel=(2,))):
        with pytest.raises(PlannerError, match="branch_layouts compose with tensor and data parallelism only"):
            plan(model, cluster, **kwargs)
    path = _save_clip_config(ZOO, tmp_path)
    with pytest.raises(SystemExit):
        plan_main(["--model", str(path), "--global-batch", "64", "--devices", "2", "--schedule", "gpipe"])
    assert "schedule='gpipe'" in capsys.readouterr().err


def test_a_clip_config_json_needs_the_batch(tmp_path, capsys):
    path = _save_clip_config(ZOO, tmp_path)
    with pytest.raises(SystemExit):
        plan_main(["--model", str(path), "--devices", "2"])
    assert "--global-batch N" in capsys.readouterr().err
    with pytest.raises(PlannerError, match="at least two towers"):
        BranchedModel(towers=(), global_batch=4)


# ---- --calibrate on a measured 2-process run of examples/clip ----------------------------------------------------
def test_calibrate_on_a_measured_clip_run(tmp_path, capsys):
    """examples/clip as configured (vision tp 2, text tp 1 over 2 branch-dp ranks, onebit on text) for 10 steps on 2
    CPU processes (about 45 s), then `plan --calibrate`: the run's layout is read back with its branches, and after
    the fit its median step is predicted within 25%."""
    import subprocess
    import sys

    from tests._callbacks_helpers import clean_env

    pytest.importorskip("transformers")
    script = Path(sys.executable).with_name("lightning-npu")
    cmd = [str(script)] if script.exists() else [sys.executable, "-m", "lightning_npu.cli"]
    cmd += ["fit", "--config", str(ROOT / "examples/clip/config.yaml"), "--trainer.max_steps", "10",
            "--trainer.limit_val_batches", "0", "--trainer.log_every_n_steps", "1",
            "--trainer.enable_progress_bar", "false", "--trainer.default_root_dir", str(tmp_path),
            "--trainer.callbacks+=lightning_npu.callbacks.MemoryMonitor"]
    proc = subprocess.run(cmd, cwd=ROOT, env=clean_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    assert plan_main(["--calibrate", str(tmp_path), "--json", "--top", "3"]) == 0
    out = json.loads(capsys.readouterr().out)
    cal = out["calibration"]
    assert cal["layout"] == "tp2 pp1 dp1 zero0 M1x32 vision_model:tp2 text_model:tp1+onebit"
    assert cal["uncalibrated_step_s"] < 0.01 * cal["measured_step_s"]  # the default 280 TFLOP/s device, far off
    assert abs(cal["predicted_step_s"] / cal["measured_step_s"] - 1) < 0.25, cal
    assert 0.8 < cal["memory_overhead"] < 1.5, cal  # MemoryMonitor's tensors against the same parts of the estimate
    assert out["layouts"] and all(b["tp"] for b in out["layouts"][0]["branches"])
    # rank 0's model states, as MemoryMonitor counted them, equal the estimate's to the byte
    from lightning_npu.planner.calibrate import calibrate, estimate, find_run

    fitted = calibrate(tmp_path, ClusterSpec(devices=2))
    _, memory = estimate(fitted.model, ClusterSpec(devices=2), fitted.layout, fitted.precision)
    with open(find_run(tmp_path) / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    # (AdamW's state also holds a 4-byte step counter per parameter tensor: 78 of them in a CLIPModel)
    for part, key, extra in (("parameters", "parameters", 0), ("gradients", "gradients", 0),
                             ("optimizer", "optimizer_state", 4 * 78)):
        measured = max(float(r[f"memory/{key}_bytes"]) for r in rows if r.get(f"memory/{key}_bytes"))
        assert getattr(memory, part) + extra == measured, (part, getattr(memory, part), measured)
