"""`lightning-npu plan`: the planner on the command line (a table for people, ``--json`` for programs).

``--memory-only --params N --devices D --zero-stage S`` prints the model-state bytes per rank of one ZeRO
stage; its default precision is ``bf16-true`` (16-bit weights and gradients with fp32 master copies: the
ZeRO paper's mixed precision, K = 12), so the paper's figures come out as printed there.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from typing import Any, Optional

from lightning_npu.planner.branches import report as branch_report
from lightning_npu.planner.branches.model import BranchedModel
from lightning_npu.planner.calibrate import calibrate, summary
from lightning_npu.planner.memory import GB, OPTIMIZER_BYTES, PRECISION_BYTES, model_state_bytes, round_gb
from lightning_npu.planner.read import model_from_config
from lightning_npu.planner.result import Estimate, Plan
from lightning_npu.planner.search import plan
from lightning_npu.planner.spec import (
    ACCOUNTINGS,
    ATTENTIONS,
    MLPS,
    PRECISIONS,
    SCHEDULES,
    ClusterSpec,
    ModelSpec,
    PlannerError,
)

PROG = "lightning-npu plan"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG,
        description="Rank tensor x pipeline x data parallel x ZeRO layouts of a decoder-only transformer (or each "
        "tower's tp of a two-tower CLIP model: branch_layouts) on a cluster by estimated tokens/s, with memory per "
        "device by component, and print the LightningCLI strategy block of the best one. Estimates, not "
        "measurements: see docs/planning.md for the models' assumptions.",
    )
    m = p.add_argument_group("model (a LightningCLI config, or the sizes; sizes given override the config)")
    m.add_argument("--model", help="LightningCLI YAML whose model block gives the sizes, "
                   "e.g. examples/llama/config.yaml, or a transformers config.json (save_pretrained's)")
    for flag, help_text in [("--layers", "transformer blocks"), ("--hidden", "hidden size"),
                            ("--heads", "attention heads"), ("--kv-heads", "key/value heads (GQA; default: heads)"),
                            ("--ffn", "MLP width (default 4 x hidden)"), ("--vocab", "vocabulary size"),
                            ("--seq", "sequence length"), ("--global-batch", "sequences per optimizer step"),
                            ("--experts", "routed experts per MoE layer (0: dense; expert parallelism is searched)"),
                            ("--experts-per-token", "experts each token is routed to (top-k, default 2)"),
                            ("--expert-ffn", "one expert's MLP width (default --ffn)")]:
        m.add_argument(flag, type=int, help=help_text)
    m.add_argument("--mlp", choices=MLPS, help="gelu (GPT, 2 matrices) or swiglu (Llama, 3); default gelu")
    m.add_argument("--attention", choices=ATTENTIONS,
                   help="eager keeps the softmax probabilities for backward, flash does not (default flash)")
    m.add_argument("--branch-compression", action="append", default=[], metavar="GLOB=MODE",
                   help="a two-tower --model (a CLIP config.json or examples/clip's config): compress that tower's "
                   "branch-dp gradient sum (bf16, int8, topk, onebit), e.g. model.text_model=onebit; repeatable")
    c = p.add_argument_group("cluster")
    c.add_argument("--devices", type=int, help="devices in all (required)")
    c.add_argument("--devices-per-node", type=int, default=8)
    c.add_argument("--device-memory-gb", type=float, default=64.0, help="per device, 10^9 bytes")
    c.add_argument("--peak-tflops", type=float, default=280.0, help="dense 16-bit peak per device")
    c.add_argument("--intra-node-gbps", type=float, default=392.0,
                   help="GB/s (bytes) per device inside a node, as HCCS/NVLink are quoted (default 392)")
    c.add_argument("--inter-node-gbps", type=float, default=200.0,
                   help="Gb/s (bits) per device between nodes, as NICs are quoted (default 200: one 200G RoCE NIC)")
    c.add_argument("--gemm-efficiency", type=float, default=0.5, help="fraction of peak the matrix products reach")
    c.add_argument("--latency-us", type=float, default=10.0, help="per-message latency (alpha)")
    c.add_argument("--memory-gbps", type=float, default=1600.0,
                   help="device memory bandwidth, GB/s (what selective recomputation's replayed ops are bound by)")
    t = p.add_argument_group("training")
    t.add_argument("--precision", choices=PRECISIONS,
                   help="Trainer precision (default bf16-mixed; bf16-true with --memory-only)")
    t.add_argument("--optimizer", choices=sorted(OPTIMIZER_BYTES), default="adamw")
    t.add_argument("--schedule", choices=SCHEDULES, default="1f1b",
                   help="pipeline schedule; interleaved_1f1b also searches the interleave depth v")
    t.add_argument("--accounting", choices=ACCOUNTINGS, default="lightning-npu",
                   help="whose optimizer memory: lightning-npu's (default), paper/deepspeed (a full gradient buffer "
                   "at ZeRO-1) or megatron (a full fp32 main_grad buffer): to check another framework's run")
    t.add_argument("--calibrate", metavar="RUN_DIR",
                   help="a run's log directory (lightning_logs/version_N or a folder above it): fit the efficiency and "
                   "memory overhead to its measured step time (tokens_per_s) and peak memory (MemoryMonitor), then "
                   "rank; the model and devices default to the run's")
    t.add_argument("--top", type=int, default=10, help="layouts to print")
    t.add_argument("--json", action="store_true", help="the same figures as JSON")
    mo = p.add_argument_group("model states only (the ZeRO paper's table)")
    mo.add_argument("--memory-only", action="store_true",
                    help="print the model-state bytes per device of --params over --devices for --zero-stage")
    mo.add_argument("--params", type=float, help="parameters, e.g. 7.5e9")
    mo.add_argument("--zero-stage", type=int, choices=(0, 1, 2, 3), default=None)
    return p


_SIZES = ("layers", "hidden", "heads", "vocab", "seq", "global_batch")
EXAMPLES = (f"{PROG} --model examples/llama/config.yaml --devices 8", f"{PROG} --layers 32 --hidden 4096 --heads 32 "
            "--vocab 32000 --seq 4096 --global-batch 512 --devices 64")


def _missing(opts: argparse.Namespace) -> Optional[str]:
    """Everything a plan still needs, in one message with an example: a first run without arguments learns
    all of it at once, not one option per attempt."""
    missing = []
    if opts.calibrate:
        return None
    if not opts.model:
        sizes = [f"--{k.replace('_', '-')}" for k in _SIZES if getattr(opts, k) is None]
        if sizes:
            missing.append(f"the model: --model CONFIG.yaml or its sizes (missing {' '.join(sizes)})")
    if opts.devices is None:
        missing.append("--devices N (the number of devices in all)")
    if not missing:
        return None
    return f"give {'; and '.join(missing)}. For example: {EXAMPLES[0]}, or {EXAMPLES[1]}."


def _model(opts: argparse.Namespace) -> ModelSpec:
    sizes = {"layers": opts.layers, "hidden": opts.hidden, "heads": opts.heads, "kv_heads": opts.kv_heads,
             "ffn": opts.ffn, "vocab": opts.vocab, "seq": opts.seq, "global_batch": opts.global_batch,
             "mlp": opts.mlp, "attention": opts.attention, "experts": opts.experts,
             "experts_per_token": opts.experts_per_token, "expert_ffn": opts.expert_ffn}
    model = model_from_config(opts.model, **sizes) if opts.model else None
    compression = _branch_compression(opts.branch_compression)
    if isinstance(model, BranchedModel):
        return model.with_compression(compression) if compression else model
    if compression:
        raise PlannerError(f"--branch-compression {opts.branch_compression[0]}: only a two-tower --model (a CLIP "
                           "config.json or examples/clip/config.yaml) has branches; drop it.")
    return model if model is not None else ModelSpec(**{k: v for k, v in sizes.items() if v is not None})


def _branch_compression(values: list[str]) -> dict[str, str]:
    out = {}
    for value in values:
        glob, sep, mode = value.partition("=")
        if not sep or not glob or not mode:
            raise PlannerError(f"--branch-compression {value!r}: write GLOB=MODE, e.g. model.text_model=onebit.")
        out[glob] = mode
    return out


def _cluster(opts: argparse.Namespace) -> ClusterSpec:
    return ClusterSpec(opts.devices, opts.devices_per_node, opts.device_memory_gb, opts.peak_tflops,
                       opts.intra_node_gbps, opts.inter_node_gbps, opts.gemm_efficiency, opts.latency_us,
                       memory_GBps=opts.memory_gbps)


def memory_only(opts: argparse.Namespace) -> dict[str, Any]:
    if opts.params is None or not opts.params > 0:
        raise PlannerError(f"--memory-only needs --params > 0 (e.g. --params 7.5e9), got {opts.params!r}.")
    if opts.devices is None or opts.devices < 1:
        raise PlannerError(f"--memory-only needs --devices >= 1 (the data-parallel ranks), got {opts.devices!r}.")
    if opts.zero_stage is None:
        raise PlannerError("--memory-only needs --zero-stage 0, 1, 2 or 3.")
    precision = opts.precision or "bf16-true"
    optimizer = "adam" if opts.optimizer == "adamw" else opts.optimizer
    parts = model_state_bytes(opts.params, opts.devices, opts.zero_stage, precision, optimizer)
    w, g, master, _ = PRECISION_BYTES[precision]
    return {
        "params": opts.params, "devices": opts.devices, "zero_stage": opts.zero_stage, "precision": precision,
        "optimizer": optimizer,
        "bytes_per_param": {"weights": w, "gradients": g, "optimizer_K": master + OPTIMIZER_BYTES[optimizer]},
        "memory_gb": {**{k: v / GB for k, v in parts.items()}, "total": sum(parts.values()) / GB},
        "total_gb_rounded": round_gb(sum(parts.values())),
    }


def _memory_only_text(r: dict[str, Any]) -> str:
    b, gb = r["bytes_per_param"], r["memory_gb"]
    return "\n".join([
        f"{r['params']:.4g} parameters, {r['devices']} data-parallel devices, ZeRO stage {r['zero_stage']}, "
        f"{r['optimizer']}, precision {r['precision']} ({b['weights']} B weights + {b['gradients']} B gradients + "
        f"K={b['optimizer_K']} B optimizer state per parameter)",
        f"  weights {gb['parameters']:.2f} GB + gradients {gb['gradients']:.2f} GB + optimizer {gb['optimizer']:.2f} GB"
        f" = {r['total_gb_rounded']:.1f} GB per device (GB = 10^9 bytes; activations and buffers not included)",
    ])


def strategy_block(result: Plan, best: Estimate) -> str:
    """The LightningCLI ``trainer:`` lines (with the ``strategy:`` block) that run the best layout."""
    cl = result.cluster
    nodes = max(1, cl.devices // cl.devices_per_node)
    unit, scale = memory_unit(best.memory.total)
    lines = [
        f"# lightning-npu plan: {best.layout.describe()}; estimated {best.tokens_per_s:,.0f} tokens/s, "
        f"{best.memory.total / GB * scale:.3g} {unit} per device",
        "trainer:",
        f"  num_nodes: {nodes}",
        f"  devices: {min(cl.devices, cl.devices_per_node)}",
        f"  precision: {result.precision}",
        "  strategy:",
        "    class_path: lightning_npu.NPUHybridStrategy",
        "    init_args:",
    ]
    for key, value in best.layout.strategy_init_args().items():
        lines.append(f"      {key}: {json.dumps(value)}")  # JSON is YAML: a dict (branch_layouts) on one line
    lay = best.layout
    if lay.v > 2:  # the depth is the model's declaration, not a strategy argument
        lines.append(f"# model: pipeline_layout = PipelineLayout(virtual_stages={lay.v}) on the LightningModule")
    if lay.pp == 1 and lay.micro_batches > 1:  # without a pipeline, micro-batches are Lightning's accumulation
        lines.insert(5, f"  accumulate_grad_batches: {lay.micro_batches}")
        lines.append(f"# data: batch_size {lay.micro_batch_size} per data-parallel rank and step")
    else:  # the pipeline splits each rank's batch into its micro-batches
        lines.append(f"# data: batch_size {lay.micro_batches * lay.micro_batch_size} per data-parallel rank "
                     f"({lay.micro_batches} micro-batches of {lay.micro_batch_size})")
    return "\n".join(lines)


def _table(result: Plan, top: int) -> str:
    shown = result.ranked[:top]
    unit, scale = memory_unit(max(e.memory.total for e in shown))
    if isinstance(result.model, BranchedModel):
        return branch_report.table(result, top, unit, scale)
    experts = bool(result.model.experts)  # an ep column for MoE models only
    context = any(e.layout.cp > 1 for e in shown)  # a cp column where a shown layout splits sequences
    head = ["#", "tp", "pp", "dp", *(["cp"] if context else []), *(["ep"] if experts else []), "zero", "M x b", "v",
            "sp", "recompute",
            *(f"{k} {unit}" for k in (
            "weights", "grads", "optim", "activ", "buffers", "total")), "step s", "tokens/s", "MFU", "HFU"]
    rows = []
    devices, peak = result.cluster.devices, result.cluster.peak_tflops
    for i, e in enumerate(shown, 1):
        lay, gb = e.layout, {k: v * scale for k, v in e.memory.as_gb().items()}
        rows.append([str(i), str(lay.tp), str(lay.pp), str(lay.dp), *([str(lay.cp)] if context else []),
                     *([str(lay.ep)] if experts else []),
                     str(lay.zero_stage),
                     f"{lay.micro_batches}x{lay.micro_batch_size}", str(lay.v), "y" if lay.sequence_parallel else "-",
                     lay.recompute or "-", *(f"{gb[k]:.2f}" for k in ("parameters", "gradients", "optimizer",
                                                                     "activations", "buffers", "total")),
                     f"{e.time.step_s:.3g}", f"{e.tokens_per_s:,.0f}", f"{e.time.mfu(devices, peak):.1%}",
                     f"{e.time.hfu(devices, peak):.1%}"])
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    fmt = lambda r: "  ".join(c.rjust(w) for c, w in zip(r, widths))  # noqa: E731
    return "\n".join([fmt(head), *(fmt(r) for r in rows)])


def human_count(n: float) -> str:
    """125 K, 875 K, 1.1 B: a parameter count as Lightning's model summary writes it."""
    for exponent, unit in ((12, "T"), (9, "B"), (6, "M"), (3, "K")):
        if n >= 10 ** exponent:
            return f"{n / 10 ** exponent:.3g} {unit}"
    return f"{n:.0f}"


