"""Every code snippet in README.md and docs/*.md runs, as a user would run it.

A block is marked ``<!-- runnable -->`` on the line before its fence (the README's two setup commands are run
by CI itself and are the only exception). Every block runs in its own fresh folder, so none sees what another
wrote. Python blocks run as ``python snippet.py`` with the repository importable, each in a fresh process
(``devices=N`` ones as N ranks with torchrun's environment; see `tests/_docs_runner.py`). Bash blocks run with
``examples/`` at hand and ``lightning-npu fit --config ...`` shortened to a few tiny single-process steps.
Nothing is left in the repository, and whatever a block writes is covered by ``.gitignore``, so that a user who
runs the snippets in the repository's root sees a clean ``git status``.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests._callbacks_helpers import clean_env

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```(\w*)\n(.*?)^```$", re.S | re.M)
RUNNABLE = "<!-- runnable -->"
RUN_BY_CI = ("<!-- example-command -->", "<!-- test-command -->")
# test sizes for the documented `fit --config` commands (appended, so they win over the config)
TINY_FIT = ["--trainer.max_steps", "2", "--trainer.limit_val_batches", "0", "--trainer.enable_progress_bar", "false",
            "--trainer.devices", "1", "--trainer.strategy.init_args.pipeline_parallel_size", "1",
            "--trainer.strategy.init_args.tensor_parallel_size", "1",
            "--model.init_args.n_layer", "2", "--model.init_args.n_embd", "32"]


def _blocks():
    for page in PAGES:
        text = page.read_text()
        for m in FENCE.finditer(text):
            before = text[: m.start()].rstrip("\n").rsplit("\n", 1)[-1].strip()
            line = text[: m.start()].count("\n") + 1
            yield page.relative_to(ROOT), line, m.group(1), m.group(2), before


def _runnable(lang):
    return [pytest.param(code, id=f"{page}:{line}") for page, line, kind, code, mark in _blocks()
            if kind == lang and mark == RUNNABLE]


def _env(tmp_path):
    env = clean_env()
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    env["PATH"] = os.pathsep.join([str(tmp_path / "bin"), env["PATH"]])
    return env


def test_every_snippet_is_runnable_and_every_page_is_linked():
    unmarked = [f"{page}:{line}" for page, line, kind, _, mark in _blocks()
                if kind in ("python", "bash", "sh", "") and mark != RUNNABLE and mark not in RUN_BY_CI]
    assert not unmarked, f"snippets not marked {RUNNABLE}: {unmarked}"
    assert len(_runnable("python")) >= 6 and len(_runnable("bash")) >= 2
    readme = (ROOT / "README.md").read_text()
    for page in PAGES[1:]:
        assert f"](docs/{page.name}" in readme, f"README does not link docs/{page.name}"
    for target in re.findall(r"\]\(((?:docs/)?[\w.-]+\.md)", readme + "".join(p.read_text() for p in PAGES[1:])):
        name = target.split("/")[-1]
        assert (ROOT / "docs" / name).is_file() or (ROOT / target).is_file(), target


def _git_status() -> list[str]:
    """The repository's untracked files (not ignored): what a snippet run in it would leave."""
    out = subprocess.run(["git", "status", "--porcelain", "--untracked-files=all"], cwd=ROOT, capture_output=True,
                         text=True, check=True).stdout
    return [line for line in out.splitlines() if line.startswith("??")]


def _assert_ignored(folders, harness):
    """What the snippets wrote, as names in the repository's root: each must be git-ignored."""
    written = sorted({p.name + ("/" if p.is_dir() else "") for folder in folders for p in Path(folder).iterdir()
                      if p.name not in harness})
    if not written:
        return
    proc = subprocess.run(["git", "check-ignore", "--no-index", "--stdin", "-v", "-n"], cwd=ROOT, text=True,
                          input="\n".join(written) + "\n", capture_output=True)
    shown = [line.split("\t")[-1] for line in proc.stdout.splitlines() if line.startswith("::")]
    assert not shown, f"snippets write {shown}, which .gitignore does not cover"


def test_python_snippets_run(tmp_path):
    before = _git_status()
    # one interpreter imports Lightning once and forks a fresh process (N ranks for devices=N) per snippet
    snippets = []
    for i, param in enumerate(_runnable("python")):
        cwd = tmp_path / f"snippet{i}"
        cwd.mkdir()
        snippets.append({"id": param.id, "code": param.values[0], "cwd": str(cwd)})
    (tmp_path / "snippets.json").write_text(json.dumps(snippets))
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "_docs_runner.py"), str(tmp_path / "snippets.json")],
                          cwd=tmp_path, env=_env(tmp_path), capture_output=True, text=True, timeout=600)
    results = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert [r["id"] for r in results] == [s["id"] for s in snippets], proc.stderr[-4000:]
    failed = [f"--- {r['id']}\n{r['output']}" for r in results if not r["ok"]]
    assert not failed, "\n".join(failed)
    assert _git_status() == before, "the snippets left files in the repository"
    _assert_ignored([s["cwd"] for s in snippets], harness={"snippet.py", "snippet.log"})


def test_bash_snippets_run(tmp_path):
    (tmp_path / "bin").mkdir()
    wrapper = tmp_path / "bin" / "lightning-npu"
    wrapper.write_text(
        "#!/bin/bash\n"
        f'if [ "$1" = fit ] && [[ " $* " == *" --config "* ]]; then set -- "$@" {" ".join(TINY_FIT)}; fi\n'
        f'exec "{sys.executable}" -m lightning_npu.cli "$@"\n'
    )
    wrapper.chmod(0o755)
    before = _git_status()
    outputs, folders = [], []
    for i, param in enumerate(_runnable("bash")):
        cwd = tmp_path / f"snippet{i}"
        cwd.mkdir()
        (cwd / "examples").symlink_to(ROOT / "examples")
        proc = subprocess.run(["bash", "-euo", "pipefail", "-c", param.values[0]], cwd=cwd, env=_env(tmp_path),
                              capture_output=True, text=True, timeout=300)
        out = proc.stdout + proc.stderr
        assert proc.returncode == 0, (param.id, out[-4000:])
        outputs.append(out.replace(str(cwd) + "/", ""))
        folders.append(cwd)
    everything = "\n".join(outputs)
    # what the documented commands promise: a resume from the newest checkpoint, a converted file, the help text
    assert "--ckpt_path latest: resuming from runs/gpt/checkpoints/step=00000002.ckpt" in everything
    assert (folders[0] / "gpt.safetensors").is_file() and "wrote " in everything
    assert "--trainer.strategy.tensor_parallel_size" in everything
    assert _git_status() == before, "the snippets left files in the repository"
    _assert_ignored(folders, harness={"examples"})
