"""Sharded, atomic, reshardable checkpoints with `torch.distributed.checkpoint` (DCP).

A checkpoint is a directory (the path Lightning's `ModelCheckpoint` names, e.g.
``epoch=0-step=3.ckpt/``) holding:

* DCP's shard files (``__<rank>_0.distcp``) and ``.metadata``: every rank writes the tensors it
  owns; replicated tensors (ZeRO 0/1 parameters) are written once (DCP's de-duplication);
* ``meta.pt`` (rank 0): everything else Lightning puts in a checkpoint (epoch, global step,
  loops, callbacks, LR schedulers, precision/loss-scaler state, hyper-parameters) plus our
  ``"lightning_npu"`` entry: format version and the layout it was saved under.

The tensor keys do not depend on the layout, which is what makes resharding work:

* ``state_dict.<fqn>``: the LightningModule's `state_dict` keys. Every tensor is a DTensor where
  the layout shards it: FSDP2 shards (ZeRO 2/3), tensor-parallel shards (plain local shards under
  ZeRO 0/1 are presented as DTensor views of themselves, so DCP loads in place), and under ZeRO 1
  the `DistributedOptimizer`'s fp32 master slices instead of the replicated parameters;
* ``optimizer_<i>.state.<fqn>.<name>`` and ``optimizer_<i>.param_groups.<fqn>.<hparam>``: the
  flattened form of `torch.distributed.checkpoint.state_dict.get_optimizer_state_dict`; under
  ZeRO 1, 2 and 3 every rank contributes its dp slices of each state tensor.

Loading (:func:`load_directory`, the one loader) builds the same keys for the *current* layout and lets DCP read
the needed slices; fused projections saved under another tp size are read whole and re-sliced, a step inside it.
Names and directory layout match Lightning's `ModelParallelStrategy` (``meta.pt``,
``state_dict``, ``optimizer_<i>``).

Atomicity: everything is written to a hidden sibling and committed once, by rank 0, after every
rank's write finished, through `lightning_npu.parallel.checkpoint.commit` (the package's one commit path: the
old copy is set aside, never deleted, before the rename). An async save is committed by rank 0 as
soon as DCP reports the write complete, not at the next save.

Integrity: every rank checksums the shards it writes while writing them (`ChecksumFileSystemWriter`, DCP's
writer with a recording file system); DCP's gather of the write results brings the CRC32s to rank 0, whose
commit records them in the marker with ``meta.pt`` and ``.metadata``. A failure on any rank (the write, or
rank 0's commit) is raised as the same `CheckpointSaveError` on every rank.

Trust: ``meta.pt`` is read with ``torch.load(weights_only=True)``, DCP's pickled ``.metadata``
through a restricted unpickler (DCP's metadata classes and plain data only) and every non-tensor entry of
a shard (optimizer param groups, ...) with ``weights_only=True`` by `SafeLoadPlanner` (DCP's default
planner uses ``weights_only=False`` there), so a planted file is refused with an `UnsafeCheckpointError`
instead of running code. Every DCP read goes through :func:`dcp_load`.
"""

from __future__ import annotations

import logging
import shutil
import sys
import threading
from concurrent.futures import Future
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.metadata import MetadataIndex, TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.storage import WriteResult
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

from lightning_npu.parallel.checkpoint import commit as _commit
from lightning_npu.parallel.checkpoint.commit import ChecksumStream, CommitRequest, checksums_enabled, temp_path
from lightning_npu.parallel.checkpoint.errors import CheckpointMismatchError, CheckpointSaveError
from lightning_npu.parallel.checkpoint.full_state import relayout_fused, shard_like, unfuse_full_tensors
from lightning_npu.parallel.checkpoint.optim_state import (
    FLAT_OPTIONS,
    STATE_PREFIX,
    flat_state,
    initialised_state,
    split_state_key,
)
from lightning_npu.parallel.checkpoint.safe_load import (
    META_FILENAME,
    _PathLike,
    checkpoint_tensor_metadata,
    dcp_load,
    read_meta,
    safe_torch_load,
)
from lightning_npu.parallel.optim.mixed_precision import unwrap_optimizer
from lightning_npu.parallel.state import tensor_state
from lightning_npu.parallel.tensor_parallel import shards as tp_shards
from lightning_npu.parallel.tensor_parallel.shards import fused_layout

