"""What a user installs: the sdist built from this tree, the wheel built from that sdist, installed (not editable)
into a temporary target and used from a directory outside the repository, where the editable finder cannot help:
every module imports, the public names are there, and every CLI verb that needs no training runs."""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
import tarfile
from pathlib import Path

import pytest

from tests._callbacks_helpers import clean_env

ROOT = Path(__file__).resolve().parents[1]

_CHECK = r"""
import importlib, pkgutil, sys
from pathlib import Path
import lightning_npu
site = Path(sys.argv[1]).resolve()
assert Path(lightning_npu.__file__).resolve().is_relative_to(site), lightning_npu.__file__
names = sorted(m.name for m in pkgutil.walk_packages(lightning_npu.__path__, "lightning_npu."))
for name in names:
    importlib.import_module(name)
from lightning_npu import (NPUAccelerator, NPUHybridStrategy, HybridPrecision, full_state_dict, load_full_state_dict,
                           load_checkpoint, grad_norm)
from lightning_npu.callbacks import DynamicCheckpoint, GradientHealthGuard, TrainingGuard, PreemptionCheckpoint
from lightning_npu.ops import rewrite_modules
from lightning_npu.ops.extension import csrc_dir
from lightning_npu.planner import plan
src = csrc_dir()
assert src is not None and src.resolve().is_relative_to(site) and any(src.glob("*.cpp")), src

# every CLI verb that needs no training, in this one process (each costs seconds of imports on its own)
import contextlib, io
from lightning_npu.cli import main
for argv, expect, codes in (
    (["plan", "--memory-only", "--params", "7.5e9", "--devices", "64", "--zero-stage", "1"], "GB per device", (0,)),
    (["plan", "--layers", "4", "--hidden", "256", "--heads", "4", "--vocab", "512", "--seq", "128",
      "--global-batch", "8", "--devices", "8", "--json"], "tensor_parallel_size", (0,)),
    (["doctor", "--json"], '"torch"', (0, 1)),
    (["fit", "--trainer.strategy.help", "npu_hybrid"], "tensor_parallel_size", (0,)),
):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        try:
            main(argv)
            code = 0
        except SystemExit as exit_:
            code = exit_.code or 0
    assert code in codes and expect in out.getvalue(), (argv, code, out.getvalue()[-2000:])
# build-ops is wired (a real build is tests/test_ops_build.py's: minutes for a fresh install path)
import os
os.environ["LIGHTNING_NPU_NO_EXT"] = "1"
err = io.StringIO()
with contextlib.redirect_stderr(err):
    try:
        main(["build-ops"])
    except SystemExit as exit_:
        assert exit_.code == 1, exit_.code
assert "disabled by LIGHTNING_NPU_NO_EXT=1" in err.getvalue(), err.getvalue()
print("modules", len(names))
"""


def _build(tmp: Path) -> tuple[Path, Path]:
    """sdist from the tree, then the wheel from the unpacked sdist (so the wheel proves the sdist is complete)."""
    dist = tmp / "dist"
    dist.mkdir()
    build = "from setuptools import build_meta as b; import sys; print(getattr(b, sys.argv[1])(sys.argv[2]))"
    run = dict(capture_output=True, text=True, timeout=300, check=True)
    sdist = dist / subprocess.run([sys.executable, "-c", build, "build_sdist", str(dist)], cwd=ROOT,
                                  **run).stdout.split()[-1]
    with tarfile.open(sdist) as tar:
        tar.extractall(tmp / "src", filter="data")
    (src,) = (tmp / "src").iterdir()
    wheel = dist / subprocess.run([sys.executable, "-c", build, "build_wheel", str(dist)], cwd=src,
                                  **run).stdout.split()[-1]
    return sdist, wheel


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("packaging")
    sdist, wheel = _build(tmp)
    site = tmp / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--no-compile",
                    "--target", str(site), str(wheel)], capture_output=True, text=True, timeout=300, check=True)
    outside = tmp / "elsewhere"
    outside.mkdir()
    return sdist, wheel, site, outside


def _python(site: Path, outside: Path, *args: str) -> subprocess.CompletedProcess:
    # -S: no site-packages processing, so no editable finder or .pth; the dependencies' folder is named explicitly
    # and no launcher variables an earlier in-process Trainer left (LOCAL_RANK, MASTER_PORT: a `fit` would join them)
    env = {k: v for k, v in clean_env().items() if k != "PYTHONPATH"}
    env.update(PYTHONPATH=os.pathsep.join([str(site), sysconfig.get_paths()["purelib"]]), OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-S", *args], cwd=outside, env=env, capture_output=True, text=True,
                          timeout=300)


def test_sdist_holds_every_package_and_the_kernel_sources(installed):
    sdist, *_ = installed
    with tarfile.open(sdist) as tar:
        names = {Path(*Path(n).parts[1:]).as_posix() for n in tar.getnames()}
    packages = {p.parent.relative_to(ROOT).as_posix() for p in (ROOT / "lightning_npu").rglob("__init__.py")}
    assert {f"{p}/__init__.py" for p in packages} <= names
    assert {f"lightning_npu/_csrc/{p.name}" for p in (ROOT / "csrc").iterdir()} <= names
    assert {"README.md", "pyproject.toml"} <= names


def test_installed_wheel_imports_everything_and_runs_the_cli_outside_the_repo(installed):
    _, wheel, site, outside = installed
    packages = {p.parent.relative_to(ROOT).as_posix() for p in (ROOT / "lightning_npu").rglob("__init__.py")}
    assert packages <= {p.parent.relative_to(site).as_posix() for p in site.rglob("lightning_npu/**/__init__.py")}

    proc = _python(site, outside, "-c", _CHECK, str(site))
    assert proc.returncode == 0, proc.stderr[-4000:]
    script = site / "bin" / "lightning-npu"  # the console script pip generated from the wheel's entry points
    assert script.is_file()
    proc = _python(site, outside, str(script), "--help")
    assert proc.returncode == 0 and all(v in proc.stdout for v in ("fit", "plan", "doctor", "convert-checkpoint")), (
        proc.stdout + proc.stderr)[-3000:]


def test_installed_wheel_runs_the_readme_job_outside_the_repo(installed):
    """The README's first command (`lightning-npu fit --config examples/gpt/config.yaml`, 2 processes, pp=2) from the
    installed wheel in a directory holding only a copy of examples/, shortened to 2 steps."""
    import shutil

    _, _, site, outside = installed
    shutil.copytree(ROOT / "examples", outside / "examples", ignore=shutil.ignore_patterns("__pycache__"))
    run = outside / "run"
    proc = _python(site, outside, str(site / "bin" / "lightning-npu"), "fit", "--config", "examples/gpt/config.yaml",
                   "--trainer.max_steps", "2", "--trainer.limit_val_batches", "0",
                   "--trainer.enable_progress_bar", "false", "--trainer.default_root_dir", str(run))
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "`Trainer.fit` stopped: `max_steps=2` reached." in out and "Starting with 2 processes" in out, out[-3000:]
    (ckpt,) = run.glob("checkpoints/step=*.ckpt")
    proc = _python(site, outside, str(site / "bin" / "lightning-npu"), "convert-checkpoint", str(ckpt),
                   str(outside / "gpt_full.pt"))
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    assert (outside / "gpt_full.pt").stat().st_size > 0
