"""Fault injection for the trust tests: a pickle payload planted in a DCP shard's non-tensor entry (what
`torch.distributed.checkpoint`'s default planner would unpickle with ``weights_only=False``), and a disk that is
full for one step of a save (`disk_full_at`)."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import pickle
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
from torch.distributed.checkpoint.metadata import BytesStorageMetadata

from lightning_npu.parallel.checkpoint import commit


class Payload:
    """Unpickling it with anything but a restricted unpickler creates the file `flag`."""

    def __init__(self, flag: str) -> None:
        self.flag = flag

    def __reduce__(self):
        return (open, (self.flag, "w"))


def plant_in_shard(ckpt: Path, payload: object, key_contains: str = "param_groups") -> tuple[Path, str]:
    """Replace one non-tensor entry of a shard with `payload` (torch.save'd), keeping `.metadata` and the
    completion marker consistent (as an attacker who can write the files would); returns the shard and the key."""
    with open(ckpt / ".metadata", "rb") as f:
        md = pickle.load(f)  # our own, trusted file
    key = next(k for k, v in md.state_dict_metadata.items()
               if isinstance(v, BytesStorageMetadata) and key_contains in k)
    index, info = next((i, s) for i, s in md.storage_data.items() if i.fqn == key)
    shard = ckpt / info.relative_path
    data = shard.read_bytes()
    buf = io.BytesIO()
    torch.save(payload, buf)
    new = buf.getvalue()
    shard.write_bytes(data[:info.offset] + new + data[info.offset + info.length:])
    delta = len(new) - info.length
    for i, s in list(md.storage_data.items()):
        if s.relative_path == info.relative_path and s.offset > info.offset:
            md.storage_data[i] = dataclasses.replace(s, offset=s.offset + delta)
    md.storage_data[index] = dataclasses.replace(info, length=len(new))
    with open(ckpt / ".metadata", "wb") as f:
        pickle.dump(md, f)
    marker = commit.marker_path(ckpt)
    if marker.is_file():
        data = json.loads(marker.read_text())
        data["files"] = commit.manifest(ckpt, bool(data.get("checksum")))
        marker.write_text(json.dumps(data))
    return shard, key


def disk_full(*args: Any, **kwargs: Any) -> Any:
    raise OSError(28, "No space left on device (injected)")


@contextlib.contextmanager
def disk_full_at(owner: Any, name: str, when: Callable[..., bool] = lambda *a, **k: True,
                 active: bool = True) -> Iterator[None]:
    """`owner.name` (e.g. ``commit._write_json_atomic``, the marker write) fails with a full disk where
    `when(*args)` holds, while inside the block (only where `active`: e.g. on one rank)."""
    real = getattr(owner, name)

    def failing(*args: Any, **kwargs: Any) -> Any:
        return disk_full() if when(*args, **kwargs) else real(*args, **kwargs)

    if active:
        setattr(owner, name, failing)
    try:
        yield
    finally:
        setattr(owner, name, real)
