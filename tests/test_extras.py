"""A feature whose optional package is missing names the pip extra that installs it, in one line."""

import sys

import pytest

from lightning_npu.extras import EXTRAS, MissingExtraError, import_optional


def test_missing_package_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "safetensors.torch", None)  # what an uninstalled package looks like to import
    with pytest.raises(MissingExtraError, match=r"convert-checkpoint needs the `safetensors` package, which is not "
                                                 r"installed: pip install 'lightning-npu\[hf\]'"):
        import_optional("safetensors.torch", "convert-checkpoint")


def test_every_extra_named_exists_in_pyproject():
    import tomllib
    from pathlib import Path

    extras = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    for module, extra in EXTRAS.items():
        assert any(req.replace("-", "_").startswith(module) for req in extras[extra]), (module, extra)
    assert import_optional("torch", "x").__name__ == "torch"
