"""Which form an ``npu_hybrid`` checkpoint takes, writing the single-file form, and reading either form offline.

Two forms, chosen by the strategy's ``save_distributed_checkpoint`` (Lightning's name, as in
`ModelParallelStrategy`):

* one Lightning ``.ckpt`` file (full tensors in the model's original layout, torch's optimizer format):
  what `LightningModule.load_from_checkpoint`, ``torch.load`` and Lightning's ``"ddp"`` read. Every rank
  gathers the full state (collectives), rank 0 writes it, then commits it through
  `lightning_npu.parallel.checkpoint.commit` (temporary file, old copy set aside, rename, marker) like a directory;
* a sharded DCP directory (`lightning_npu.parallel.checkpoint`): every rank writes only its shards, so it
  scales to models no rank can hold whole, and it reshards to any layout on load.

The default (``None`` / ``"auto"``) is the file where every dp rank holds full tensors anyway (pp = 1,
tp = 1, ZeRO 0/1, where only ZeRO-1's optimizer slices need gathering), the directory otherwise and whenever
``async_save=True`` (background writes are DCP's).
:func:`load_checkpoint` returns Lightning's checkpoint dict for either form in one plain process, after checking
every file against the size and CRC32 its marker recorded (`commit.verify_marked`).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any, Callable, Optional, Union

import torch
from lightning.pytorch.plugins.io import AsyncCheckpointIO, TorchCheckpointIO
from torch import nn

from lightning_npu.parallel.checkpoint import commit as _commit
from lightning_npu.parallel.checkpoint import safe_load as ckpt
from lightning_npu.parallel.checkpoint import sharded
from lightning_npu.parallel.checkpoint.errors import CheckpointSaveError
from lightning_npu.parallel.checkpoint.full_state import (
    cpu_copy,
    full_state_dict,
    full_tensors,
    optimizer_groups,
    select_optimizer_state,
    unfuse_full_tensors,
)
from lightning_npu.parallel.checkpoint.optim_state import STATE_PREFIX, by_position
from lightning_npu.parallel.checkpoint.sharded import layout_metadata

_PathLike = Union[str, Path]


# ---- the option (validated in `ParallelConfig.check_strategy_options`) -----------------------------------
def writes_single_file(cfg: Any, value: Any, async_save: bool = False) -> bool:
    """Whether a save writes one Lightning file (else a sharded directory). `async_save` asks for DCP's background
    writes, which only the directory has."""
    if value is True or (value is not False and async_save):
        return False
    if value is False:
        return True
    # a branch's own ZeRO 2/3 shards it as ZeRO 3 does: the default is the sharded directory, never one gathered file
    sharded_branch = any(b.zero_stage in (2, 3) for b in getattr(cfg, "branches", None) or ())
    return (cfg.pipeline_parallel_size == 1 and cfg.tensor_parallel_size == 1 and cfg.zero_stage in (0, 1)
            and not sharded_branch)


def full_model_state(module: nn.Module, distributed_optimizers: list[Any]) -> dict[str, torch.Tensor]:
    """`lightning_npu.full_state_dict`, with ZeRO-1's fp32 master slices gathered in place of 16-bit parameters
    (the exact weights, as the sharded form stores them). A collective."""
    state = full_state_dict(module)
    for opt in distributed_optimizers:
        masters = {fqn: m for fqn, m in opt.master_state_dict().items() if fqn in state and state[fqn].dtype != m.dtype}
        state.update(cpu_copy(full_tensors(module, masters)))
    return state


# ---- what a checkpoint records about the model -------------------------------------------------
def _pretrained_model(module: nn.Module) -> Optional[tuple[str, nn.Module]]:
    """(FQN prefix, module) of the first `transformers.PreTrainedModel` inside `module`, if transformers is in use."""
    transformers = sys.modules.get("transformers")
    base = getattr(transformers, "PreTrainedModel", None) if transformers is not None else None
    if base is None:
        return None
    for name, sub in module.named_modules():
        if isinstance(sub, base):
            return (name + "." if name else ""), sub
    return None


def hf_metadata(module: nn.Module) -> Optional[dict[str, str]]:
    """What `lightning-npu convert-checkpoint --to hf` needs to rebuild a transformers model: its class, its
    config (JSON text: plain data, loadable with ``weights_only=True``) and where it sits in the module."""
    found = _pretrained_model(module)
    if found is None:
        return None
    prefix, model = found
    return {"class": type(model).__name__, "config": model.config.to_json_string(use_diff=False), "prefix": prefix}


def checkpoint_metadata(cfg: Any, world_size: int, module: nn.Module, optimizers: list[Any],
                        checkpoint: dict[str, Any], single_file: bool) -> dict[str, Any]:
    """The checkpoint's ``"lightning_npu"`` entry: the layout it was saved under, the transformers model it holds
    (for ``--to hf``), and the optimizers' groups by FQN, from which :func:`load_checkpoint` rebuilds torch's
    optimizer format offline (directories) and a resume picks each parameter's state (files). A collective
    under pp."""
    info = layout_metadata(cfg, world_size, module)
    info["hf"] = hf_metadata(module)
    if single_file:
        info["fused"] = {}  # full tensors: the original layout
    if "optimizer_states" in checkpoint:  # a file's too: a pipeline stage picks its parameters' state by FQN
        info["optimizer_groups"] = [optimizer_groups(module, o) for o in optimizers]
    return info


# ---- the train loader's position: npu_hybrid's own, so that other strategies can resume a file --------------
_LOADER_KEYS = ("loops", "fit_loop", "state_dict", "combined_loader")


def _is_resumable_loader_state(state: Any) -> bool:
    return isinstance(state, dict) and {"version", "epoch", "consumed_samples", "global_batch_size"} <= state.keys()


def set_loader_state_aside(checkpoint: dict[str, Any]) -> dict[str, Any]:
    """Move the position of npu_hybrid's resumable train loader (`lightning_npu.parallel.data_parallel.sampler`) from Lightning's
    loop state to ``checkpoint["lightning_npu"]["combined_loader"]``: under "ddp" Lightning's plain loader is not
    stateful and would refuse a stored position ("0 stateful loaders, but found 1 states"); it restarts the epoch
    instead, as for any checkpoint of a non-stateful loader. npu_hybrid puts it back (:func:`restore_loader_state`)."""
    node, parents = checkpoint, []
    for key in _LOADER_KEYS[:-1]:
        if not isinstance(node.get(key) if isinstance(node, dict) else None, dict):
            return checkpoint
        parents.append(node)
        node = node[key]
    states = node.get(_LOADER_KEYS[-1])
    if not states or not all(map(_is_resumable_loader_state, states)):
        return checkpoint
    out = dict(checkpoint)
    level = out
    for key in _LOADER_KEYS[:-1]:
        level[key] = dict(level[key])
        level = level[key]
    del level[_LOADER_KEYS[-1]]
    out["lightning_npu"] = {**(out.get("lightning_npu") or {}), "combined_loader": states}
    return out


def restore_loader_state(checkpoint: dict[str, Any]) -> dict[str, Any]:
    """Inverse of :func:`set_loader_state_aside`, for a resume under npu_hybrid."""
    states = (checkpoint.get("lightning_npu") or {}).get("combined_loader")
    fit = (checkpoint.get("loops") or {}).get("fit_loop") or {}
    if states and isinstance(fit.get("state_dict"), dict):
        fit["state_dict"].setdefault("combined_loader", states)
    return checkpoint


def continue_epoch_after_fit(checkpoint: dict[str, Any], num_training_batches: Any) -> dict[str, Any]:
    """A checkpoint taken once fit stopped before the end of its epoch (`max_steps`, `max_time`, a stop request:
    ``trainer.save_checkpoint`` after fit, a save at train end or epoch end) records the epoch as finished:
    Lightning counts it processed (and completed) on the way out, so a later fit would start the next epoch at its
    first sample. With a resumable train loader the checkpoint becomes what a save at that last batch holds, the
    epoch in progress: a later fit with a larger `max_steps` goes on where the loader stopped, as an uninterrupted
    run does. An epoch that reached its last batch (or `limit_train_batches`) is left finished."""
    fit = (checkpoint.get("loops") or {}).get("fit_loop")
    if not isinstance(fit, dict):
        return checkpoint
    states = (fit.get("state_dict") or {}).get("combined_loader")
    epochs, batches = fit.get("epoch_progress") or {}, fit.get("epoch_loop.batch_progress") or {}
    try:
        total, current, ready = epochs["total"], epochs["current"], batches["current"]["ready"]
        closed = total["ready"] == total["started"] == total["processed"] >= 1
        cut_short = not batches.get("is_last_batch") and 0 < ready < float(num_training_batches)
    except (KeyError, TypeError, ValueError):
        return checkpoint
    if not (states and all(map(_is_resumable_loader_state, states)) and closed and cut_short):
        return checkpoint
    reopened = {}
    for part in ("total", "current"):
        progress = dict(epochs[part])
        progress["processed"] = progress["started"] - 1
        progress["completed"] = min(progress["completed"], progress["processed"])
        reopened[part] = progress
    loops = dict(checkpoint["loops"])
    loops["fit_loop"] = {**fit, "epoch_progress": {**epochs, **reopened}}
    return {**checkpoint, "loops": loops}


def default_marker(checkpoint: dict[str, Any], world_size: int) -> dict[str, Any]:
    """The marker of a checkpoint no callback asked a marker for (``trainer.save_checkpoint``, ModelCheckpoint):
    every npu_hybrid checkpoint records its files' sizes and CRC32s."""
    return {"step": int(checkpoint.get("global_step") or 0), "epoch": checkpoint.get("epoch"),
            "reason": "save_checkpoint", "world_size": world_size, "run": None}


