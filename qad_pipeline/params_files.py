"""The errors every stage and check raises, and reading params files and `--set` overrides (YAML
with one-line errors). `qad_pipeline.config` re-exports all of it: import from there."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml


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
