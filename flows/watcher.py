"""The `watch-base-checkpoints` flow: `prefect deployment run watch-base-checkpoints/cron` (it runs on a cron schedule).

Each tick looks for base checkpoints it has not seen in its `sources` and starts the pipeline
deployment once for each, without waiting for it, with the params file and overrides of the
source that found it (`flows/watch_sources.py`: the parameters and how each run's are made):

    sources: folders (watch_dir) ──┐                       params_file + overrides of the source
                                   ├── new identities ── run_deployment(deployment) ── state file
             hub ids (newest rev.) ┘

- A local checkpoint is an immediate subfolder of a source's `watch_dir`. It is picked up when it
  holds `config.json`, holds no file ending in `.incomplete` or `.tmp` (downloads and copies in
  progress) and none of its files has changed for `settle_seconds`. Its identity is the sha256
  that the pipeline's baseline records for it (`qad_pipeline.core.artifacts.folder_sha256`: the
  relative path and bytes of every file, in sorted order), so a copy of a seen checkpoint is seen
  (whichever source finds it), and a changed file makes a new checkpoint.
- A hub checkpoint is `<hub id>@<commit sha>` of the id's newest revision; the run pins that
  revision with the override `base_model.revision=<sha>`.

Before it looks, a tick checks every source (its params file and overrides validated with the
pipeline's own models); before it starts anything, every run's parameters, the deployment's
default overrides included. A bad value fails the tick with one line naming the source, and
nothing starts. `watch_dir` and `hub_model_ids`, the older parameters, are sources with
`params.yaml` and no overrides.

Each run writes under its own `runs_root/<model slug>-<first 12 hex of the identity's hash>`, so
runs on different base models never share outputs.

The state file (JSON, `state_file`) maps each identity to the flow run it started, and caches each
folder's listing (path, size, mtime_ns) with its hash, so an unchanged folder is not read again.
It is rewritten atomically after every trigger, and every trigger carries an idempotency key, so a
watcher killed between starting a run and recording it gets the same run back on its next tick.
To run a seen checkpoint again, start the deployment by hand (removing its entry from the state is
not enough while its old flow run exists: Prefect hands that run back for the same key). A failed
trigger is not recorded: it is retried on the next tick, and the watcher's own run fails naming it.

`base_model` and `params_file` reach the run as absolute paths as the watcher sees them, so the
pipeline's workers must see the watched folders and the params files at the same paths (the
image's own files and the shared volume are); `out_root` is `runs_root/<name>` as given, so a
relative `runs_root` lands in the pipeline run's working directory.
"""

from __future__ import annotations

import os
import re
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Annotated, NamedTuple

from prefect import flow, get_run_logger
from prefect.deployments import run_deployment
from prefect.exceptions import ObjectNotFound
from pydantic import Field

from flows.watch_sources import WatchedSource, check_run, check_sources, legacy_sources, run_parameters
from qad_pipeline.core.artifacts import folder_sha256, list_files, read_json, write_json
from qad_pipeline.core.config import ConfigError
from qad_pipeline.platform.runlock import flocked

FLOW_NAME = "watch-base-checkpoints"
IN_PROGRESS_SUFFIXES = (".incomplete", ".tmp")


class WatcherError(RuntimeError):
    """The watcher could not do its job: busy, unreadable state, or a trigger that failed.

    When the run fails at the end, `summary` holds what it would have returned.
    """

    def __init__(self, message: str, summary: dict | None = None):
        super().__init__(message)
        self.summary = summary


@dataclass(frozen=True)
class Checkpoint:
    """One base checkpoint as the pipeline receives it."""

    name: str  # the folder's name or the hub id; its slug names the run folder
    base_model: str  # the run's base_model.path: a folder path or a hub id
    identity: str  # "sha256:<hex>" for a folder, "<hub id>@<commit sha>" for a hub revision
    fingerprint: str  # the hex in the identity; its first 12 characters name the run folder
    revision: str | None = None  # the hub revision the run pins
    source: WatchedSource | None = None  # the source that found it: its params file and overrides

    @property
    def run_name(self) -> str:
        return f"{slug(self.name)}-{self.fingerprint[:12]}"