# ---- writing one file --------------------------------------------------------------------------
def _synchronous(checkpoint_io: Any) -> Any:
    """The IO plugin behind an async wrapper (e.g. `DynamicCheckpoint(async_save=True)`'s): the commit follows the
    write at once, so the file must be complete when `save_checkpoint` returns."""
    while isinstance(checkpoint_io, AsyncCheckpointIO):
        checkpoint_io = checkpoint_io.checkpoint_io
    return checkpoint_io if checkpoint_io is not None else TorchCheckpointIO()


def _write(checkpoint: dict[str, Any], tmp: Path, checkpoint_io: Any, checksum: bool,
           storage_options: Any = None) -> Optional[dict[str, Any]]:
    """Write the file; returns its manifest entry when it was checksummed on the way (None: the commit reads it).

    Lightning's default IO (``torch.save`` of the dict) is done here, streamed through a `ChecksumStream` and
    fsynced before the commit renames it: the same bytes, without reading them back for the CRC32. A custom IO
    plugin, or one given `storage_options`, writes as it likes."""
    io = _synchronous(checkpoint_io)
    if type(io) is not TorchCheckpointIO or storage_options is not None:
        io.save_checkpoint(checkpoint, tmp, **({} if storage_options is None else {"storage_options": storage_options}))
        return None
    with open(tmp, "wb") as f:
        stream = _commit.ChecksumStream(f, checksum and _commit.checksums_enabled())
        torch.save(checkpoint, stream)
        f.flush()
        os.fsync(f.fileno())
    return {"": stream.entry()}


