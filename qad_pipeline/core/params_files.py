"""The errors every stage and check raises, and reading params files and `--set` overrides (YAML
with one-line errors). `qad_pipeline.core.config` re-exports all of it: import from there.

A params file may start with `extends: <file>` (relative to its own folder) and state only what
differs: `read_params_file` deep-merges it over that file (mappings key by key; a list or a scalar
replaces the inherited one), which may extend another in turn.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

EXTENDS = "extends"
# The keys whose values are paths, relative to the folder of the file that states them. An inherited
# one is rewritten relative to the inheriting file's folder, so it names the same file. "local or hub":
# a value that is not written like a local path (`looks_local_in`) is a hub id and stays as it is.
PATH_KEYS = {
    "base_model.path": "local or hub",
    "calibration.source": "local or hub",
    "qad.source": "local or hub",
    "ptq.recipe_dir": "folder",
    "eval.task_dir": "folder",
}


class ConfigError(ValueError):
    """Bad configuration or input, reported as one line before any heavy work starts."""


class StageError(RuntimeError):
    """A stage ran and found its result unusable (diverged training, a failed export check)."""


def yaml_error(err: yaml.YAMLError, source: str, column_offset: int = 0) -> str:
    """One line for a YAML syntax error: the source, line and column (1-based) and the problem."""
    mark = getattr(err, "problem_mark", None) or getattr(err, "context_mark", None)
    problem = getattr(err, "problem", None) or str(err).splitlines()[0]
    column = mark.column + 1 + (column_offset if mark.line == 0 else 0) if mark else 0
    where = f"line {mark.line + 1}, column {column}" if mark else "an unknown position"
    return f"{source}: invalid YAML at {where}: {problem}"


def read_yaml(path: Path) -> Any:
    """A YAML file's data; a syntax error is a `ConfigError` naming the file, line and column."""
    try:
        return yaml.safe_load(Path(path).read_text())
    except yaml.YAMLError as err:
        raise ConfigError(yaml_error(err, str(path))) from None


def parse_override(item: str) -> tuple[list[str], Any]:
    """`section.key=value` -> (["section", "key"], value), the value parsed as YAML."""
    key, sep, raw = item.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"override {item!r} is not of the form section.key=value")
    try:
        value = yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError as err:  # the column counts from the start of the whole item
        raise ConfigError(yaml_error(err, f"--set {item!r}", column_offset=len(key) + 1)) from None
    return key.strip().split("."), value


def apply_overrides(data: dict, overrides: list[str] | dict[str, Any]) -> dict:
    """Return a copy of `data` with each override applied; an unknown key is an error."""
    pairs = (
        [(k.split("."), v) for k, v in overrides.items()]
        if isinstance(overrides, dict)
        else [parse_override(o) for o in overrides]
    )
    out = yaml.safe_load(yaml.safe_dump(data))
    for keys, value in pairs:
        node = out
        for depth, key in enumerate(keys):
            if not isinstance(node, dict) or key not in node:
                where = ".".join(keys[:depth]) or "params.yaml"
                valid = sorted(node) if isinstance(node, dict) else []
                raise ConfigError(f"unknown key {'.'.join(keys)!r}: {where} has {valid}")
            if depth == len(keys) - 1:
                node[key] = value
            else:
                node = node[key]
    return out


def resolve_in(path: str | Path, root: Path) -> Path:
    """A path from a params file: a relative one is relative to `root`, the file's folder."""
    p = Path(path).expanduser()
    return p if p.is_absolute() else root / p


def looks_local_in(path: str, root: Path) -> bool:
    """A local path (existing, or written like one: `./x`, `/x`, `~/x`, `a/b/c`), not a hub id (`name`
    or `org/name`): the one rule for base models and calibration sources."""
    return resolve_in(path, root).exists() or path.startswith((".", "/", "~")) or path.count("/") > 1


