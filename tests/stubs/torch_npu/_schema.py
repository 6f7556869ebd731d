"""Parse op-plugin schema lines into `inspect.Signature`s, so a wrong keyword fails `bind`."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

SCHEMA_FILE = Path(__file__).with_name("op_plugin_schema.txt")
_LINE = re.compile(r"^\s*-\s*func:\s*(\w+)\((.*)\)\s*->\s*(.+)$")


def _default(text: str):
    if text == "None":
        return None
    if text in ("True", "False"):
        return text == "True"
    if text.startswith('"'):
        return text.strip('"')
    return float(text) if any(c in text for c in ".eE") else int(text)


def _split(args: str) -> list[str]:
    out, depth, cur = [], 0, ""
    for ch in args:
        depth += ch in "[("
        depth -= ch in "])"
        if ch == "," and depth == 0:
            out.append(cur.strip())
            cur = ""
        else:
            cur += ch
    return out + ([cur.strip()] if cur.strip() else [])


def parse(line: str) -> tuple[str, inspect.Signature, int]:
    """(name, signature, number of outputs) of one ``- func:`` line."""
    m = _LINE.match(line)
    if m is None:
        raise ValueError(f"not a schema line: {line!r}")
    name, args, ret = m.groups()
    params, kind = [], inspect.Parameter.POSITIONAL_OR_KEYWORD
    for arg in _split(args):
        if arg == "*":
            kind = inspect.Parameter.KEYWORD_ONLY
            continue
        decl, _, default = arg.partition("=")
        pname = decl.split()[-1]
        params.append(inspect.Parameter(pname, kind, default=_default(default) if default else inspect.Parameter.empty))
    ret = ret.strip()
    n_out = len(_split(ret[1:-1])) if ret.startswith("(") else 1
    return name, inspect.Signature(params), n_out


def load() -> dict[str, tuple[inspect.Signature, int]]:
    out = {}
    for line in SCHEMA_FILE.read_text().splitlines():
        if line.lstrip().startswith("- func:"):
            name, sig, n = parse(line)
            out[name] = (sig, n)
    return out
