"""`lightning-npu convert-checkpoint SRC DST --to hf`: a checkpoint of a LightningModule that holds a
`transformers.PreTrainedModel` -> a ``save_pretrained`` folder (``from_pretrained`` loads it, no lightning-npu).

At save time npu_hybrid records the model's class, its config (JSON) and its place in the LightningModule
(``checkpoint["lightning_npu"]["hf"]``); here the model is rebuilt from that config (no download, no
weights initialised), given the checkpoint's full tensors and saved.
"""

from __future__ import annotations

from pathlib import Path
from typing import Union

from lightning_npu.extras import import_optional
from lightning_npu.parallel.checkpoint.formats import hf_info, load_checkpoint

_PathLike = Union[str, Path]


class NotATransformersCheckpointError(ValueError):
    """The checkpoint holds no transformers model (or was saved before lightning-npu recorded one)."""


def export_hf(src: _PathLike, dst: _PathLike) -> Path:
    """Write ``dst`` (a folder) with ``save_pretrained`` from the checkpoint ``src`` (a file or a sharded
    directory, saved under any layout). Returns ``dst``."""
    import torch

    checkpoint = load_checkpoint(src)
    info = hf_info(checkpoint)
    if info is None:
        raise NotATransformersCheckpointError(
            f"{str(src)!r} holds no transformers model: `--to hf` needs a LightningModule whose model is a "
            "`transformers.PreTrainedModel`, saved by npu_hybrid (which records the model's config). Convert it to "
            "a state-dict file instead (leave out `--to hf`) or to a Lightning file (`--to lightning`)."
        )
    transformers = import_optional("transformers", "convert-checkpoint --to hf")
    cls = getattr(transformers, info["class"], None)
    # the name comes from the file: only a transformers model class is instantiated, nothing else it could name
    if not (isinstance(cls, type) and issubclass(cls, transformers.PreTrainedModel)):
        raise NotATransformersCheckpointError(
            f"{str(src)!r} was saved from transformers.{info['class']!r}, which is not a model class of this "
            f"transformers {transformers.__version__}; install the version that trained it."
        )
    config = cls.config_class.from_dict(info["config"])
    with torch.device("meta"):  # no weight initialisation: every tensor comes from the checkpoint
        model = cls(config)
    prefix = info["prefix"]
    state = {k[len(prefix):]: v for k, v in checkpoint["state_dict"].items() if k.startswith(prefix)}
    unexpected = model.load_state_dict(state, strict=False, assign=True).unexpected_keys
    model.tie_weights()  # tied heads share the embedding's tensor
    missing = [k for k, v in model.state_dict().items() if v.is_meta]
    if missing or unexpected:
        raise NotATransformersCheckpointError(
            f"{str(src)!r} does not match transformers.{info['class']} built from its recorded config: missing "
            f"{missing[:8]}, unexpected {unexpected[:8]}."
        )
    dst = Path(dst)
    model.save_pretrained(dst)
    return dst