@dataclass(frozen=True)
class ParamsFile:
    """A params file read: `data` is what it means (its parents' values merged under its own, every
    relative path relative to its folder); `stated` is what it says itself, `extends` left out."""

    path: Path
    data: dict
    stated: dict
    parent: ParamsFile | None = None
    inherited: dict | None = None  # the parent's data, its relative paths rebased onto this file's folder

    def source_of(self, keys: tuple, applied: dict | None = None) -> str:
        """The file that states the value at `keys` (this one, or the nearest parent that does); this
        one when `applied` (the data with `--set` overrides) holds another value there."""
        node = self
        if applied is not None and _value(applied, keys) != _value(self.data, keys):
            return str(self.path)
        while node.parent is not None and not _holds(node.stated, keys) and _holds(node.parent.data, keys):
            node = node.parent
        return str(node.path) if node is self else f"{node.path} (extended by {self.path})"

    def changed(self) -> list[str]:
        """The `section.key`s whose values differ from the parent's (all of them without a parent)."""
        base = self.inherited or {}
        return [f"{section}.{key}" for section, keys in self.data.items() for key in (keys or {})
                if not isinstance(base.get(section), dict) or key not in base[section]
                or base[section][key] != keys[key]]


def inheritance_line(path: Path) -> str | None:
    """`params: <file> (extends <parent>[, which extends ...]; N keys differ)` for a file that extends
    another (the plan's first line); None for one that states every key itself."""
    file = read_params_file(path)
    if file.parent is None:
        return None
    chain, node = [], file.parent
    while node is not None:
        chain.append(_shown(node.path))
        node = node.parent
    n = len(file.changed())
    return f"params: {path} (extends {', which extends '.join(chain)}; {n} key{'s differ' if n != 1 else ' differs'})"


def _shown(path: Path) -> str:
    """A path as the user would type it here: relative to the working directory when under it."""
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return os.path.normpath(path)


def _holds(data: Any, keys: tuple) -> bool:
    for key in keys:
        if not isinstance(data, dict) or key not in data:
            return False
        data = data[key]
    return True


def _value(data: Any, keys: tuple) -> Any:
    return _value(data[keys[0]], keys[1:]) if keys and _holds(data, keys[:1]) else (None if keys else data)


def read_params_file(path: Path, _seen: tuple[Path, ...] = ()) -> ParamsFile:
    """A params file with what it extends resolved; a bad or circular `extends` is a ConfigError."""
    path = Path(path)
    here = path.resolve()
    data = read_yaml(path) or {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping of sections (base_model:, calibration:, ...), "
                          f"found a {type(data).__name__}")
    if EXTENDS not in data:
        return ParamsFile(path, data, data)
    stated = {key: value for key, value in data.items() if key != EXTENDS}
    extends = data[EXTENDS]
    if not isinstance(extends, str) or not extends.strip():
        raise ConfigError(f"{path}: extends = {extends!r}: give the params file it extends, relative to its "
                          "folder, e.g. extends: ../params.yaml")
    parent_path = resolve_in(extends, here.parent)
    if parent_path.resolve() in (*_seen, here):
        raise ConfigError(f"{path}: extends {extends!r}, which extends {path} again (a cycle)")
    if not parent_path.is_file():
        raise ConfigError(f"{path}: extends {extends!r}, but there is no file {parent_path}")
    parent = read_params_file(parent_path, (*_seen, here))
    inherited = rebased(parent.data, parent_path.resolve().parent, here.parent)
    return ParamsFile(path, merged(inherited, stated), stated, parent, inherited)


def merged(base: dict, over: dict) -> dict:
    """`over` deep-merged onto `base`: mappings key by key; a list or a scalar replaces."""
    out = dict(base)
    for key, value in over.items():
        out[key] = merged(base[key], value) if isinstance(value, dict) and isinstance(base.get(key), dict) else value
    return out


def rebased(data: dict, old: Path, new: Path) -> dict:
    """`data` (written in folder `old`) with each relative local path of PATH_KEYS rewritten
    relative to folder `new`, naming the same file."""
    out = {section: dict(keys) if isinstance(keys, dict) else keys for section, keys in data.items()}
    for dotted, kind in PATH_KEYS.items():
        section, key = dotted.split(".")
        value = out.get(section, {}).get(key) if isinstance(out.get(section), dict) else None
        if (isinstance(value, str) and value.strip() and not Path(value).expanduser().is_absolute()
                and (kind == "folder" or looks_local_in(value, old))):
            out[section][key] = os.path.relpath(old / value, new)
    return out