log = logging.getLogger(__name__)
FORMAT_VERSION = 1
MODEL_KEY = "state_dict"


# ---- layout-independent state dicts ----------------------------------------------------------
def _view(value: Any, param: Optional[torch.Tensor]) -> Any:
    """`value` as a DTensor over its own storage where `param` is a local tp shard (`tp_shards.as_dtensor`):
    DCP writes its global offsets and loads in place; `_settle` hands the local tensor back."""
    view = tp_shards.as_dtensor(value, param) if param is not None else value
    if view is not value:
        tensor_state(view).view = True
    return view


def model_state_dict(module: torch.nn.Module, optimizers: Iterable[Optimizer] = ()) -> dict[str, Any]:
    """The module's state dict as this rank holds it, keyed by FQN whatever the layout.

    DTensor shards under ZeRO 3 / TP (local tp shards as DTensor views of themselves);
    parameters a ZeRO-1 `DistributedOptimizer` steps as its fp32 master slices (the exact weights).
    """
    sd = get_model_state_dict(module, options=StateDictOptions(full_state_dict=False))
    params = dict(module.named_parameters(remove_duplicate=False))
    masters = [o for o in map(unwrap_optimizer, optimizers) if hasattr(o, "master_of")]
    for key, value in sd.items():
        param = params.get(key)
        master = next((m for m in (o.master_of(param) for o in masters) if m is not None), None) if param is not None else None
        sd[key] = master if master is not None else _view(value, param)
    return sd


def optimizer_state_dict(module: torch.nn.Module, optimizer: Optimizer) -> dict[str, Any]:
    """Flattened, FQN-keyed optimizer state of this rank (its ZeRO-1 slices, FSDP shards, or TP local shards)."""
    local = unwrap_optimizer(optimizer)
    osd = flat_state(module, local)
    if hasattr(local, "sharded_state_dict"):
        return osd  # ZeRO-1 DistributedOptimizer: DTensor slices
    params = dict(module.named_parameters(remove_duplicate=False))
    for key, value in osd.items():
        if key.startswith(STATE_PREFIX):
            osd[key] = _view(value, params.get(split_state_key(key)[0]))
    return osd


def _settle(templates: dict[str, Any], loaded: dict[str, Any]) -> dict[str, Any]:
    """Write loaded values that are not the templates themselves (e.g. re-sliced full tensors) into the
    templates' local storage where those are views/masters; return plain local tensors for the views."""
    out = {}
    for key, value in loaded.items():
        template = templates.get(key)
        marks = tensor_state(template, create=False) if isinstance(template, torch.Tensor) else None
        is_view, is_master = (marks.view, marks.master) if marks is not None else (False, False)
        if (is_view or is_master) and value is not template:
            with torch.no_grad():
                template.to_local().copy_(value.to_local() if isinstance(value, DTensor) else value)
            value = template
        out[key] = value.to_local() if is_view else value
    return out


def load_model_state(module: torch.nn.Module, templates: dict[str, Any], loaded: dict[str, Any],
                     optimizers: Iterable[Optimizer] = ()) -> None:
    """Apply a model state dict from :func:`model_state_dict` that DCP has filled (or that was re-sliced)."""
    settled = _settle(templates, loaded)
    masters = [k for k, t in templates.items() if isinstance(t, torch.Tensor)
               and getattr(tensor_state(t, create=False), "master", False)]
    rest = {k: v for k, v in settled.items() if k not in masters}
    set_model_state_dict(module, rest, options=StateDictOptions(strict=False))
    for opt in map(unwrap_optimizer, optimizers):
        if hasattr(opt, "gather_parameters"):
            opt.gather_parameters()  # masters were loaded: rebuild the replicated parameters from them


