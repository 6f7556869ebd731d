"""A multi-branch model for the planner: towers (CLIP's vision and text models), each a `ModelSpec`, that
`branch_layouts` can run at their own tp sizes, plus the few parameters outside them.

Read from a `transformers` CLIP ``config.json`` (``vision_config`` / ``text_config``: what ``save_pretrained`` writes,
which leaves out values equal to transformers' defaults, so those defaults are here) or from a LightningCLI config
of ``examples.clip.model.CLIPModule``. A tower is an encoder: no output layer (``lm_head=False``); the vision tower's
"vocabulary" is empty and its patch projection, class token and pre-norm are `input_params` (tensor parallelism keeps
them whole, as it does the projections into the joint space, counted in `trunk_params`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lightning_npu.parallel.data_parallel.compression_spec import parse_compression
from lightning_npu.parallel.errors import CompressionConfigError
from lightning_npu.planner.spec import ModelSpec, PlannerError

# transformers' CLIPTextConfig / CLIPVisionConfig / CLIPConfig defaults (save_pretrained leaves them out)
CLIP_TEXT = dict(vocab_size=49408, hidden_size=512, intermediate_size=2048, num_hidden_layers=12,
                 num_attention_heads=8, max_position_embeddings=77)
CLIP_VISION = dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
                   num_channels=3, image_size=224, patch_size=32)
CLIP_PROJECTION_DIM = 512
# the module names a LightningModule holding the CLIPModel as `self.model` gives the towers (examples/clip)
VISION, TEXT = "vision_model", "text_model"
MODES = ("bf16", "int8", "topk", "onebit")  # the branch compressions the planner can cost


@dataclass(frozen=True)
class Tower:
    """One branch: the module glob the strategy's `branch_layouts` names, its sizes, and the compression of its
    branch-dp gradient sum (None: fp32 all-reduce)."""

    glob: str
    model: ModelSpec
    compression: Any = None


@dataclass(frozen=True)
class BranchedModel:
    """`towers` run one after another on every sample of the `global_batch`; `trunk_params` (replicated, outside the
    towers) join their outputs. Each tower's `ModelSpec.seq` is its tokens per sample (patches + 1 for a ViT)."""

    towers: tuple[Tower, ...]
    global_batch: int
    trunk_params: int = 0

    def __post_init__(self) -> None:
        if len(self.towers) < 2:
            raise PlannerError(f"a multi-branch model needs at least two towers, got {len(self.towers)}; plan a "
                               "single-tower model with a ModelSpec.")
        if len({t.glob for t in self.towers}) < len(self.towers):
            raise PlannerError(f"tower globs {[t.glob for t in self.towers]} repeat; give each tower its own module.")
        for t in self.towers:
            check_compression(t.glob, t.compression)

    def num_params(self) -> int:
        return sum(t.model.num_params() for t in self.towers) + self.trunk_params

    @property
    def layers(self) -> int:
        return sum(t.model.layers for t in self.towers)

    def with_global_batch(self, global_batch: int) -> "BranchedModel":
        towers = tuple(dataclasses.replace(t, model=dataclasses.replace(t.model, global_batch=global_batch))
                       for t in self.towers)
        return dataclasses.replace(self, towers=towers, global_batch=global_batch)

    def with_compression(self, compression: dict[str, Any]) -> "BranchedModel":
        """The model with `compression` ({tower glob: mode or options}) on its towers; an unknown glob is an error."""
        globs = [t.glob for t in self.towers]
        for glob in compression:
            if glob not in globs:
                raise PlannerError(f"--branch-compression {glob}=...: no tower {glob!r}; the towers are {globs}.")
        return dataclasses.replace(self, towers=tuple(
            dataclasses.replace(t, compression=compression.get(t.glob, t.compression)) for t in self.towers))


def check_compression(glob: str, value: Any) -> None:
    """What the strategy takes on a branch (`parse_compression`) and the planner can cost: one of `MODES`, with or
    without ``frozen_variance`` (1-bit Adam: its momentum sent in that mode's bytes after the warm-up)."""
    if value is None:
        return
    where = f"the branch compression of {glob!r}"
    try:
        spec = parse_compression(value)
    except (CompressionConfigError, TypeError) as err:
        raise PlannerError(f"{where}: {err}") from None
    if isinstance(spec, dict) or spec.mode not in MODES:
        raise PlannerError(f"{where} is {value!r}; the planner costs one of {', '.join(MODES)} on a branch (not "
                           "powersgd, not module globs): pass one of those, or none.")


def one_bit_adam(value: Any) -> bool:
    """A branch compression with ``frozen_variance`` (1-bit Adam): the strategy builds it only with the branch's and
    the top level's zero_stage 0 (it compresses each rank's whole momentum, which ZeRO shards)."""
    spec = parse_compression(value) if value is not None else None
    return spec is not None and not isinstance(spec, dict) and spec.frozen_variance


def compression_spec(value: Any) -> Any:
    """The strategy's parsed form (`CompressionSpec`, or None) of a branch compression."""
    return parse_compression(value)


