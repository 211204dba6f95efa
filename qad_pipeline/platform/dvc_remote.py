"""After a run: its outputs committed to DVC and pushed to the configured remote (`versioning.remote`,
or the environment's `QAD_DVC_REMOTE`: `qad_pipeline/core/remote_config.py`). By hand, or to retry a
failed push: `qad-pipeline push --out-root <run folder>`.

Two kinds of out-root, one remote named `qad`:

- **The pipeline's DVC project** (`.dvc/` and `dvc.yaml`: a clone of this repository, `dvc repro`'s
  folder). `versioning.record_in_dvc_lock` commits the stages that ran to `dvc.lock` and the cache, as
  before; with a remote, `dvc push -r qad <those stages>` sends them. The remote goes to
  `.dvc/config.local`, so the project's committed config is left as it is.
- **Any other folder**, e.g. a cluster run under `runs/<model>-<hash>` (the image has no `.git`
  and no `.dvc/`), becomes a DVC project of its own once a remote is configured: `dvc init
  --no-scm` (no git needed), the remote in its `.dvc/config` (URL and endpoint; never a key),
  and each output the stages that ran declare (`qad_pipeline/core/stages.py`) tracked with `dvc add`:
  `artifacts/export.dvc`, `artifacts/ptq/<recipe>.dvc`, `metrics/export.json.dvc`, ... Those small
  files and `.dvc/config` are all a workstation needs to `dvc pull` the run (infra/README.md,
  "DVC on the cluster"). Without a remote such a folder stays as it is (DVC's cache would be a
  second copy of every checkpoint, for nothing).

DVC's own commands do the work (`dvc init`, `dvc remote add`, `dvc add`, `dvc push`; S3 through the
dvc-s3 plugin). A failed push keeps everything on disk and in the run's DVC cache, and says so, with
the command that retries it.
"""

from __future__ import annotations

import fnmatch
import importlib.util
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from qad_pipeline.platform import versioning
from qad_pipeline.core.config import ConfigError, Params
from qad_pipeline.core.remote_config import RemoteParams, configured_remote
from qad_pipeline.core.stage_types import fill
from qad_pipeline.core.stages import STAGES

REMOTE = "qad"  # the remote's name in every project this module configures
POINTERS_ARTIFACT = "dvc"  # where a run's DVC pointers go in its MLflow run (`log_pointers`)


def remote_for(params: Params) -> RemoteParams | None:
    """The run's remote (params, else environment), checked: a ConfigError before any work."""
    try:
        remote = configured_remote(params.versioning)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    if remote and remote.url.startswith("s3://") and importlib.util.find_spec("dvc_s3") is None:
        raise ConfigError(f"the DVC remote {remote.url} needs DVC's S3 plugin, which is not installed: "
                          "pip install 'dvc[s3]'")
    return remote


def check_out_root(root: Path, remote: RemoteParams | None) -> None:
    """With a remote, an out-root that holds a `dvc.yaml` but no `.dvc/` (the image's own
    folder given as `--out-root .`) can become neither kind of project: refused before the run."""
    if remote and (root / "dvc.yaml").is_file() and not (root / ".dvc").is_dir():
        raise ConfigError(f"{root} holds a dvc.yaml but is no DVC project, so the run could not be pushed to "
                          f"{remote.url}: give the run its own out_root (e.g. runs/<name>), or `dvc init` there")


def push_remote(params: Params, root: Path) -> RemoteParams:
    """`qad-pipeline push`: the remote (pushing, whatever `push` says) and a finished run under `root`."""
    remote = remote_for(params)
    if remote is None:
        raise ConfigError("no DVC remote configured: set versioning.remote (--set 'versioning.remote={url: "
                          "s3://<bucket>/<prefix>, endpoint_url: http://<host>:9000}') or QAD_DVC_REMOTE")
    if not (root / "artifacts").is_dir():
        raise ConfigError(f"no run under {root} (no artifacts/ folder)")
    check_out_root(root, remote)
    return remote.model_copy(update={"push": True})


def run_outputs(root: Path, ran: list[tuple[str, str | None]]) -> list[str]:
    """The outputs (relative to `root`) that the (stage, item) pairs that ran declare and that exist."""
    paths = [fill(o.path, item) for name, item in ran for o in STAGES[name].outputs]
    return [p for p in dict.fromkeys(paths) if (root / p).exists()]


def ran_on_disk(root: Path) -> list[tuple[str, str | None]]:
    """The (stage, item) pairs a finished run left under `root` (`qad-pipeline push`): a stage with
    `done` files when they all exist (a per-item stage's items: the folders its `.../{recipe}`
    output left, so a failed recipe's leftovers are not one), else when any output exists."""
    found = []
    for stage in STAGES.values():
        items: list[str | None] = [None]
        if stage.per_recipe:
            parent = root / stage.outputs[0].path.split("/{recipe}")[0]
            items = [p.name for p in sorted(parent.glob("*")) if p.is_dir()] if parent.is_dir() else []
        for item in items:
            check = all if stage.done else any
            if check((root / fill(p, item)).exists() for p in stage.done or [o.path for o in stage.outputs]):
                found.append((stage.name, item))
    return found


