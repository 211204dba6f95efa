"""Every parameter's reference, generated from params.yaml's comments: `qad-pipeline params-doc`
writes docs/params.md (`--check`: exit 1 while it is stale).

params.yaml's comments are the documentation's one source. The file's first comment paragraph
introduces the page; a section's leading comment (the lines right under `section:`) describes the
section; a key is described by the comment lines right above
it (after the first key), the comment on its line and the deeper-indented comment lines under it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import yaml
from pydantic import BaseModel

from qad_pipeline.core.config import PROJECT_PARAMS, PROJECT_ROOT, Params

REFERENCE = PROJECT_ROOT / "docs" / "params.md"
_SECTION = re.compile(r"^(\w+):\s*(?:#\s?(.*))?$")
_KEY = re.compile(r"^  (\w+):(.*)$")
_COMMENT = re.compile(r"^( *)#\s?(.*)$")


@dataclass
class Key:
    name: str  # section.key
    default: object
    text: list[str]  # comment lines

    @property
    def description(self) -> str:
        return " ".join(line.strip() for line in self.text if line.strip())


@dataclass
class Section:
    name: str
    intro: list[str]
    keys: list[Key]


def _split_comment(rest: str) -> tuple[str, str | None]:
    """A key line's rest (after `key:`) -> (value text, its comment or None): a `#` after a blank,
    outside quotes, starts the comment, as in YAML."""
    quote = None
    for i, char in enumerate(rest):
        if quote:
            quote = None if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char == "#" and (i == 0 or rest[i - 1].isspace()):
            return rest[:i], rest[i + 1:].removeprefix(" ")
    return rest, None


def read_reference(path: Path = PROJECT_PARAMS) -> tuple[list[str], list[Section]]:
    """params.yaml's leading comment and its sections, each key with its default and comment lines."""
    values = yaml.safe_load(path.read_text())
    header: list[str] = []
    header_done = False
    sections: list[Section] = []
    above: list[str] = []  # comment lines at key depth, waiting for the key they describe
    last: Key | None = None  # the key whose deeper-indented comment lines continue its description
    for line in path.read_text().splitlines():
        comment, section, key = _COMMENT.match(line), _SECTION.match(line), _KEY.match(line)
        if not line.strip():
            last = None
            header_done = bool(header)
        elif section:
            sections.append(Section(section[1], [section[2]] if section[2] else [], []))
            above, last = [], None
        elif comment and not sections:
            header += [] if header_done else [comment[2]]  # the file's first comment paragraph
        elif comment and last is not None and len(comment[1]) > 2:
            last.text.append(comment[2])
        elif comment:
            current = sections[-1]
            (above if current.keys else current.intro).append(comment[2])
            last = None
        elif key:
            current = sections[-1]
            inline = _split_comment(key[2])[1]
            last = Key(f"{current.name}.{key[1]}", values[current.name][key[1]], [*above, *filter(None, [inline])])
            current.keys.append(last)
            above = []
    return header, sections


def model_keys(model: type[BaseModel] = Params) -> list[str]:
    """Every `section.key` of the Params model: its sections' fields (a key's own sub-keys, such as
    eval.task_settings' per-task settings, are its value's and described with it)."""
    return [f"{section}.{key}" for section, field in model.model_fields.items()
            for key in field.annotation.model_fields]


def _cell(text: str) -> str:
    """Text for a Markdown table cell: `|` escaped, `<` no HTML tag."""
    return text.replace("|", r"\|").replace("<", "&lt;")


def _default(value: object) -> str:
    text = yaml.safe_dump(value, default_flow_style=True, width=10_000).strip().removesuffix("\n...")
    return f"`{_cell(text)}`"


def reference_markdown(path: Path = PROJECT_PARAMS) -> str:
    """docs/params.md's text: one table per section of params.yaml (key, default, description)."""
    header, sections = read_reference(path)
    lines = [
        "# Parameters",
        "",
        "Generated from the comments in `params.yaml` by `qad-pipeline params-doc`: edit those comments and "
        "run it again, not this page (a test fails while the page differs from what `params.yaml` generates).",
        "",
        _cell(" ".join(line.strip() for line in header)),
        "",
        "A profile (`profiles/*.yaml`) starts with `extends: ../params.yaml` and states only the keys it "
        "changes: mappings are merged key by key, a list or a scalar replaces the inherited one, and an "
        "inherited relative path still names the file it named beside `params.yaml`.",
    ]
    for section in sections:
        lines += ["", f"## `{section.name}`", ""]
        if section.intro:
            lines += [_cell(" ".join(line.strip() for line in section.intro)), ""]
        lines += ["| Key | Default | Description |", "| --- | --- | --- |"]
        lines += [f"| `{key.name}` | {_default(key.default)} | {_cell(key.description)} |" for key in section.keys]
    return "\n".join(lines) + "\n"


def undocumented(path: Path = PROJECT_PARAMS) -> list[str]:
    """The model's keys that params.yaml does not describe (absent, or with no comment)."""
    described = {key.name for section in read_reference(path)[1] for key in section.keys if key.description}
    return [name for name in model_keys() if name not in described]