def _tower(sizes: dict[str, Any], global_batch: int, vision: bool) -> ModelSpec:
    h = int(sizes["hidden_size"])
    common = dict(layers=int(sizes["num_hidden_layers"]), hidden=h, heads=int(sizes["num_attention_heads"]),
                  ffn=int(sizes["intermediate_size"]), global_batch=global_batch, mlp="gelu", attention="flash",
                  bias=True, norm="layernorm", learned_positions=True, sequence_parallel_ok=False, lm_head=False)
    if vision:  # patches + the class token; the patch conv (no bias), class token and pre-norm stay whole
        patch, channels = int(sizes["patch_size"]), int(sizes["num_channels"])
        tokens = (int(sizes["image_size"]) // patch) ** 2 + 1
        return ModelSpec(vocab=0, seq=tokens, input_params=channels * patch * patch * h + h + 2 * h, **common)
    return ModelSpec(vocab=int(sizes["vocab_size"]), seq=int(sizes["max_position_embeddings"]), **common)


def clip_model(text: dict[str, Any], vision: dict[str, Any], projection_dim: int, global_batch: int,
               prefix: str = "model.") -> BranchedModel:
    """A CLIPModel's towers from its text and vision sizes (transformers' names; defaults filled in)."""
    t = _tower({**CLIP_TEXT, **{k: v for k, v in text.items() if v is not None}}, global_batch, vision=False)
    v = _tower({**CLIP_VISION, **{k: v for k, v in vision.items() if v is not None}}, global_batch, vision=True)
    trunk = projection_dim * (t.hidden + v.hidden) + 1  # visual/text projections (no bias), logit_scale
    return BranchedModel((Tower(prefix + VISION, v), Tower(prefix + TEXT, t)), global_batch, trunk)


def is_branched_config(config: dict) -> bool:
    model = config.get("model")
    cls = str(model.get("class_path", "")) if isinstance(model, dict) else ""
    return ("vision_config" in config and "text_config" in config) or cls.rsplit(".", 1)[-1] == "CLIPModule"


def branched_from_config(path: Path, config: dict, global_batch: Any, prefix: str = "model.") -> BranchedModel:
    """A `BranchedModel` from a CLIP ``config.json`` or a LightningCLI config of examples/clip's CLIPModule (its
    init_args and defaults); the global batch is `global_batch`, else the data's batch size x devices / tp."""
    if "vision_config" in config:
        kind = config.get("model_type", "clip")
        if kind != "clip":
            raise PlannerError(f"{path}: a two-tower config of model_type {kind!r}; the planner reads CLIP's "
                               "(vision_config/text_config with a class token and no pooling head): pass a CLIP "
                               "config.json.")
        if global_batch is None:
            raise PlannerError(f"{path}: a transformers config.json does not give the training batch; pass "
                               "--global-batch N (image-text pairs per optimizer step).")
        return clip_model(config.get("text_config") or {}, config.get("vision_config") or {},
                          int(config.get("projection_dim") or CLIP_PROJECTION_DIM), int(global_batch), prefix)
    args = dict((config["model"].get("init_args") or {}))
    h = {**_CLIP_MODULE, **args}
    tower = dict(hidden_size=h["hidden_size"], intermediate_size=h["intermediate_size"],
                 num_hidden_layers=h["num_hidden_layers"], num_attention_heads=h["num_attention_heads"])
    if global_batch is None:
        trainer = config.get("trainer") or {}
        data = (config.get("data") or {}).get("init_args") or {}
        strategy = trainer.get("strategy") if isinstance(trainer.get("strategy"), dict) else {}
        tp = int(((strategy or {}).get("init_args") or {}).get("tensor_parallel_size", 1))
        devices = trainer.get("devices", 1)
        global_batch = int(data.get("batch_size", 32)) * (devices // tp if isinstance(devices, int) else 1)
    model = clip_model(dict(vocab_size=h["vocab_size"], max_position_embeddings=h["max_length"], **tower),
                       dict(image_size=h["image_size"], patch_size=h["patch_size"], num_channels=3, **tower),
                       int(h["projection_dim"]), int(global_batch), prefix)
    return model.with_compression(_config_compression(config, model))


# examples.clip.model.CLIPModule's defaults
_CLIP_MODULE = dict(vocab_size=192, max_length=16, image_size=32, patch_size=8, hidden_size=64, intermediate_size=128,
                    num_hidden_layers=2, num_attention_heads=4, projection_dim=32)


def _config_compression(config: dict, model: BranchedModel) -> dict[str, Any]:
    """The branch compressions a LightningCLI config's strategy sets, for the towers it names."""
    strategy = (config.get("trainer") or {}).get("strategy")
    branches = ((strategy or {}).get("init_args") or {}).get("branch_layouts") if isinstance(strategy, dict) else None
    globs = {t.glob for t in model.towers}
    return {g: o["gradient_compression"] for g, o in (branches or {}).items()
            if g in globs and isinstance(o, dict) and o.get("gradient_compression") is not None}