def load_optimizer_state(module: torch.nn.Module, optimizer: Optimizer, state: dict[str, Any],
                         templates: Optional[dict[str, Any]] = None) -> None:
    local = unwrap_optimizer(optimizer)
    state = _settle(templates if templates is not None else state, state)
    if hasattr(local, "load_sharded_state_dict"):
        local.load_sharded_state_dict(state)
        return
    with initialised_state(local):
        set_optimizer_state_dict(module, local, state, options=FLAT_OPTIONS)


# ---- paths ------------------------------------------------------------------------------------
def is_sharded_checkpoint(path: _PathLike) -> bool:
    path = Path(path)
    return path.is_dir() and (path / META_FILENAME).is_file()


def resolve_checkpoint_path(path: _PathLike) -> Path:
    """`path`, or the complete copy set aside by an overwrite that crashed before its final rename."""
    return _commit.resolve_checkpoint_path(path, is_loadable=lambda p: is_sharded_checkpoint(p) or p.is_file())


# ---- writer -----------------------------------------------------------------------------------
class _RecordingFileSystem(FileSystem):
    """DCP's local file system, whose write streams keep each file's size and CRC32 (`ChecksumStream`)."""

    def __init__(self, checksum: bool) -> None:
        super().__init__()
        self.checksum = checksum
        self._records: dict[str, dict[str, Any]] = {}
        self._lock = threading.Lock()

    @contextmanager
    def create_stream(self, path: Any, mode: str) -> Iterator[Any]:
        with super().create_stream(path, mode) as stream:
            if "w" not in mode:
                yield stream
                return
            recording = ChecksumStream(stream, self.checksum)
            yield recording
        with self._lock:
            self._records[Path(path).name] = recording.entry()

    def take(self) -> dict[str, dict[str, Any]]:
        with self._lock:
            out, self._records = self._records, {}
        return out


class ChecksumFileSystemWriter(FileSystemWriter):
    """`FileSystemWriter` whose ranks checksum the shards they write as they write them (no read-back), and
    whose coordinator collects the CRC32s from DCP's write results into `files` (file -> size, crc32) for the
    commit's manifest. The extra results are removed before DCP writes ``.metadata``, which stays DCP's own."""

    _KEY = "__lightning_npu_file__/"

    def __init__(self, path: Any, checksum: bool = True, **kwargs: Any) -> None:
        super().__init__(path, **kwargs)
        self.fs = _RecordingFileSystem(checksum)
        self.files: dict[str, dict[str, Any]] = {}

    def write_data(self, plan: Any, planner: Any) -> Any:
        results = list(super().write_data(plan, planner).value())  # FileSystemWriter writes synchronously
        results += [WriteResult(index=MetadataIndex(self._KEY + name), size_in_bytes=entry["size"], storage_data=entry)
                    for name, entry in self.fs.take().items()]
        future: torch.futures.Future = torch.futures.Future()
        future.set_result(results)
        return future

    def finish(self, metadata: Any, results: list[list[Any]]) -> None:
        files: dict[str, dict[str, Any]] = {}
        kept = []
        for rank_results in results:
            kept.append([r for r in rank_results if not r.index.fqn.startswith(self._KEY)])
            files.update({r.index.fqn[len(self._KEY):]: r.storage_data for r in rank_results
                          if r.index.fqn.startswith(self._KEY)})
        super().finish(metadata, kept)
        written = self.fs.take().get(".metadata.tmp")  # DCP writes it under this name, then renames it
        if written is not None:
            files[".metadata"] = written
        self.files = files


Agree = Callable[[Optional[str]], Optional[str]]