def save_file(checkpoint: dict[str, Any], final: _PathLike, token: str, is_rank0: bool, checkpoint_io: Any,
              agree: Callable[[Optional[str]], Optional[str]], request: Optional[_commit.CommitRequest] = None,
              storage_options: Any = None) -> None:
    """Collective. Rank 0 writes `checkpoint` (full tensors) to a temporary sibling and commits it as `final`;
    `agree(message)` broadcasts rank 0's error message, so every rank raises (or not) together. `storage_options`
    go to the CheckpointIO plugin, as Lightning passes them."""
    final = Path(final)
    request = request if request is not None else _commit.CommitRequest()
    tmp = _commit.temp_path(final, token)
    _commit.hold(token, final)
    message: Optional[str] = None
    try:
        if is_rank0:
            try:
                final.parent.mkdir(parents=True, exist_ok=True)
                _commit.clean_stale(final.parent, names=[final.name])
                known = _write(checkpoint, tmp, checkpoint_io, request.checksum and request.marker is not None,
                               storage_options)
                request.committed = _commit.commit(tmp, final, token, request.marker, request.checksum, known=known)
            except Exception as err:
                _commit.remove_path(tmp)
                message = (f"Writing the checkpoint {str(final)!r} failed: {err!r}. A previous checkpoint at that path "
                           "is kept.")
        message = agree(message)
        if message is not None:
            request.error = CheckpointSaveError(message)
    finally:
        _commit.release(token)
        request.done.set()
    if request.error is not None:
        raise request.error


