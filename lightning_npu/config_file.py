"""LightningCLI config files checked before parsing, and parser errors said in one line.

jsonargparse answers a config mistake with the whole usage text, a union type's list of attempts and the
parsed value; the one fact that matters (which file, which line, which key) is buried or missing. Here a
config file is read once more with PyYAML, so that bad YAML, an empty file or a top level that is not a
mapping is named at once, and a parser error is turned into ``FILE, line N: KEY: reason``, where the key
is looked up in the files the command line gave.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence, Union

import yaml

EXAMPLE = "examples/gpt/config.yaml"
_CONFIG_FLAGS = ("--config", "-c")


class ConfigFileError(ValueError):
    """A config file that cannot be a LightningCLI config; the message names the file (and line)."""


def read_config(path: Union[str, Path]) -> dict:
    """The mapping in YAML file `path`; bad YAML, an empty file and any other top level are refused."""
    text = Path(path).read_text()
    try:
        config = yaml.safe_load(text)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f", line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        reason = getattr(err, "problem", None) or str(err).splitlines()[0]
        raise ConfigFileError(f"{path}{where}: not valid YAML: {reason}.") from None
    if config is None:
        raise ConfigFileError(f"{path} is empty: a config is a mapping of trainer:, model:, data: ..., e.g. {EXAMPLE}.")
    if not isinstance(config, dict):
        raise ConfigFileError(f"{path}, line 1: the top level is a {type(config).__name__}, not a mapping of "
                              f"trainer:, model:, data: ...; see {EXAMPLE}.")
    return config


def config_paths(args: list[str]) -> list[str]:
    """The files given by ``--config``/``-c`` (in order; an inline YAML string is not a file and is left out)."""
    out = []
    for i, arg in enumerate(args):
        value = None
        if arg in _CONFIG_FLAGS and i + 1 < len(args):
            value = args[i + 1]
        elif arg.startswith(tuple(f + "=" for f in _CONFIG_FLAGS)):
            value = arg.split("=", 1)[1]
        if value is not None and Path(value).is_file():
            out.append(value)
    return out


# ---- where a key is ----------------------------------------------------------------------------
def _keys(node: Any, path: tuple = ()) -> Iterator[tuple[tuple, Any, Any]]:
    """(path, key node, value node) of every mapping key under `node`; list items add their index."""
    if isinstance(node, yaml.MappingNode):
        for key, value in node.value:
            here = path + (str(key.value),)
            yield here, key, value
            yield from _keys(value, here)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            yield from _keys(item, path + (i,))


def _plain(path: tuple) -> tuple:
    """A path as jsonargparse names it: no list indices, no ``init_args`` level."""
    return tuple(p for p in path if isinstance(p, str) and p != "init_args")


def _shown(path: tuple) -> str:
    return "".join(f"[{p}]" if isinstance(p, int) else (f".{p}" if i else p) for i, p in enumerate(path))


def _find(paths: list[str], key: str, leaf: Optional[str] = None, value: Optional[str] = None) -> Optional[tuple]:
    want = _plain(tuple(key.split("."))) if key else ()
    for path in reversed(paths):  # a later file overrides an earlier one
        try:
            root = yaml.compose(Path(path).read_text())
        except (OSError, yaml.YAMLError):
            continue
        for where, key_node, value_node in _keys(root):
            plain = _plain(where)
            if leaf is None:
                found = plain == want
            else:
                found = where[-1] == leaf and plain[: len(want)] == want
                if value is not None:
                    found = found and isinstance(value_node, yaml.ScalarNode) and value_node.value == value
            if found:
                return path, where, key_node, value_node
    return None


def locate(paths: list[str], key: str, leaf: Optional[str] = None,
           value: Optional[str] = None) -> Optional[tuple[str, int, str]]:
    """(file, line, key as written) of `key` (dotted, as jsonargparse names it) in the last file that has it.

    With `leaf`, a key of that name anywhere under `key`; with `value`, a `leaf` key holding that scalar.
    """
    found = _find(paths, key, leaf, value)
    return (found[0], found[2].start_mark.line + 1, _shown(found[1])) if found else None


_CLASS_KEYS = {"class_path", "init_args", "dict_kwargs"}


def _beside_class_path(paths: list[str], key: str) -> Optional[tuple[str, int, str]]:
    """A key next to ``class_path`` that is none of class_path/init_args/dict_kwargs (an argument put one level
    too high, or a typo), which jsonargparse reports only as "not a valid subclass"."""
    found = _find(paths, key)
    if found is None or not isinstance(found[3], yaml.MappingNode):
        return None
    names = [str(k.value) for k, _ in found[3].value]
    if "class_path" not in names:
        return None
    for k, _ in found[3].value:
        if str(k.value) not in _CLASS_KEYS:
            return found[0], k.start_mark.line + 1, _shown(found[1] + (str(k.value),))
    return None


# ---- jsonargparse's errors in one line ---------------------------------------------------------
_UNKNOWN_OPTION = re.compile(r"does not accept option '([^']+)'|^Option '([^']+)' is not accepted$", re.M)
_BEFORE_SUBCOMMAND = re.compile(r"^Option '([^']+)' is not accepted before subcommand '([^']+)'")
_NESTED_UNKNOWN = re.compile(
    r"Problem with given class_path '([^']+)':\s*\n\s*(?:Option|Key) '([^']+)' is not accepted")
_PARSER_KEY = re.compile(r'Parser key "([^"]+)"')
_CLASS_PATH = re.compile(r"class_path='([^']+)'")
_STRUCTURE = re.compile(
    r"^(Subtypes:|Errors:|Given value|Does not validate|Subclass types expect|a class path|a dict )")
_WEAK = re.compile(r"^(Expected a <class|Expected an instantiatable|Not a valid subclass)")


def _reasons(message: str) -> list[str]:
    """The specific lines of an error: what each candidate of a union type said, without the type listing
    (a candidate's "Expected a <class 'NoneType'>" only when no candidate said more)."""
    lines = [line.strip() for line in message.splitlines()]
    out = []
    for i, line in enumerate(lines):
        text = line[2:].strip() if line.startswith("- ") else line
        if text.startswith("Problem with given class_path") and i + 1 < len(lines):
            text = lines[i + 1]
        text = _PARSER_KEY.sub("", text).strip(" :") if _PARSER_KEY.match(text) else text
        if text and not _STRUCTURE.match(text) and text.rstrip(":") not in out:
            out.append(text.rstrip(":"))
    strong = [r for r in out if not _WEAK.match(r)]
    return strong or out


def _on_command_line(args: list[str], key: str) -> bool:
    """Whether an option of the command line sets `key` or something inside it (it overrides the files)."""
    flag = f"--{key}"
    return any(a.split("=", 1)[0] == flag or a.startswith(flag + ".") for a in args)


def explain(message: str, paths: list[str], help_command: str, args: Sequence[str] = ()) -> str:
    """One line for a jsonargparse error `message`, naming the file, line and key where the files hold it
    (`args`: the command line, whose options override the files)."""
    def at(key: str, found: Optional[tuple[str, int, str]]) -> str:
        if found and not _on_command_line(list(args), key):
            return f"{found[0]}, line {found[1]}: {found[2]}"
        return f"--{key}"

    before = _BEFORE_SUBCOMMAND.search(message)
    if before:
        key, sub = before.groups()
        return (f"{at(key, locate(paths, key))}: a key of `{sub}` given before the subcommand; put --config after "
                f"it (`{help_command.split()[0]} {sub} --config FILE`) or nest the file's keys under `{sub}:`.")
    match = _UNKNOWN_OPTION.search(message)
    if match:
        key = match.group(1) or match.group(2)
        return f"{at(key, locate(paths, key))}: unknown key; `{help_command} --help` lists the accepted keys."
    parser_key = _PARSER_KEY.search(message)
    prefix = parser_key.group(1) if parser_key else ""
    nested = _NESTED_UNKNOWN.search(message)
    if nested:
        class_path, key = nested.groups()
        full = f"{prefix}.{key}" if prefix else key
        return (f"{at(full, locate(paths, prefix, leaf=key))}: unknown key: {class_path} takes no argument {key!r}; "
                f"`{help_command} --{prefix}.help {class_path}` lists the ones it takes.")
    reasons = "; ".join(_reasons(message)) or message.strip().splitlines()[0]
    beside = _beside_class_path(paths, prefix) if prefix else None
    if beside:
        return (f"{at(prefix, beside)}: unknown key next to class_path: give a class's arguments under init_args; "
                f"`{help_command} --help` lists the accepted keys.")
    if prefix:
        return f"{at(prefix, locate(paths, prefix))}: {reasons}"
    class_path = _CLASS_PATH.search(message)  # a constructor refused its arguments: where that class is configured
    found = locate(paths, "", leaf="class_path", value=class_path.group(1)) if class_path else None
    if found:
        key = found[2].rsplit(".", 1)[0]
        # the file names the class; options of the command line may have given the value it refused
        flags = list(dict.fromkeys(a.split("=", 1)[0] for a in args if a.startswith(f"--{key}.")))
        given = f" (with {', '.join(flags)} from the command line)" if flags else ""
        return f"{found[0]}, line {found[1]}: {key}{given}: {reasons}"
    return reasons