class ShardedCheckpointWriter:
    """Writes DCP checkpoints atomically, synchronously or in a background thread (`async_save=True`).

    An async save stages a CPU copy of the shards before returning, so training can go on
    mutating parameters. Rank 0 commits it from DCP's completion callback: DCP resolves rank 0's
    future only after every rank's shards and the ``.metadata`` are on disk, so the checkpoint is
    visible as soon as it is complete, needs no collective, and survives a peer that crashes later.
    `finalize()` (before the next save or load, and at teardown) only waits and reports errors.

    `agree(message)` returns rank 0's value on every rank (a broadcast): where only rank 0 can fail (its
    preparation, its commit), every rank learns it there and raises the same error, instead of waiting in a
    collective that rank 0 never joins.
    """

    def __init__(self, async_save: bool = False) -> None:
        self.async_save = async_save
        self._pending: Optional[tuple[Future, threading.Event, Path, CommitRequest]] = None
        self._async_group: Optional[Any] = None

    @property
    def has_pending(self) -> bool:
        return self._pending is not None

    def _group(self) -> Optional[Any]:
        if not self.async_save or not dist.is_initialized():
            return None
        if self._async_group is None:
            # the background thread's collectives must not share a group with the training step's
            self._async_group = dist.new_group(backend="gloo")
        return self._async_group

    def save(
        self,
        tensors: dict[str, Any],
        meta: dict[str, Any],
        final: _PathLike,
        token: str,
        is_rank0: bool,
        agree: Agree,
        request: Optional[CommitRequest] = None,
    ) -> None:
        """Collective. `token` must be the same on every rank (broadcast it); `agree` broadcasts rank 0's value.

        `request` (e.g. from `DynamicCheckpoint`) adds a completion marker to the commit and is told when
        the commit happened."""
        self.finalize(agree)
        final = Path(final)
        request = request if request is not None else CommitRequest()
        tmp = temp_path(final, token)
        _commit.hold(token, final)
        problem: Optional[str] = None
        if is_rank0:
            try:
                _commit.clean_stale(final.parent, names=[final.name])  # leftovers of crashed saves to this path
                if tmp.exists():
                    shutil.rmtree(tmp)
                tmp.mkdir(parents=True)
                torch.save(meta, tmp / META_FILENAME)
            except Exception as err:
                shutil.rmtree(tmp, ignore_errors=True)
                problem = (f"Writing the checkpoint {str(final)!r} failed on rank 0: {err!r}. Nothing was committed; a "
                           "previous checkpoint at that path is untouched.")
        problem = agree(problem)  # also the barrier before the shards are written into `tmp`
        if problem is not None:
            self._fail(request, token, CheckpointSaveError(problem))
        # without a marker there is nowhere to record a CRC32: count sizes only
        recorded = request.marker is not None and request.checksum and checksums_enabled()
        writer = ChecksumFileSystemWriter(tmp, checksum=recorded)
        if self.async_save:
            try:
                result = dcp.async_save(_owning_storage(tensors), storage_writer=writer, process_group=self._group())
            except BaseException as err:
                self._finish(None, err, tmp, final, token, is_rank0, request, writer)
                raise request.error from None
            future = getattr(result, "upload_completion", result)  # AsyncSaveResponse (staging) or a Future
            finished = threading.Event()

            def on_done(fut: Future) -> None:
                try:
                    self._finish(fut, fut.exception(), tmp, final, token, is_rank0, request, writer)
                finally:
                    finished.set()

            self._pending = (future, finished, final, request)
            future.add_done_callback(on_done)
            return
        error: Optional[BaseException] = None
        try:
            dcp.save(tensors, storage_writer=writer)
        except CheckpointException as err:  # raised on every rank when any rank's write failed
            error = err
        self._finish(None, error, tmp, final, token, is_rank0, request, writer)
        self._agree_on(request, agree)

    @staticmethod
    def _fail(request: CommitRequest, token: str, error: CheckpointSaveError) -> None:
        request.error = error
        _commit.release(token)
        request.done.set()
        raise error

    @staticmethod
    def _agree_on(request: CommitRequest, agree: Agree) -> None:
        """Every rank raises rank 0's error (a failed commit is known only there), or none does."""
        message = agree(str(request.error) if request.error is not None else None)
        if message is None:
            return
        if request.error is None or str(request.error) != message:
            request.error = CheckpointSaveError(message)
        raise request.error

    @staticmethod
    def _finish(fut: Optional[Future], error: Optional[BaseException], tmp: Path, final: Path, token: str,
                is_rank0: bool, request: CommitRequest, writer: Optional[ChecksumFileSystemWriter] = None) -> None:
        """Commit a finished write on rank 0, or remove what a failed one left; tell `request` either way."""
        try:
            if error is None and is_rank0:
                request.committed = _commit.commit(tmp, final, token, request.marker, request.checksum,
                                                   known=writer.files if writer is not None else None)
            elif error is not None:
                if is_rank0:
                    shutil.rmtree(tmp, ignore_errors=True)
                request.error = _save_error(error, final)
        except BaseException as err:  # a failing commit (disk full) is the save's error
            if is_rank0:
                shutil.rmtree(tmp, ignore_errors=True)
            request.error = CheckpointSaveError(f"Committing the checkpoint {str(final)!r} failed on rank 0: {err!r}. "
                                                "A previous checkpoint at that path is kept.")
            request.error.__cause__ = err
        finally:
            _commit.release(token)
            request.done.set()

    def finalize(self, agree: Optional[Agree] = None) -> None:
        """Wait for an async save (rank 0 commits it as soon as it finished) and raise its error, if any: with
        `agree` on every rank alike (collective), without it (teardown, after errors) where it happened."""
        if self._pending is None:
            return
        future, finished, final, request = self._pending
        self._pending = None
        finished.wait()
        if agree is not None:
            self._agree_on(request, agree)
        elif request.error is not None:
            raise request.error


