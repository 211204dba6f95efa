"""How a stage's JSON file is written and read: `write_result`, `read_result`, `dump_result`."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any, TypeVar, get_args

from pydantic import BaseModel, ConfigDict, TypeAdapter, ValidationError

from qad_pipeline.core.artifacts import read_json, write_json
from qad_pipeline.core.config import ConfigError


T = TypeVar("T")


class Strict(BaseModel):
    """A result file's object: an unknown key is an error naming it."""

    model_config = ConfigDict(extra="forbid")


class ResultFileError(ConfigError):
    """A stage's JSON file does not match its model; the message names the file and the key."""


def dump_result(model: BaseModel) -> Any:
    """A model's JSON data as its file holds it: the fields that were set, in declaration order."""
    return model.model_dump(mode="json", exclude_unset=True)


def write_result(path: Path, model: BaseModel) -> Path:
    """Write a stage's result file atomically (`artifacts.write_json`)."""
    return write_json(path, dump_result(model))


@functools.cache
def _adapter(kind: Any) -> TypeAdapter:
    return TypeAdapter(kind)


def read_result(path: Path, kind: type[T], *, missing_ok: bool = False) -> T:
    """A stage's result file as `kind` (a model above, or PTQResult / RecipeResult); a file that does
    not match is a ResultFileError naming the file and the offending keys. With `missing_ok`, a file
    that is not there (a stage that has not run, or failed) is None."""
    if missing_ok and not Path(path).is_file():
        return None  # type: ignore[return-value]
    data = read_json(path)
    try:
        return _adapter(kind).validate_python(data)
    except ValidationError as err:
        union = not isinstance(kind, type)  # PTQResult, RecipeResult: an error's location starts with the tag
        name = " or ".join(k.__name__ for k in get_args(get_args(kind)[0])) if union else kind.__name__
        problems = "; ".join(f"{'.'.join(map(str, e['loc'][union:])) or 'status'}: {e['msg']}"
                             for e in err.errors()[:5])
        raise ResultFileError(f"{path} is not a valid {name} file: {problems}") from None