# ---- reading either form offline ----------------------------------------------------------------
def load_checkpoint(path: _PathLike) -> dict[str, Any]:
    """Lightning's checkpoint dict for a single ``.ckpt`` file or a sharded directory saved under any layout.

    ``state_dict`` holds full tensors in the model's original layout; ``optimizer_states`` torch's format
    (full tensors) where the checkpoint records the optimizers' groups (directories written by earlier
    versions do not: then the key is absent); everything else (``hyper_parameters``, ``loops``, ``callbacks``,
    ...) is as Lightning saved it. Runs in one plain process (no process group needed); every file is read
    with ``weights_only=True``. Use it where Lightning's own loader meets a directory, e.g.
    ``model.load_state_dict(lightning_npu.load_checkpoint(path)["state_dict"])``.
    """
    path = sharded.resolve_checkpoint_path(path)
    _commit.verify_marked(path)  # sizes and CRC32s, where the checkpoint has a marker
    if path.is_file():
        return ckpt.safe_torch_load(path)
    if not sharded.is_sharded_checkpoint(path):
        raise FileNotFoundError(
            f"{str(path)!r} is neither a checkpoint file nor a lightning-npu sharded checkpoint directory (no "
            f"{ckpt.META_FILENAME} in it); pass the path ModelCheckpoint or DynamicCheckpoint reported."
        )
    state, meta = sharded.consolidate_model_state(path)
    out = {**meta, "state_dict": state}
    groups = (meta.get("lightning_npu") or {}).get("optimizer_groups")
    if groups:
        out["optimizer_states"] = _consolidate_optimizers(path, meta, groups)
    return out


def own_optimizer_states(module: nn.Module, optimizers: list[Any], checkpoint: dict[str, Any]) -> dict[str, Any]:
    """A single file's whole-model optimizer states, each re-indexed to the parameters its optimizer holds here
    (e.g. one pipeline stage's), where the file records their FQNs; as it is otherwise (plain Lightning files)."""
    groups = (checkpoint.get("lightning_npu") or {}).get("optimizer_groups")
    if not groups or "optimizer_states" not in checkpoint:
        return checkpoint
    states = [select_optimizer_state(module, o, s, [g["params"] for g in saved])
              for o, s, saved in zip(optimizers, checkpoint["optimizer_states"], groups)]
    return {**checkpoint, "optimizer_states": states}


def _consolidate_optimizers(path: Path, meta: dict[str, Any], groups: list[list[dict[str, Any]]]) -> list[dict]:
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    stored = ckpt.checkpoint_tensor_metadata(path)
    fused = (meta.get("lightning_npu") or {}).get("fused") or {}
    out = []
    for i, opt_groups in enumerate(groups):
        prefix = f"optimizer_{i}."
        template = {k: torch.empty(tuple(v.size), dtype=v.properties.dtype) for k, v in stored.items()
                    if k.startswith(prefix + STATE_PREFIX) and isinstance(v, TensorStorageMetadata)}
        if template:
            ckpt.dcp_load(template, path, no_dist=True)
        state = unfuse_full_tensors({k[len(prefix):]: v for k, v in template.items()}, fused, STATE_PREFIX)
        out.append(by_position(opt_groups, state))
    return out


def hf_info(checkpoint: dict[str, Any]) -> Optional[dict[str, Any]]:
    info = (checkpoint.get("lightning_npu") or {}).get("hf")
    return {**info, "config": json.loads(info["config"])} if info else None