def finalize_at_teardown(writer: ShardedCheckpointWriter) -> None:
    """No collective (teardown also runs after exceptions); a failed async write is logged instead of
    raised while another error is already on its way up, so the run's first error is the one reported."""
    in_flight = sys.exc_info()[1] is not None  # Lightning tears down inside its `except` on failures
    try:
        writer.finalize()
    except Exception as err:
        if not in_flight:
            raise
        log.error("%s", err)


def _save_error(err: BaseException, final: Path) -> BaseException:
    if isinstance(err, CheckpointException):
        failures = err.failures
        first = next(iter(failures.values())) if failures else err
        first = first[0] if isinstance(first, tuple) else first
        out = CheckpointSaveError(
            f"Writing the checkpoint {str(final)!r} failed on rank(s) {sorted(failures)}: {first!r}. Nothing was "
            "committed; a previous checkpoint at that path is untouched."
        )
    else:
        out = CheckpointSaveError(
            f"Writing the checkpoint {str(final)!r} failed: {err!r}. Nothing was committed; a previous checkpoint "
            "at that path is untouched."
        )
    out.__cause__ = err
    return out


def _owning_storage(tree: Any) -> Any:
    """DTensors over a view (ZeRO-1 slices of a bucket) get a copy of their local tensor: DCP's async staging
    deep-copies CPU DTensors, which fails on views in torch 2.13 ("invalid python storage")."""
    if isinstance(tree, dict):
        return {k: _owning_storage(v) for k, v in tree.items()}
    if isinstance(tree, DTensor):
        local = tree.to_local()
        if local._base is not None or local.untyped_storage().nbytes() != local.numel() * local.element_size():
            return DTensor.from_local(local.detach().clone(), tree.device_mesh, tree.placements, run_check=False,
                                      shape=tree.shape, stride=tree.stride())
    return tree


def _describe(keys: Iterable[str], limit: int = 12) -> str:
    keys = sorted(keys)
    shown = ", ".join(keys[:limit])
    return shown + (f", ... ({len(keys) - limit} more)" if len(keys) > limit else "")


