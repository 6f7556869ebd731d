"""Reading checkpoint files as data, never code: `weights_only` torch.load, a restricted unpickler for DCP's
``.metadata``, a load planner for the shards' non-tensor entries, and the package's one DCP read.

A file that cannot be read (empty, truncated, corrupt) raises `CheckpointLoadError` naming it, on every path:
not torch's `EOFError`, miniz's `RuntimeError`, a `UnicodeDecodeError` from a corrupted pickle, nor DCP's
`CheckpointException`."""

from __future__ import annotations

import io
import pickle
import sys
import zipfile
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Optional, Union

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, StorageMeta

from lightning_npu.parallel.checkpoint.errors import CheckpointLoadError, CheckpointMismatchError, UnsafeCheckpointError

META_FILENAME = "meta.pt"  # Lightning's `_METADATA_FILENAME`
_PathLike = Union[str, Path]


# ---- reader -----------------------------------------------------------------------------------
def read_meta(path: _PathLike, weights_only: Optional[bool] = True) -> dict[str, Any]:
    """The checkpoint's non-tensor part. Always read with ``weights_only=True`` (the argument is kept for
    callers that pass Lightning's value through): a checkpoint must not be able to run code when it is loaded."""
    return safe_torch_load(Path(path) / META_FILENAME)


# what reading a damaged file raises inside torch.load or an unpickler (OSError, e.g. a missing file, is not here)
_DAMAGED = (EOFError, RuntimeError, ValueError, UnicodeDecodeError, OverflowError, zipfile.BadZipFile, KeyError,
            IndexError, TypeError, AttributeError, MemoryError, pickle.UnpicklingError)


def _is_refusal(err: BaseException) -> bool:
    text = str(err)
    return "Unsupported global" in text or "Unsupported operand" in text or "Unsupported class" in text


def damaged(file: _PathLike, err: BaseException) -> CheckpointLoadError:
    """The one clear error for a checkpoint file that cannot be read: names it, says why and what to do."""
    try:
        size = Path(file).stat().st_size
    except OSError:
        size = None
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    detail = f"{type(err).__name__}: {lines[0][:200]}" if lines else type(err).__name__
    what = "it is empty (0 bytes)" if size == 0 else f"it is truncated or corrupt ({detail})"
    return CheckpointLoadError(
        f"Reading the checkpoint file {str(file)!r} failed: {what}. Load an earlier checkpoint "
        "(DynamicCheckpoint.find_latest skips broken ones)."
    )


def safe_torch_load(file: _PathLike) -> Any:
    """``torch.load(file, weights_only=True)``, with an error that names the file and what was refused (or why
    it cannot be read)."""
    with refusing_unsafe(file):
        return torch.load(file, map_location="cpu", weights_only=True)


@contextmanager
def refusing_unsafe(file: _PathLike) -> Iterator[None]:
    """Turn torch's weights_only refusal (e.g. inside Lightning's checkpoint IO) into `UnsafeCheckpointError`, and
    the errors of a damaged file into `CheckpointLoadError`, both naming `file`."""
    try:
        yield
    except (UnsafeCheckpointError, CheckpointLoadError, CheckpointMismatchError):
        raise
    except pickle.UnpicklingError as err:
        if _is_refusal(err):
            raise UnsafeCheckpointError(_refusal(file, err)) from None
        raise damaged(file, err) from None
    except _DAMAGED as err:
        raise damaged(file, err) from None


def _refusal(file: _PathLike, err: BaseException, entry: Optional[str] = None) -> str:
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    detail = next((line for line in lines if "Unsupported global" in line or "Unsupported operand" in line),
                  lines[-1] if lines else repr(err))
    where = f"{str(file)!r}" + (f" (its entry {entry!r})" if entry else "")
    return (
        f"Refused to load {where}: it needs more than plain data to load ({detail}). The file may be "
        "malicious, or written by an incompatible version (of lightning-npu, Lightning or a library whose objects "
        "were saved into it). Nothing in it was executed. If you trust the file, allow the type with "
        "`torch.serialization.add_safe_globals([...])` and load again."
    )
# DCP's `.metadata` is a pickle: unpickle only DCP's metadata classes and plain data
_DCP_MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem",
                "torch.distributed.checkpoint.planner")
_SAFE_GLOBALS = {
    ("builtins", n) for n in ("set", "frozenset", "slice", "complex", "bytearray", "tuple", "list", "dict", "int",
                               "float", "bool", "str", "bytes", "range")
} | {("collections", "OrderedDict"), ("torch", "Size"), ("torch.serialization", "_get_layout"),
     ("pathlib", "Path"), ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"), ("pathlib", "PurePosixPath"),
     ("pathlib", "PureWindowsPath")}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if module in _DCP_MODULES:
            obj = getattr(sys.modules.get(module) or __import__(module, fromlist=[name]), name, None)
            if isinstance(obj, type) and obj.__module__ == module:  # a metadata dataclass or enum, not a function
                return obj
        elif module == "torch":
            obj = getattr(torch, name, None)
            if isinstance(obj, (torch.dtype, torch.layout, torch.memory_format)) or (module, name) in _SAFE_GLOBALS:
                return obj
        elif (module, name) in _SAFE_GLOBALS:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"Unsupported global: {module}.{name} is not a DCP metadata type or plain data")


