"""Complete-or-absent checkpoints for the callbacks: names, markers and discovery.

The mechanics (temporary path, aside copy, rename, marker) are `lightning_npu.parallel.checkpoint.commit`'s, the
package's one commit path; this module keeps the callbacks' names for them.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Union

from lightning_npu.parallel.checkpoint import commit as _commit
from lightning_npu.parallel.checkpoint.commit import (  # noqa: F401  (re-exported)
    MARKER_SUFFIX,
    TMP_PREFIX,
    CheckpointCorruptedError,
    CheckpointInfo,
    clean_leftovers,
    clean_stale,
    delete,
    latest_complete,
    list_complete,
    manifest,
    marker_path,
    new_token,
    read_marker,
    remove_path,
    temp_path,
    verify,
    verify_marked,
)

PathLike = Union[str, Path]
CHECKPOINT_NAME = re.compile(r"step=\d{8,}\.ckpt")  # what `checkpoint_name` makes


def checkpoint_name(step: int) -> str:
    return f"step={step:08d}.ckpt"


def commit(tmp: PathLike, final: PathLike, meta: dict[str, Any], checksum: bool = True) -> Path:
    """Commit a fully written checkpoint with its marker (rank 0 only); see `lightning_npu.parallel.checkpoint.commit`."""
    return _commit.commit(tmp, final, new_token(), marker=meta, checksum=checksum)