class FolderScan(NamedTuple):
    checkpoints: list[Checkpoint]  # settled folders, in name order
    waiting: list[str]  # why each other subfolder is not picked up yet
    cache: dict  # folder path -> {"files": listing, "sha256": hash}, for the folders seen now


def slug(name: str) -> str:
    """`nvidia/Nemotron-H-8B` -> `nvidia-nemotron-h-8b`: safe as a folder name and a run name."""
    return re.sub(r"[^a-z0-9._]+", "-", name.lower()).strip("-.") or "model"


def not_ready(folder: Path, files: list[list], settle_seconds: float, now: float) -> str | None:
    """Why `folder` is not a checkpoint to pick up yet, or None when it is."""
    if not (folder / "config.json").is_file():
        return f"{folder}: no config.json yet"
    busy = [rel for rel, _, _ in files if rel.endswith(IN_PROGRESS_SUFFIXES)]
    if busy:
        return f"{folder}: still being written ({busy[0]})"
    newest = max([folder.stat().st_mtime_ns] + [mtime for _, _, mtime in files]) / 1e9
    if now - newest < settle_seconds:
        return f"{folder}: changed {now - newest:.0f}s ago, waiting until it is {settle_seconds:g}s old"
    return None


def scan_folder(watch_dir: Path, settle_seconds: float, cache: dict, now: float | None = None) -> FolderScan:
    """The settled checkpoints among the immediate subfolders of `watch_dir`.

    A folder whose listing (path, size, mtime_ns of every file) equals its entry in `cache` keeps
    the cached hash instead of being read again; one that changes while it is hashed waits.
    """
    now = time.time() if now is None else now
    checkpoints, waiting, new_cache = [], [], {}
    for folder in sorted(p for p in watch_dir.iterdir() if p.is_dir() and not p.name.startswith(".")):
        folder = folder.absolute()
        try:
            files = list_files(folder)
            reason = not_ready(folder, files, settle_seconds, now)
            entry = cache.get(str(folder))
            if not reason and (not entry or entry["files"] != files):
                entry = {"files": files, "sha256": folder_sha256(folder, files)}
                if list_files(folder) != files:
                    reason = f"{folder}: changed while it was being hashed"
        except OSError as err:  # a file removed or replaced while we looked
            reason = f"{folder}: changed while it was being read ({err})"
        if reason:
            waiting.append(reason)
            continue
        new_cache[str(folder)] = entry
        checkpoints.append(Checkpoint(folder.name, str(folder), f"sha256:{entry['sha256']}", entry["sha256"]))
    return FolderScan(checkpoints, waiting, new_cache)


def latest_hub_revision(model_id: str) -> str:
    """The commit sha of the newest revision of a Hugging Face hub model (one API call)."""
    from huggingface_hub import HfApi

    sha = HfApi().model_info(model_id).sha
    if not sha:
        raise WatcherError(f"the hub returned no revision for {model_id}")
    return sha


def hub_checkpoint(model_id: str, sha: str) -> Checkpoint:
    return Checkpoint(model_id, model_id, f"{model_id}@{sha}", sha, revision=sha)


def find_checkpoints(
    sources: list[WatchedSource], settle_seconds: float, state: dict
) -> tuple[list[Checkpoint], list[str], list[dict]]:
    """Every checkpoint the sources hold now (each with its source), in source order, why some
    folders wait, and the hub ids that could not be looked up.

    Replaces the state's folder cache with the folders seen now.
    """
    found, waiting, failed, cache = [], [], [], {}
    for source in sources:
        if source.watch_dir:
            scan = scan_folder(Path(source.watch_dir), settle_seconds, state["folders"])
            cache.update(scan.cache)
            found += [replace(ckpt, source=source) for ckpt in scan.checkpoints]
            waiting += scan.waiting
            continue
        try:
            found.append(replace(hub_checkpoint(source.hub_id, latest_hub_revision(source.hub_id)), source=source))
        except Exception as err:  # noqa: BLE001  (one unreachable id must not stop the others)
            failed.append({"base_model": source.hub_id, "error": f"hub lookup failed: {err}"})
    state["folders"] = cache
    return found, waiting, failed