def check_model_keys(stored: dict[str, Any], expected: dict[str, Any], path: _PathLike, strict: bool) -> dict:
    """Compare the checkpoint's model entries with the module's; raise naming the keys that differ."""
    prefix = MODEL_KEY + "."
    ckpt = {k[len(prefix):]: v for k, v in stored.items() if k.startswith(prefix)}
    missing = set(expected) - set(ckpt)
    unexpected = set(ckpt) - set(expected)
    shapes = [
        f"{k}: checkpoint {tuple(ckpt[k].size)} vs model {tuple(expected[k].shape)}"
        for k in set(expected) & set(ckpt)
        if isinstance(ckpt[k], TensorStorageMetadata) and tuple(ckpt[k].size) != tuple(expected[k].shape)
    ]
    problems = []
    if strict and missing:
        problems.append(f"missing keys (in the model, not in the checkpoint): {_describe(missing)}")
    if strict and unexpected:
        problems.append(f"unexpected keys (in the checkpoint, not in the model): {_describe(unexpected)}")
    if shapes:
        problems.append(f"shape mismatches: {_describe(shapes)}")
    if problems:
        raise CheckpointMismatchError(
            f"The checkpoint {str(path)!r} does not match the model: " + "; ".join(problems)
            + ". Load it into the model it was saved from (same architecture and hyper-parameters)"
            + ", or set `LightningModule.strict_loading = False` to skip missing/unexpected keys."
        )
    return {k: v for k, v in expected.items() if k in ckpt}


def check_optimizer_keys(stored: dict[str, Any], expected: dict[str, Any], index: int, path: _PathLike) -> None:
    prefix = f"optimizer_{index}."
    ckpt = {k[len(prefix):] for k in stored if k.startswith(prefix)}
    if not ckpt:
        raise CheckpointMismatchError(
            f"The checkpoint {str(path)!r} holds no state for optimizer {index} (saved with weights_only=True, or "
            "with fewer optimizers); resume from a full checkpoint or load only the weights."
        )
    missing_state = sorted(k for k in expected if k not in ckpt and k.startswith(STATE_PREFIX))
    if missing_state:
        raise CheckpointMismatchError(
            f"The checkpoint {str(path)!r} does not match optimizer {index} ({len(missing_state)} state entries "
            f"missing: {_describe(missing_state)}); was it saved with another optimizer type or other parameters?"
        )
    # hyper-parameters the checkpoint lacks (e.g. `initial_lr` of a newly added scheduler) keep their values
    for k in [k for k in expected if k not in ckpt]:
        del expected[k]


# ---- consolidation (offline, one process) ------------------------------------------------------
def consolidate_model_state(path: _PathLike, strip_prefix: str = "") -> tuple[dict[str, torch.Tensor], dict]:
    """Full (unsharded) model tensors of a DCP checkpoint (or of a single file), read in this process without a
    process group."""
    path = resolve_checkpoint_path(path)
    if path.is_file():
        meta = safe_torch_load(path)
        state = meta.pop(MODEL_KEY, {})
        return {k[len(strip_prefix):] if strip_prefix and k.startswith(strip_prefix) else k: v
                for k, v in state.items()}, meta
    meta = read_meta(path) if (path / META_FILENAME).is_file() else {}
    stored = checkpoint_tensor_metadata(path)
    prefix = MODEL_KEY + "."
    template = {
        k: torch.empty(tuple(v.size), dtype=v.properties.dtype)
        for k, v in stored.items()
        if k.startswith(prefix) and isinstance(v, TensorStorageMetadata)
    }
    if not template:
        raise CheckpointMismatchError(f"{str(path)!r} holds no model tensors (no '{MODEL_KEY}.*' entries).")
    dcp_load(template, path, no_dist=True)
    # fused projections (q|k|v, gate|up) saved under tp > 1 are stored rank-major: back to the model's layout
    full = unfuse_full_tensors({k[len(prefix):]: v for k, v in template.items()},
                               (meta.get("lightning_npu") or {}).get("fused") or {})
    out = {}
    for name, v in full.items():
        if strip_prefix and name.startswith(strip_prefix):
            name = name[len(strip_prefix):]
        out[name] = v
    return out, meta