class _TrackingFileSystem(FileSystem):
    """Remembers the file being read, so that a failure names it."""

    current: Optional[Path] = None

    @contextmanager
    def create_stream(self, path: Any, mode: str) -> Iterator[Any]:
        self.current = Path(path)
        with super().create_stream(path, mode) as stream:
            yield stream


class SafeFileSystemReader(FileSystemReader):
    """`FileSystemReader` whose ``.metadata`` is unpickled by a restricted unpickler instead of `pickle.load`, and
    whose failures name the file (a truncated shard, a corrupted ``.metadata``)."""

    def __init__(self, path: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(path, *args, **kwargs)
        self.fs = _TrackingFileSystem()

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        path = self._get_metadata_path(kwargs.get("rank"))
        if not Path(path).is_file():
            raise CheckpointLoadError(
                f"{str(self.path)!r} is not a complete sharded checkpoint: its DCP metadata {str(path)!r} is missing. "
                "Load an earlier checkpoint (DynamicCheckpoint.find_latest skips broken ones)."
            )
        with self.fs.create_stream(path, "rb") as f:
            try:
                metadata = _MetadataUnpickler(f).load()
            except pickle.UnpicklingError as err:
                if _is_refusal(err):
                    raise UnsafeCheckpointError(_refusal(path, err)) from None
                raise damaged(path, err) from None
            except _DAMAGED as err:
                raise damaged(path, err) from None
        if not hasattr(metadata, "state_dict_metadata") or not hasattr(metadata, "storage_data"):
            raise damaged(path, ValueError(f"it holds a {type(metadata).__name__}, not DCP metadata"))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def read_data(self, plan: Any, planner: Any) -> Any:
        try:
            return super().read_data(plan, planner)
        except (UnsafeCheckpointError, CheckpointLoadError, CheckpointMismatchError):
            raise
        except FileNotFoundError as err:
            raise CheckpointLoadError(
                f"Reading the checkpoint {str(self.path)!r} failed: its file {str(err.filename)!r} is missing. Load "
                "an earlier checkpoint (DynamicCheckpoint.find_latest skips broken ones)."
            ) from None
        except (OSError, *_DAMAGED) as err:
            raise damaged(self.fs.current or self.path, err) from None


def checkpoint_tensor_metadata(path: _PathLike) -> dict[str, Any]:
    return SafeFileSystemReader(str(path)).read_metadata().state_dict_metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """`DefaultLoadPlanner` whose non-tensor entries are unpickled with ``weights_only=True``: torch's own
    uses ``weights_only=False``, so a planted shard entry would run code on every rank that reads it."""

    def __init__(self, reader: FileSystemReader, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._reader = reader

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        try:
            obj = torch.load(value, map_location="cpu", weights_only=True)
        except _DAMAGED as err:
            info = (getattr(self._reader, "storage_data", None) or {}).get(read_item.storage_index)
            file = Path(self._reader.path) / info.relative_path if info is not None else Path(self._reader.path)
            if isinstance(err, pickle.UnpicklingError) and _is_refusal(err):
                raise UnsafeCheckpointError(_refusal(file, err, entry=fqn)) from None
            raise damaged(file, err) from None
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], obj)
        else:
            self.state_dict[fqn] = obj


def dcp_load(state: dict[str, Any], path: _PathLike, no_dist: bool = False) -> None:
    """The package's one DCP read (collective unless `no_dist`): restricted ``.metadata``, non-tensor entries
    as plain data, and a failure raised as one clear error on every rank. DCP wraps each rank's failure in a
    `CheckpointException`, a `BaseException` that ``except Exception`` does not catch."""
    reader = SafeFileSystemReader(str(path))
    try:
        dcp.load(state, storage_reader=reader, planner=SafeLoadPlanner(reader), no_dist=no_dist)
    except CheckpointException as err:
        raise _load_error(err, path) from None


def check_plain_data(path: _PathLike) -> None:
    """Unpickle every non-tensor entry of a DCP directory as plain data, in this process: for a directory that
    a reader other than ours (a Lightning strategy's, DCP's default planner) is about to load."""
    entries = {k: None for k, v in checkpoint_tensor_metadata(path).items() if isinstance(v, BytesStorageMetadata)}
    if entries:
        dcp_load(entries, path, no_dist=True)


def _load_error(err: CheckpointException, path: _PathLike) -> Exception:
    failures = err.failures or {}
    ranks = sorted(failures)
    first = next(iter(failures.values()), (err, None))
    first = first[0] if isinstance(first, tuple) else first
    if isinstance(first, (UnsafeCheckpointError, CheckpointMismatchError, CheckpointLoadError)):
        return type(first)(str(first))
    return CheckpointLoadError(
        f"Reading the checkpoint {str(path)!r} failed on rank(s) {ranks}: {type(first).__name__}: {first}. A "
        "shard is missing, truncated or corrupt; load an earlier checkpoint (DynamicCheckpoint.find_latest skips "
        "incomplete ones)."
    )
