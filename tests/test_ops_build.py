"""Building the C++ kernels, without compiling anything: the cache key (tested on names only)."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

from lightning_npu.ops import extension

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture()
def cache(tmp_path, monkeypatch):
    """A private, empty cache and a fresh extension state."""
    root = tmp_path / "cache"
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(root))
    monkeypatch.delenv(extension.DISABLE_ENV, raising=False)
    monkeypatch.delenv("LIGHTNING_NPU_CSRC", raising=False)
    monkeypatch.setattr(extension, "_state", {})
    return root


def _checkout(tmp_path: Path, name: str) -> Path:
    dst = tmp_path / name / "csrc"
    shutil.copytree(ROOT / "csrc", dst)
    return dst


def test_cache_is_keyed_by_the_install_path(cache, tmp_path, monkeypatch):
    """Two checkouts with identical sources, or one checkout under two Pythons, get two build directories."""
    a, b = _checkout(tmp_path, "a"), _checkout(tmp_path, "b")
    monkeypatch.setenv("LIGHTNING_NPU_CSRC", str(a))
    spec_a = extension.build_spec()
    assert spec_a == extension.build_spec()  # stable
    assert spec_a.build_dir == cache / spec_a.name and spec_a.name.startswith(f"lightning_npu_ops_{spec_a.simd}_")
    assert spec_a.library.parent == spec_a.build_dir and spec_a.library.name.startswith(spec_a.name)
    monkeypatch.setenv("LIGHTNING_NPU_CSRC", str(b))
    spec_b = extension.build_spec()
    assert spec_b.name != spec_a.name and spec_b.cflags == spec_a.cflags
    # the resolved path: a symlink to checkout a is checkout a
    link = tmp_path / "link-to-a"
    link.symlink_to(a, target_is_directory=True)
    monkeypatch.setenv("LIGHTNING_NPU_CSRC", str(link))
    assert extension.build_spec().name == spec_a.name
    # another venv (sys.prefix) with the same checkout
    monkeypatch.setenv("LIGHTNING_NPU_CSRC", str(a))
    prefix = sys.prefix
    monkeypatch.setattr(sys, "prefix", str(tmp_path / "other-venv"))
    assert extension.build_spec().name != spec_a.name
    monkeypatch.setattr(sys, "prefix", prefix)
    assert extension.build_spec().name == spec_a.name
    # and still the sources: an edit is a new key
    (a / "gelu.cpp").write_text((a / "gelu.cpp").read_text() + "\n// edited\n")
    assert extension.build_spec().name != spec_a.name
    assert not cache.exists()  # computing the key creates nothing
