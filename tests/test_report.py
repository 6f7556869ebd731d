"""`benchmarks/report.py` runs end to end (a two-case, one-step version) and writes what the README links, dated and
reproducible; every benchmark's JSON goes through the one metadata helper (`benchmarks/_env.py`)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
META_KEYS = {"date", "commit", "dirty", "cpu_model", "cpu_count", "torch_threads", "load_average_1_5_15min", "torch",
             "lightning"}


def test_report_writes_dated_markdown_plots_and_json(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "LIGHTNING_NPU_NO_EXT": "1"}
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "report.py"), "--steps", "1", "--warmup", "1", "--repeats", "1",
                    "--only", "zero1,zero1_ac_full,zero1_bf16_explicit_fused", "--out", str(tmp_path)], check=True,
                   env=env, cwd=tmp_path, timeout=600)
    report = (tmp_path / "report.md").read_text()
    assert "| zero1 | 32-true |" in report and "| zero1_ac_full | 32-true |" in report
    for png in ("report_throughput.png", "report_memory.png", "report_loss.png"):
        assert (tmp_path / png).stat().st_size > 1000 and f"]({png})" in report
    payload = json.loads((tmp_path / "results" / "report.json").read_text())
    meta, results = payload["environment"], payload["results"]
    assert META_KEYS <= set(meta) and re.fullmatch(r"[0-9a-f]{40}", meta["commit"] or "")
    # the date, commit, CPU and load are in the markdown too, and how long the run took
    assert meta["date"] in report and meta["commit"][:10] in report and meta["cpu_model"] in report
    assert "load average" in report and "wall time" in report
    # no kernels here (LIGHTNING_NPU_NO_EXT): the fused case is not run, and the report says it measured nothing
    assert "zero1_bf16_explicit_fused" not in results
    assert "Fused vs unfused: not measured. The fused kernels cannot be built here" in report
    full, none = results["zero1_ac_full"]["memory_mib"], results["zero1"]["memory_mib"]
    assert 0 < full["activations_peak"] < 0.5 * none["activations_peak"]  # recompute keeps only block inputs
    assert full["optimizer_state"] == none["optimizer_state"] > 0
    assert results["zero1_ac_full"]["losses"] == results["zero1"]["losses"]  # exact
    lo, hi = results["zero1"]["tokens_per_s_p25_p75"]
    assert lo <= results["zero1"]["tokens_per_s"] <= hi


def test_fusion_note_says_what_was_measured():
    sys.path.insert(0, str(ROOT))
    from benchmarks import report

    same = {"tokens_per_s": 100.0}
    assert report.fusion_note({report.FUSED: {**same, "fused": {"counts": {}, "skipped": 3}}}, None).startswith(
        "Fused vs unfused: measured nothing. The rewrite pass replaced no module")
    note = report.fusion_note({"zero1_bf16_explicit": same,
                               report.FUSED: {"tokens_per_s": 150.0, "fused": {"counts": {"scale_causal_softmax": 4}}}},
                              None)
    assert note == "Fused vs unfused (explicit attention, bf16): 1.50x the unfused tokens/s; rewritten: scale_causal_softmax x4."


def test_every_benchmark_json_carries_the_run_metadata(tmp_path):
    """One helper stamps every result: no benchmark writes its JSON by hand."""
    sys.path.insert(0, str(ROOT))
    from benchmarks import _env

    by_hand = [f"{p.name}: {line.strip()}" for p in (ROOT / "benchmarks").glob("*.py") if p.name != "_env.py"
               for line in p.read_text().splitlines() if "json.dump" in line and "write" in line and "scratch" not in line]
    assert by_hand == [], by_hand
    written = json.loads(_env.write_json(tmp_path / "x.json", {"environment": {"extra": 1}, "v": 2}).read_text())
    assert META_KEYS <= set(written["environment"]) and written["environment"]["extra"] == 1 and written["v"] == 2