def memory_unit(nbytes: float) -> tuple[str, float]:
    """The unit (GB or MB, 10^9 or 10^6 bytes) the table and its titles use, and the factor from GB."""
    return ("GB", 1.0) if nbytes >= GB else ("MB", 1e3)


def _rejections(result: Plan) -> list[str]:
    return [f"  {n:>6} x {reason}" for reason, n in result.rejected.most_common()]


def run(opts: argparse.Namespace) -> int:
    if opts.memory_only:
        r = memory_only(opts)
        print(json.dumps(r, indent=2) if opts.json else _memory_only_text(r))
        return 0
    if opts.top < 1:
        raise PlannerError(f"--top {opts.top}: must be at least 1.")
    missing = _missing(opts)
    if missing:
        raise PlannerError(missing)
    calibration = None
    if opts.calibrate:
        devices = opts.devices
        opts.devices = devices or 1
        calibration = calibrate(opts.calibrate, _cluster(opts), opts.optimizer)
        opts.devices = devices or calibration.layout.devices
        given = opts.model or any(getattr(opts, k) is not None for k in _SIZES)
        model = _model(opts) if given else calibration.model
        cluster = calibration.cluster(_cluster(opts))
        print(summary(calibration) if not opts.json else "", end="\n" if not opts.json else "")
    else:
        model, cluster = _model(opts), _cluster(opts)
    default_precision = calibration.precision if calibration else "bf16-mixed"
    result = plan(model, cluster, precision=opts.precision or default_precision, optimizer=opts.optimizer,
                  schedule=opts.schedule, accounting=opts.accounting)
    if opts.json:
        print(json.dumps({
            "model": {**dataclasses.asdict(model), "params": model.num_params()},
            "cluster": cluster.__dict__, "precision": result.precision, "optimizer": result.optimizer,
            "accounting": result.accounting,
            "calibration": None if calibration is None else {
                "run_dir": str(calibration.run_dir), "layout": calibration.layout.describe(),
                "measured_step_s": calibration.measured_step_s, "predicted_step_s": calibration.predicted_step_s,
                "uncalibrated_step_s": calibration.uncalibrated_step_s, "efficiency": calibration.efficiency,
                "measured_peak_bytes": calibration.measured_peak_bytes,
                "estimated_peak_bytes": calibration.estimated_peak_bytes,
                "memory_overhead": calibration.memory_overhead},
            "considered": result.considered, "rejected": dict(result.rejected),
            "layouts": [e.to_dict(cluster.devices, cluster.peak_tflops) for e in result.ranked[: opts.top]],
            "strategy_block": strategy_block(result, result.best) if result.best else None,
        }, indent=2))
        return 0 if result.best else 1
    described = branch_report.describe_model(model, human_count) if isinstance(model, BranchedModel) else (
        f"{human_count(model.num_params())} parameters ({model.layers} layers, hidden {model.hidden}, "
        f"{model.heads} heads, seq {model.seq}, global batch {model.global_batch})")
    print(f"model: {described}; {cluster.devices} devices "
          f"({cluster.devices_per_node} per node, {cluster.device_memory_gb:g} GB, {cluster.peak_tflops:g} TFLOP/s at "
          f"{cluster.gemm_efficiency:.3g} efficiency); {result.precision}, {result.optimizer}")
    if not result.best:
        print(f"no layout fits: all {result.considered} were rejected:", *_rejections(result), sep="\n")
        print("fix: more devices or device memory, a smaller global batch or sequence, or a smaller model.")
        return 1
    unit, _ = memory_unit(max(e.memory.total for e in result.ranked[: opts.top]))
    print(f"{len(result.ranked)} of {result.considered} layouts fit; the best {min(opts.top, len(result.ranked))} "
          f"by estimated tokens/s (memory per device of the stage that needs the most, in {unit}: "
          f"10^{9 if unit == 'GB' else 6} bytes):")
    print(_table(result, opts.top))
    if result.best.branches:
        print(branch_report.breakdown(result.best))
    if result.rejected:
        print("rejected:", *_rejections(result), sep="\n")
    print("\nLightningCLI config for the best layout:\n" + strategy_block(result, result.best))
    return 0


def main(args: Optional[list[str]] = None) -> int:
    parser = build_parser()
    opts = parser.parse_args(args)
    try:
        return run(opts)
    except PlannerError as err:
        parser.exit(2, f"{parser.prog}: error: {err}\n")  # one line naming what to pass (no usage dump)


def command(args: list[str]) -> None:
    """`COMMANDS` entry of `lightning_npu.cli`."""
    code = main(args)
    if code:
        sys.exit(code)


if __name__ == "__main__":
    command(sys.argv[1:])
