"""Artifact folders and their small JSON manifests.

Stages talk through files: each writes its outputs into a folder (or a metrics JSON) and
`write_json` puts them in place atomically, so a killed stage never leaves a half-written file
that looks complete.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterable
from contextlib import contextmanager
from pathlib import Path
from typing import Any


def write_json(path: Path, data: Any) -> Path:
    """Write `data` as indented JSON via a temporary file and an atomic rename."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as fh:
            json.dump(data, fh, indent=2, sort_keys=False, default=str)
            fh.write("\n")
        os.replace(tmp, path)
    except BaseException:  # a full disk, a signal: no half-written temporary file is left
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def read_json(path: Path) -> Any:
    return json.loads(Path(path).read_text())


@contextmanager
def staged_dir(final: Path):
    """Yield a fresh temporary folder beside `final`; on success it replaces `final` whole.

    A folder a killed process was staging (`.<name>.*.partial`, SIGKILL leaves no time to remove
    it) is removed first: the stage that writes `final` holds the out-root's lock, so it is nobody's.
    """
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    for stale in final.parent.glob(f".{final.name}.*.partial"):
        shutil.rmtree(stale, ignore_errors=True)
    tmp = Path(tempfile.mkdtemp(dir=final.parent, prefix=f".{final.name}.", suffix=".partial"))
    tmp.chmod(0o755)
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)


def fingerprint(parts: Iterable[bytes | str]) -> str:
    """sha256 over a sequence of byte strings (or str), each length-prefixed."""
    digest = hashlib.sha256()
    for part in parts:
        data = part.encode() if isinstance(part, str) else part
        digest.update(len(data).to_bytes(8, "little"))
        digest.update(data)
    return digest.hexdigest()


def list_files(folder: Path) -> list[list]:
    """[relative path, size, mtime_ns] of every file under `folder`, in the order they are hashed."""
    files = sorted(p for p in Path(folder).rglob("*") if p.is_file())
    return [[p.relative_to(folder).as_posix(), (st := p.stat()).st_size, st.st_mtime_ns] for p in files]


def folder_sha256(folder: Path, files: list[list] | None = None) -> str:
    """sha256 over each file's relative path and bytes, in `list_files` order: a checkpoint's identity."""
    digest = hashlib.sha256()
    for rel, _size, _mtime in files if files is not None else list_files(folder):
        digest.update(rel.encode())
        with (Path(folder) / rel).open("rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                digest.update(chunk)
    return digest.hexdigest()