def new_checkpoints(found: list[Checkpoint], state: dict) -> list[Checkpoint]:
    """The checkpoints whose identity the state has not recorded, each identity once (the first
    source's: a copy of one checkpoint in two folders starts one run)."""
    fresh: dict[str, Checkpoint] = {}
    for ckpt in found:
        if ckpt.identity not in state["seen"]:
            fresh.setdefault(ckpt.identity, ckpt)
    return list(fresh.values())


def load_state(path: Path) -> dict:
    """The watcher's state: {"seen": {identity: trigger record}, "folders": {path: listing and hash}}.

    A missing file is an empty state; an unreadable one is an error, never a fresh start, which
    would start every known checkpoint again.
    """
    if not path.exists():
        return {"seen": {}, "folders": {}}
    try:
        state = read_json(path)
    except (OSError, ValueError) as err:
        raise WatcherError(f"cannot read the watcher state {path}: {err}; fix or move it") from err
    if not isinstance(state, dict) or not isinstance(state.get("seen"), dict):
        raise WatcherError(f"{path} is not a watcher state (no 'seen' mapping); fix or move it")
    state.setdefault("folders", {})
    return state


def save_state(path: Path, state: dict) -> None:
    """Write the state through a temporary file and os.replace: a crash leaves the old or the new."""
    write_json(path, state)


@contextmanager
def state_lock(state_path: Path) -> Iterator[None]:
    """Hold `<state file>.lock` (flock, non-blocking): one watcher run at a time per state file."""
    lock_path = state_path.with_name(state_path.name + ".lock")

    def busy(fh) -> WatcherError:
        fh.seek(0)
        holder = fh.read().strip() or "another process"
        return WatcherError(f"another {FLOW_NAME} run ({holder}) holds {lock_path}; this run starts nothing")

    with flocked(lock_path, busy) as fh:
        fh.truncate(0)
        fh.write(f"pid {os.getpid()} on {socket.gethostname()}\n")
        fh.flush()
        yield


def deployment_overrides(deployment: str) -> list[str]:
    """The `overrides` the deployment gives its runs by default, which the watcher's runs keep."""
    from prefect.client.orchestration import get_client

    try:
        with get_client(sync_client=True) as client:
            found = client.read_deployment_by_name(deployment)
    except ObjectNotFound:
        raise WatcherError(f"deployment {deployment!r} not found on the Prefect server") from None
    except Exception as err:  # an unreachable server, ...: report, retry next tick
        raise WatcherError(f"cannot read deployment {deployment!r}: {err}") from err
    return list((found.parameters or {}).get("overrides") or [])


def plan_runs(
    fresh: list[Checkpoint], deployment: str, runs_root: str
) -> tuple[list[tuple[Checkpoint, dict]], list[dict]]:
    """Each new checkpoint's run parameters (`watch_sources.run_parameters`), all checked before any
    run starts: a bad one raises a one-line `ConfigError` naming its source. When the deployment
    cannot be read, every checkpoint is returned as failed instead (retried next tick)."""
    if not fresh:
        return [], []
    try:
        defaults = deployment_overrides(deployment)
    except WatcherError as err:
        return [], [{"base_model": c.base_model, "identity": c.identity, "error": str(err)} for c in fresh]
    runs = []
    for ckpt in fresh:
        out_root = (Path(runs_root) / ckpt.run_name).as_posix()
        parameters = run_parameters(ckpt.source, ckpt.base_model, ckpt.revision, defaults, out_root)
        try:
            check_run(ckpt.source, parameters)
        except ConfigError as err:  # the source alone passed check_sources: the deployment's defaults are in it
            raise ConfigError(f"{err} (with {deployment}'s default overrides {defaults})") from None
        runs.append((ckpt, parameters))
    return runs, []