# ---- another tensor-parallel layout of fused projections ---------------------------------------
def fused_layout_changes(meta: dict[str, Any], module: torch.nn.Module) -> bool:
    """Whether the checkpoint stores fused projections (q|k|v, gate|up) in another layout than `module` uses.

    Under ZeRO 2/3 x TP the DCP tensors are the parameters' DTensors, whose fused projections are reordered
    rank-major for the saving tp size (`full_state`); any other tp size needs the relayout step of
    :func:`load_directory`."""
    saved = (meta.get("lightning_npu") or {}).get("fused") or {}
    current = fused_layout(module)
    return bool(saved or current) and saved != current


def _full_like(stored: Any, value: Any) -> Any:
    """A full-size buffer for the stored tensor that `value` (this rank's shard) is part of."""
    if isinstance(value, torch.Tensor) and value.dim() > 0 and isinstance(stored, TensorStorageMetadata):
        return torch.empty(tuple(stored.size), dtype=stored.properties.dtype)
    return value


def _relayout(full: dict[str, dict[str, Any]], templates: dict[str, dict[str, Any]], saved: dict[str, Any],
              current: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Full tensors read in the saving tp size's fused layout -> the current one, then each rank's own shards."""
    out = {}
    for part, tensors in full.items():
        prefix = "" if part == MODEL_KEY else STATE_PREFIX
        out[part] = shard_like(relayout_fused(tensors, saved, current, prefix), templates[part])
    return out


# ---- the strategy's checkpoint mechanics (its hooks only route here) ---------------------------------
def layout_metadata(cfg: Any, world_size: int, module: torch.nn.Module) -> dict[str, Any]:
    """The layout a checkpoint was saved under (``meta["lightning_npu"]``): what a reshard on load reads."""
    return {
        "format": FORMAT_VERSION,
        "tensor_parallel_size": cfg.tensor_parallel_size,
        "pipeline_parallel_size": cfg.pipeline_parallel_size,
        "data_parallel_size": cfg.resolved_dp,
        "context_parallel_size": cfg.context_parallel_size,
        "zero_stage": cfg.zero_stage,
        "world_size": world_size,
        # ZeRO 2/3 x TP: fused projections stored rank-major for this tp size (FQN -> (dim, parts, tp))
        "fused": fused_layout(module),
    }


def commit_request(storage_options: Any, strategy_name: str, single_file: bool = False) -> Optional[CommitRequest]:
    """`trainer.save_checkpoint(path, storage_options=CommitRequest(...))`: the callbacks' commit (and marker). Other
    `storage_options` are the CheckpointIO plugin's (None here), which writes single-file checkpoints only."""
    if storage_options is None or isinstance(storage_options, CommitRequest):
        return storage_options
    if single_file:
        return None
    raise TypeError(
        f"`{strategy_name}.save_checkpoint(..., storage_options=...)` reaches the CheckpointIO plugin only for a "
        "single-file checkpoint: this one is a sharded directory, written with torch.distributed.checkpoint. Pass "
        "save_distributed_checkpoint=False for one file, or drop storage_options."
    )


def split_checkpoint(checkpoint: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Lightning's checkpoint dict -> (DCP tensors: model and optimizer states, rank 0's ``meta.pt`` rest)."""
    meta = dict(checkpoint)
    tensors = {MODEL_KEY: meta.pop("state_dict")}
    for i, state in enumerate(meta.pop("optimizer_states", [])):
        tensors[f"optimizer_{i}"] = state
    return tensors, meta


def check_stage_keys(stored: dict[str, Any], own: dict[str, Any], path: _PathLike) -> None:
    """Strict loading of one pipeline stage: its keys must all be stored (the other stages' keys are expected)."""
    check_model_keys({k: v for k, v in stored.items() if k.startswith(MODEL_KEY + ".")}, own, path, strict=False)
    missing = [k for k in own if f"{MODEL_KEY}.{k}" not in stored]
    if missing:
        raise CheckpointMismatchError(
            f"The checkpoint {str(path)!r} lacks this pipeline stage's keys {missing[:8]}; load it into the "
            "model it was saved from, or set `LightningModule.strict_loading = False`."
        )


def load_directory(path: _PathLike, module: torch.nn.Module, optimizers: list[Optimizer], strict: bool = True,
                   pipelined: bool = False) -> dict[str, Any]:
    """Collective, the one DCP loader: restore `module` (and `optimizers`, if any) from a sharded checkpoint saved
    under any layout; returns the checkpoint's non-tensor part (``meta.pt``), for Lightning to restore loops,
    callbacks, schedulers.

    DCP reads each rank's own slices in place. A checkpoint whose fused projections (q|k|v, gate|up) are laid out
    for another tp size (`fused_layout_changes`) is read as full tensors instead, relaid out, and each rank keeps
    its own shard (a full copy of the state per rank while loading). `pipelined`: `module` holds one pipeline
    stage, which restores only its own keys (the other stages' are not "unexpected"; its own missing ones still
    are, under `strict`).
    """
    path = resolve_checkpoint_path(path)
    if not is_sharded_checkpoint(path):
        raise FileNotFoundError(f"{str(path)!r} is not a lightning-npu sharded checkpoint (no {META_FILENAME}).")
    meta = read_meta(path)  # first: an unsafe file is refused before any state changes
    stored = checkpoint_tensor_metadata(path)
    own = model_state_dict(module, optimizers)
    if pipelined and strict:
        check_stage_keys(stored, own, path)
    with _frozen_with_saved_state(module, stored, len(optimizers)):
        return _load_directory(path, module, optimizers, meta, stored, own, strict, pipelined)


@contextmanager
def _frozen_with_saved_state(module: torch.nn.Module, stored: dict[str, Any], count: int) -> Iterator[None]:
    """Frozen parameters whose optimizer state the checkpoint holds require gradients while it loads: DCP's
    optimizer state dicts leave frozen parameters' state out (a layer Lightning's BaseFinetuning unfroze, frozen
    again by its `freeze_before_training` until the groups come back, would resume without its momentum)."""
    prefixes = [f"optimizer_{i}.{STATE_PREFIX}" for i in range(count)]
    saved = {split_state_key(k, p)[0] for k in stored for p in prefixes if k.startswith(p)}
    frozen = [p for n, p in module.named_parameters(remove_duplicate=False) if n in saved and not p.requires_grad]
    for p in frozen:
        p.requires_grad_(True)
    try:
        yield
    finally:
        for p in frozen:
            p.requires_grad_(False)


def _load_directory(path: Path, module: torch.nn.Module, optimizers: list[Optimizer], meta: dict[str, Any],
                    stored: dict[str, Any], own: dict[str, Any], strict: bool, pipelined: bool) -> dict[str, Any]:
    templates: dict[str, dict[str, Any]] = {MODEL_KEY: check_model_keys(stored, own, path, strict and not pipelined)}
    for i, optimizer in enumerate(optimizers):
        osd = optimizer_state_dict(module, optimizer)
        check_optimizer_keys(stored, osd, i, path)
        templates[f"optimizer_{i}"] = osd
    relayout = fused_layout_changes(meta, module)
    if relayout:
        tensors = {part: {k: _full_like(stored.get(f"{part}.{k}"), v) for k, v in sd.items()}
                   for part, sd in templates.items()}
    else:
        tensors = {part: dict(sd) for part, sd in templates.items()}
    dcp_load(tensors, path)
    if relayout:
        tensors = _relayout(tensors, templates, (meta.get("lightning_npu") or {}).get("fused") or {},
                            fused_layout(module))
    for i, optimizer in enumerate(optimizers):
        load_optimizer_state(module, optimizer, tensors[f"optimizer_{i}"], templates[f"optimizer_{i}"])
    load_model_state(module, templates[MODEL_KEY], tensors[MODEL_KEY], optimizers)
    return meta
