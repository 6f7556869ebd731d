"""`--model PATH`: read a model file into what the planner plans, a single-tower `ModelSpec` (a LightningCLI config,
a transformers config.json) or a two-tower `BranchedModel` (a CLIP config.json, examples/clip's config)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Union

from lightning_npu.config_file import ConfigFileError, read_config
from lightning_npu.planner.branches.model import BranchedModel, branched_from_config, is_branched_config
from lightning_npu.planner.spec import ModelSpec, PlannerError, decoder_from_config


def model_from_config(path: Union[str, Path], **overrides: Any) -> Union[ModelSpec, BranchedModel]:
    """The model `path` describes; `overrides` (the CLI's sizes) win over the file's. A two-tower model takes only
    ``global_batch`` (its towers' sizes are the config's)."""
    path = Path(path)
    if not path.is_file():
        raise PlannerError(
            f"`--model {path}`: no such file; pass a LightningCLI config such as examples/gpt/config.yaml, or a "
            "transformers config.json."
        )
    try:
        config = read_config(path)
    except ConfigFileError as err:
        raise PlannerError(f"--model {err}") from None
    if not is_branched_config(config):
        return decoder_from_config(path, config, **overrides)
    unknown = sorted(k for k, v in overrides.items() if v is not None and k != "global_batch")
    if unknown:
        raise PlannerError(f"--model {path}: a two-tower model takes its sizes from the config; drop "
                           f"{', '.join('--' + k.replace('_', '-') for k in unknown)} (only --global-batch applies).")
    return branched_from_config(path, config, overrides.get("global_batch"))
