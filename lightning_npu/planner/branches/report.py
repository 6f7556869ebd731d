"""`lightning-npu plan`'s text for a multi-branch model: the ranked table with a tp column per tower, and the best
layout's cost per tower (what each branch holds and spends), so the choice of branch tp can be checked by hand."""

from __future__ import annotations

from typing import Any

from lightning_npu.planner.memory import GB


def _short(glob: str) -> str:
    return glob.rsplit(".", 1)[-1]


def describe_model(model: Any, human_count: Any) -> str:
    towers = ", ".join(f"{_short(t.glob)} {human_count(t.model.num_params())} ({t.model.layers} layers, hidden "
                       f"{t.model.hidden}, {t.model.heads} heads, {t.model.seq} tokens"
                       + (f", {t.compression} branch-dp sum" if t.compression else "") + ")" for t in model.towers)
    return f"{human_count(model.num_params())} parameters in {len(model.towers)} towers: {towers}; global batch " \
           f"{model.global_batch}"


def table(result: Any, top: int, unit: str, scale: float) -> str:
    shown = result.ranked[:top]
    towers = [_short(t.glob) for t in result.model.towers]
    head = ["#", "tp", *(f"{t} tp" for t in towers), "dp", "zero", *(f"{t} zero" for t in towers), "M x b",
            *(f"{k} {unit}" for k in ("weights", "grads", "optim", "activ", "buffers", "total")),
            "step s", "samples/s", "MFU", "HFU"]
    rows = []
    devices, peak = result.cluster.devices, result.cluster.peak_tflops
    for i, e in enumerate(shown, 1):
        lay, gb = e.layout, {k: v * scale for k, v in e.memory.as_gb().items()}
        rows.append([str(i), str(lay.tp), *(str(b.tp) for b in lay.branches), str(lay.dp), str(lay.zero_stage),
                     *(str(b.zero_stage) for b in lay.branches),
                     f"{lay.micro_batches}x{lay.micro_batch_size}",
                     *(f"{gb[k]:.2f}" for k in ("parameters", "gradients", "optimizer", "activations", "buffers",
                                                "total")),
                     f"{e.time.step_s:.3g}", f"{result.model.global_batch / e.time.step_s:,.1f}",
                     f"{e.time.mfu(devices, peak):.1%}", f"{e.time.hfu(devices, peak):.1%}"])
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in [head, *rows])


def breakdown(best: Any) -> str:
    """One line per tower of the best layout: its tp x branch dp (and its own ZeRO stage over fdp), bytes per rank and
    seconds per step."""
    lines = ["per tower (best layout; per rank, per optimizer step):"]
    for c in best.branches:
        sync = (f"reduce-scatter over fdp {c.grad_sum_s:.3g} s ({c.grad_sum_bytes:,.0f} bytes), parameter gathers "
                f"{c.param_gather_s:.3g} s (exposed)" if c.zero_stage else
                f"branch-dp gradient sum {c.grad_sum_s:.3g} s ({c.grad_sum_bytes:,.0f} bytes sent)")
        lines.append(
            f"  {_short(c.glob)}: tp {c.tp} x branch dp {c.bdp}"
            + (f", zero {c.zero_stage} over fdp {c.fdp}" if c.zero_stage else "")
            + f" ({c.samples_per_micro_batch:g} samples per micro-batch); "
            f"{c.params:,.0f} parameters, {(c.parameters + c.gradients + c.optimizer) / GB * 1e3:.4g} MB states, "
            f"{c.activations / GB * 1e3:.4g} MB activations; compute {c.compute_s:.4g} s, tp {c.tp_comm_s:.3g} s, "
            f"output gather {c.gather_s:.3g} s, {sync}")
    return "\n".join(lines)
