"""Reading checkpoint files as data, never code: `weights_only` torch.load, a restricted unpickler for DCP's
``.metadata``, a load planner for the shards' non-tensor entries, and the package's one DCP read."""

from __future__ import annotations

import io
import pickle
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Optional, Union

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException

from lightning_npu.parallel.checkpoint.errors import CheckpointLoadError, CheckpointMismatchError, UnsafeCheckpointError

META_FILENAME = "meta.pt"  # Lightning's `_METADATA_FILENAME`
_PathLike = Union[str, Path]


# ---- reader -----------------------------------------------------------------------------------
def read_meta(path: _PathLike, weights_only: Optional[bool] = True) -> dict[str, Any]:
    """The checkpoint's non-tensor part. Always read with ``weights_only=True`` (the argument is kept for
    callers that pass Lightning's value through): a checkpoint must not be able to run code when it is loaded."""
    return safe_torch_load(Path(path) / META_FILENAME)


def safe_torch_load(file: _PathLike) -> Any:
    """``torch.load(file, weights_only=True)``, with an error that names the file and what was refused."""
    try:
        return torch.load(file, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        raise UnsafeCheckpointError(_refusal(file, err)) from None


@contextmanager
def refusing_unsafe(file: _PathLike) -> Iterator[None]:
    """Turn torch's weights_only refusal (e.g. inside Lightning's checkpoint IO) into `UnsafeCheckpointError`."""
    try:
        yield
    except pickle.UnpicklingError as err:
        raise UnsafeCheckpointError(_refusal(file, err)) from None


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


class SafeFileSystemReader(FileSystemReader):
    """`FileSystemReader` whose ``.metadata`` is unpickled by a restricted unpickler instead of `pickle.load`."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        from torch.distributed.checkpoint.metadata import StorageMeta

        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as f:
            try:
                metadata = _MetadataUnpickler(f).load()
            except pickle.UnpicklingError as err:
                raise UnsafeCheckpointError(_refusal(path, err)) from None
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


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
        except pickle.UnpicklingError as err:
            info = (getattr(self._reader, "storage_data", None) or {}).get(read_item.storage_index)
            file = Path(self._reader.path) / info.relative_path if info is not None else Path(self._reader.path)
            raise UnsafeCheckpointError(_refusal(file, err, entry=fqn)) from None
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
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

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
