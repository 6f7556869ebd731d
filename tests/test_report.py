"""`benchmarks/report.py` runs end to end (a two-case, one-step version) and writes what the README links."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_report_writes_markdown_plots_and_json(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "report.py"), "--steps", "1", "--warmup", "1", "--repeats", "1",
                    "--only", "zero1,zero1_ac_full", "--out", str(tmp_path)], check=True, env=env, cwd=tmp_path,
                   timeout=600)
    report = (tmp_path / "report.md").read_text()
    assert "| zero1 | 32-true |" in report and "| zero1_ac_full | 32-true |" in report
    for png in ("report_throughput.png", "report_memory.png", "report_loss.png"):
        assert (tmp_path / png).stat().st_size > 1000 and f"]({png})" in report
    results = json.loads((tmp_path / "results" / "report.json").read_text())["results"]
    full, none = results["zero1_ac_full"]["memory_mib"], results["zero1"]["memory_mib"]
    assert 0 < full["activations_peak"] < 0.5 * none["activations_peak"]  # recompute keeps only block inputs
    assert full["optimizer_state"] == none["optimizer_state"] > 0
    assert results["zero1_ac_full"]["losses"] == results["zero1"]["losses"]  # exact