def trigger(ckpt: Checkpoint, deployment: str, parameters: dict) -> dict:
    """Start one run of `deployment` for `ckpt` with `parameters`, without waiting for it; returns
    the state's record.

    The run is not linked as a subflow: cancelling a watcher run must not cancel the pipeline
    runs it started. The idempotency key makes a repeated trigger return the same flow run.
    """
    try:
        run = run_deployment(
            deployment, parameters=parameters, timeout=0, as_subflow=False, flow_run_name=ckpt.run_name,
            idempotency_key=f"{FLOW_NAME}:{deployment}:{ckpt.identity}",
        )
    except ObjectNotFound:
        raise WatcherError(f"deployment {deployment!r} not found on the Prefect server") from None
    except Exception as err:  # a schema mismatch (HTTP 409), an unreachable server, ...: report, retry next tick
        raise WatcherError(f"deployment {deployment!r} refused the run: {err}") from err
    return {
        "flow_run_id": str(run.id), "flow_run_name": run.name, "deployment": deployment,
        "triggered_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "base_model": ckpt.base_model, "params_file": parameters["params_file"], "out_root": parameters["out_root"],
    }


@flow(name=FLOW_NAME)
def watch_base_checkpoints(
    sources: list[WatchedSource] | None = None,
    watch_dir: str | None = None,
    hub_model_ids: list[str] | None = None,
    deployment: Annotated[str, Field(pattern=r"^[^/]+/[^/]+$")] = "qad-pipeline/default",
    state_file: str = "artifacts/watcher/seen.json",
    runs_root: str = "runs",
    settle_seconds: Annotated[float, Field(ge=0)] = 60,
) -> dict:
    """Start `deployment` once for each base checkpoint not seen before, with its source's params.

    `sources`: [{"watch_dir": folder | "hub_id": id, "params_file": path, "overrides": [...]}, ...]
    (`flows/watch_sources.py`); `watch_dir` and `hub_model_ids` add sources with params.yaml.
    Returns {"seen": checkpoints found now, "triggered": the new records, "failed": what could not
    be triggered, "waiting": folders not picked up yet}. When anything failed, the run fails at the
    end with a WatcherError naming each failure (its `summary` is that dict); the rest still ran.
    """
    watched = [*(sources or []), *legacy_sources(watch_dir, hub_model_ids)]
    if not watched:
        raise ValueError("give sources (or watch_dir, hub_model_ids): there is nothing to watch")
    check_sources(watched)  # a bad params file or override: one line, before anything is looked up
    logger = get_run_logger()
    state_path = Path(state_file)
    with state_lock(state_path):
        state = load_state(state_path)
        found, waiting, failed = find_checkpoints(watched, settle_seconds, state)
        for reason in waiting:
            logger.info("not yet: %s", reason)
        runs, unreadable = plan_runs(new_checkpoints(found, state), deployment, runs_root)
        failed += unreadable

        triggered = []
        for ckpt, parameters in runs:
            try:
                record = trigger(ckpt, deployment, parameters)
            except WatcherError as err:
                logger.error("%s: %s; it is retried on the next tick", ckpt.base_model, err)
                failed.append({"base_model": ckpt.base_model, "identity": ckpt.identity, "error": str(err)})
                continue
            state["seen"][ckpt.identity] = record
            save_state(state_path, state)
            triggered.append({"identity": ckpt.identity, **record})
            logger.info("%s: started %s (flow run %s) with %s writing to %s", ckpt.identity, deployment,
                        record["flow_run_name"], record["params_file"], record["out_root"])
        save_state(state_path, state)

    logger.info("%d checkpoint(s) found, %d started, %d failed, %d waiting; state in %s",
                len(found), len(triggered), len(failed), len(waiting), state_path)
    summary = {"seen": len(found), "triggered": triggered, "failed": failed, "waiting": waiting}
    if failed:
        raise WatcherError("not triggered: " + "; ".join(f"{f['base_model']}: {f['error']}" for f in failed), summary)
    return summary
