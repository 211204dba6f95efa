"""The watch-base-checkpoints flow's folder rules, checkpoint identity and state, without a
Prefect server (tests/test_watcher.py runs the flow against one)."""

import hashlib
import json
import os
import time
from pathlib import Path

import pytest

from flows import watcher
from flows.watcher import WatcherError, load_state, scan_folder, slug, state_lock

SHA_A = "a" * 40


def write_checkpoint(folder: Path, weights: bytes = b"\x00\x01" * 64) -> Path:
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({"model_type": "llama", "name": folder.name}))
    (folder / "model.safetensors").write_bytes(weights)
    (folder / "tokenizer").mkdir()
    (folder / "tokenizer" / "tokenizer.json").write_text("{}")
    return folder


def expected_sha256(folder: Path) -> str:
    """The documented identity, computed here independently: relative path + bytes, sorted."""
    digest = hashlib.sha256()
    for rel in ["config.json", "model.safetensors", "tokenizer/tokenizer.json"]:
        digest.update(rel.encode() + (folder / rel).read_bytes())
    return digest.hexdigest()


def set_age(folder: Path, seconds: float) -> None:
    past = time.time() - seconds
    for p in [folder, *folder.rglob("*")]:
        os.utime(p, (past, past))



def test_only_settled_complete_folders_are_picked_up(tmp_path):
    incoming = tmp_path / "incoming"
    ready = write_checkpoint(incoming / "ready")
    fresh = write_checkpoint(incoming / "fresh")
    downloading = write_checkpoint(incoming / "downloading")
    (downloading / "model-00002.safetensors.incomplete").write_bytes(b"x")
    copying = write_checkpoint(incoming / "copying")
    (copying / "tokenizer" / "vocab.json.tmp").write_bytes(b"x")
    (incoming / "no-config").mkdir()
    (incoming / "no-config" / "model.safetensors").write_bytes(b"x")
    write_checkpoint(incoming / ".staging")
    (incoming / "notes.txt").write_text("not a folder")
    for folder in incoming.iterdir():
        if folder.is_dir() and folder != fresh:
            set_age(folder, 120)

    scan = scan_folder(incoming, settle_seconds=60, cache={})
    assert [c.name for c in scan.checkpoints] == ["ready"]
    assert scan.checkpoints[0].base_model == str(ready)
    assert scan.checkpoints[0].identity == f"sha256:{expected_sha256(ready)}"
    assert list(scan.cache) == [str(ready)]
    why = "\n".join(scan.waiting)
    for name, reason in [("fresh", "changed 0s ago"), ("downloading", ".incomplete"),
                         ("copying", "vocab.json.tmp"), ("no-config", "no config.json")]:
        assert f"{name}: " in why and reason in why
    assert ".staging" not in why

    later = scan_folder(incoming, settle_seconds=60, cache={}, now=time.time() + 61)
    assert [c.name for c in later.checkpoints] == ["fresh", "ready"]


def test_an_unchanged_folder_is_not_read_again(tmp_path, monkeypatch):
    folder = write_checkpoint(tmp_path / "incoming" / "m")
    hashed = []
    real = watcher.folder_sha256
    monkeypatch.setattr(watcher, "folder_sha256", lambda f, files: hashed.append(f) or real(f, files))

    first = scan_folder(tmp_path / "incoming", 0, {})
    again = scan_folder(tmp_path / "incoming", 0, json.loads(json.dumps(first.cache)))  # as stored
    assert len(hashed) == 1 and again.checkpoints == first.checkpoints

    set_age(folder, 30)  # touched, same bytes: read again, same identity
    touched = scan_folder(tmp_path / "incoming", 0, again.cache)
    assert len(hashed) == 2 and touched.checkpoints[0].identity == first.checkpoints[0].identity

    (folder / "model.safetensors").write_bytes(b"\x02" * 100)
    changed = scan_folder(tmp_path / "incoming", 0, touched.cache)
    assert len(hashed) == 3 and changed.checkpoints[0].identity == f"sha256:{expected_sha256(folder)}"
    assert changed.checkpoints[0].identity != first.checkpoints[0].identity


def test_identity_is_the_hash_the_pipeline_records(tmp_path):
    """The watcher's identity equals the baseline's base_model.sha256, so runs and lineage agree."""
    from qad_pipeline.core.config import BaseModelParams
    from qad_pipeline.core.modeling import checkpoint_identity

    folder = write_checkpoint(tmp_path / "incoming" / "m")
    (folder / "a.txt").write_text("sorts between 'a' dirs and files")
    (folder / "a").mkdir()
    (folder / "a" / "b.bin").write_bytes(b"\x07")
    (folder / ".cache").mkdir()
    (folder / ".cache" / "meta").write_text("hidden files count too")
    [ckpt] = scan_folder(tmp_path / "incoming", 0, {}).checkpoints
    assert ckpt.fingerprint == checkpoint_identity(BaseModelParams(path=str(folder)))["sha256"]


def test_state_is_never_silently_reset_and_one_run_at_a_time(tmp_path):
    state_file = tmp_path / "seen.json"
    assert load_state(state_file) == {"seen": {}, "folders": {}}
    state_file.write_text('{"seen": {')
    with pytest.raises(WatcherError, match="cannot read the watcher state"):
        load_state(state_file)

    busy = r"another watch-base-checkpoints run \(pid \d+ .*\) holds"
    with state_lock(state_file), pytest.raises(WatcherError, match=busy), state_lock(state_file):
        pass
    with state_lock(state_file):  # released
        pass


def test_run_folder_names():
    assert slug("nvidia/Nemotron-H-8B-Base-8K") == "nvidia-nemotron-h-8b-base-8k"
    assert slug("My Model (v2)") == "my-model-v2"
    assert watcher.hub_checkpoint("org/M", SHA_A).run_name == "org-m-aaaaaaaaaaaa"