def dvc(root: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dvc", *args], cwd=root, capture_output=True, text=True)


def _failed(what: str, done: subprocess.CompletedProcess) -> str:
    """One line: DVC's own ERROR line (without its "Having any troubles?" footer), else its last line."""
    lines = [line.strip() for line in (done.stderr or done.stdout).splitlines() if line.strip()]
    said = next((line for line in lines if line.startswith("ERROR")), lines[-1] if lines else "no output")
    return f"`dvc {what}` failed (exit {done.returncode}): {said[:600]}"


def add_remote(root: Path, remote: RemoteParams, local: bool) -> str | None:
    """Set remote `qad` in the project at `root`: in a run folder's `.dvc/config` as its default, in
    the pipeline project's `.dvc/config.local` (`local`) beside its own default; None, or why not."""
    where = ["--local"] if local else []
    steps = [["remote", "add", *where, *([] if local else ["--default"]), "--force", REMOTE, remote.url],
             *(["remote", "modify", *where, REMOTE, key, value] for key, value in remote.dvc_settings().items())]
    for args in steps:
        done = dvc(root, *args)
        if done.returncode != 0:
            return _failed(" ".join(args[:2]), done)
    return None


def track_run_folder(root: Path, remote: RemoteParams, ran: list[tuple[str, str | None]],
                     log: Callable[[str], None]) -> tuple[list[str], str | None]:
    """Make `root` a DVC project (once) with the remote, and `dvc add` the run's outputs; (the
    paths tracked, None or the failure)."""
    if not (root / ".dvc").is_dir():
        done = dvc(root, "init", "--no-scm", "--quiet")
        if done.returncode != 0:
            return [], _failed("init --no-scm", done)
    error = add_remote(root, remote, local=False)
    if error:
        return [], error
    outputs = run_outputs(root, ran)
    declared = [o.path.replace("{recipe}", "*") for stage in STAGES.values() for o in stage.outputs]
    for pointer in pointer_files(root)[1:]:  # a previous run's, for an output this run cleared and did not write
        target = pointer.as_posix().removesuffix(".dvc")
        if not (root / target).exists() and any(fnmatch.fnmatchcase(target, pattern) for pattern in declared):
            (root / pointer).unlink()
    log(f"DVC: tracking {len(outputs)} outputs of the run in {root} (`dvc add`: each file hashed and cached once)")
    done = dvc(root, "add", "--quiet", *outputs) if outputs else None
    if done is not None and done.returncode != 0:
        return [], _failed("add", done)
    return outputs, None


def after_run(root: Path, params_file: Path, overrides: list[str], ran: list[tuple[str, str | None]],
              remote: RemoteParams | None, log: Callable[[str], None] = lambda line: None) -> tuple[bool, str]:
    """The run's outputs committed to DVC (and pushed, with a remote that pushes): (all done?, the
    one line the run logs and its summary keeps in `dvc`). `log` gets a line before each long step."""
    stages = versioning.stage_names(ran)
    if versioning.dvc_project(root):
        recorded, line = versioning.record_in_dvc_lock(root, params_file, overrides, stages)
        if not recorded or remote is None:
            return recorded, line
        targets, error = stages, add_remote(root, remote, local=True)
    elif remote is None:
        _, line = versioning.record_in_dvc_lock(root, params_file, overrides, stages)
        return True, line + "; no DVC remote configured (versioning.remote), so the outputs stay here only"
    else:
        targets, error = track_run_folder(root, remote, ran, log)
        line = f"tracked in the run's own DVC project {root} ({len(targets)} outputs, `dvc add`)"
    retry = f"`qad-pipeline push --out-root {root}`"
    if error:
        return False, f"not pushed to DVC remote {remote.url}: {error}; the results are on disk; retry with {retry}"
    if not remote.push:
        return True, f"{line}; not pushed (versioning.remote.push is false): {retry} sends them to {remote.url}"
    log(f"DVC: pushing the run's outputs to {remote.url}")
    done = dvc(root, "push", "--remote", REMOTE, *targets)
    if done.returncode != 0:
        return False, (f"{line}; the push to DVC remote {remote.url} FAILED, the results are kept on disk and in "
                       f"the DVC cache; retry with {retry}: {_failed('push', done)}")
    pushed = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else "pushed"
    return True, f"{line}; pushed to DVC remote {remote.url} ({pushed})"


def run_project(root: Path) -> bool:
    """A run folder made a DVC project of its own here (`.dvc/`, no `dvc.yaml`)."""
    return (root / ".dvc").is_dir() and not versioning.dvc_project(root)


def pointer_files(root: Path) -> list[Path]:
    """All a workstation needs to `dvc pull` a run folder (relative to it): `.dvc/config` (the
    remote; no keys) and the `*.dvc` files (each output's hash)."""
    pointers = [p.relative_to(root) for p in root.rglob("*.dvc") if p.is_file()]
    return [Path(".dvc/config"), *sorted(p for p in pointers if ".dvc" not in p.parts[:-1])]


def log_pointers(root: Path, uri: str, run_id: str) -> str:
    """Log a run folder's DVC pointers to its MLflow run under `dvc/` (then, on a workstation,
    `mlflow artifacts download --run-id <id> --artifact-path dvc` and `dvc pull` there); one line
    saying so, or why not (a failure here never costs the run its results)."""
    import shutil
    import tempfile

    from qad_pipeline import tracking

    try:
        with tempfile.TemporaryDirectory() as staged:
            files = pointer_files(root)
            for rel in files:
                (Path(staged) / rel).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy(root / rel, Path(staged) / rel)
            tracking.client_for(uri).log_artifacts(run_id, staged, POINTERS_ARTIFACT)
    except Exception as err:  # noqa: BLE001
        return f"could not log the DVC pointers to MLflow run {run_id} ({err})"
    return f"its {len(files)} DVC pointer files are in MLflow run {run_id} under {POINTERS_ARTIFACT}/"

