"""`lightning-npu` command line, built on LightningCLI.

``fit|validate|test|predict`` are LightningCLI's own subcommands with the ``npu_hybrid``
strategy registered. The current directory is importable (as with ``python -m``) so that a
config's ``class_path`` can name modules of the user's project, e.g. ``examples.gpt.model.GPTModule``.
"""

from __future__ import annotations

import os
import sys
from typing import Optional

import lightning_npu  # noqa: F401  (registers "npu" and "npu_hybrid")


def _lightning_cli(args: list[str]) -> None:
    from lightning.pytorch import LightningDataModule, LightningModule
    from lightning.pytorch.cli import LightningCLI

    LightningCLI(
        LightningModule,
        LightningDataModule,
        subclass_mode_model=True,
        subclass_mode_data=True,
        args=args,
        save_config_kwargs={"overwrite": True},
    )


def main(argv: Optional[list[str]] = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    _lightning_cli(args)


if __name__ == "__main__":
    main()
