"""Optional dependencies, imported where a feature needs them, with one error naming the pip extra that brings them."""

from __future__ import annotations

import importlib
from types import ModuleType

# module -> the extra of lightning-npu that installs it
EXTRAS = {"transformers": "hf", "safetensors": "hf", "prometheus_client": "metrics", "matplotlib": "bench"}


class MissingExtraError(ImportError):
    """A feature needs an optional package; the message names the extra to install."""


def import_optional(module: str, feature: str) -> ModuleType:
    try:
        return importlib.import_module(module)
    except ImportError as err:
        top = module.split(".")[0]
        extra = EXTRAS.get(top)
        how = f"pip install 'lightning-npu[{extra}]'" if extra else f"pip install {top}"
        raise MissingExtraError(f"{feature} needs the `{top}` package, which is not installed: {how}") from err
