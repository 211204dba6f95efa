"""Record a Prefect run's outputs in DVC, so that `dvc status` is clean and `dvc push` sends them.

`dvc repro` records what it runs in `dvc.lock` and DVC's cache by itself. A `qad-pipeline run`
writes the same files through the same stage commands; at its end, `record_run` runs
`dvc commit --force` for the stages that ran, which hashes their dependencies and outputs into
`dvc.lock` and the cache exactly as `dvc repro` would have. It only does so when the run is what
`dvc.yaml` describes: the out-root is the DVC project, the params file is its params.yaml, and
the run's overrides leave every value as params.yaml has it. Otherwise `dvc.lock` would claim
outputs for parameters they were not made with, so it says why and records nothing.

The same is one command by hand: `dvc commit --force` in the project folder.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from qad_pipeline.config import load_params


def dvc_project(root: Path) -> bool:
    return (root / ".dvc").is_dir() and (root / "dvc.yaml").is_file()


def stage_names(ran: list[str], recipes: list[str]) -> list[str]:
    """The flow's stage names as DVC names them: `ptq/<recipe>` is the foreach stage `ptq@<recipe>`."""
    return [f"ptq@{name[4:]}" if name.startswith("ptq/") and name[4:] in recipes else name for name in ran]


def why_not_recorded(root: Path, params_file: Path, overrides: list[str]) -> str | None:
    """None when the run matches dvc.yaml and params.yaml; else the reason it cannot be recorded."""
    if not dvc_project(root):
        return f"{root} is not a DVC project (no .dvc/ and dvc.yaml)"
    if params_file.resolve() != (root / "params.yaml").resolve():
        return f"the run used {params_file}, not the DVC project's {root / 'params.yaml'}"
    if overrides and load_params(params_file, overrides) != load_params(params_file):
        return (f"the run overrode params.yaml ({', '.join(overrides)}); "
                "`dvc exp run --set-param ...` records such runs")
    return None


def record_run(root: Path, params_file: Path, overrides: list[str], stages: list[str]) -> tuple[bool, str]:
    """`dvc commit --force` the stages that ran; (recorded?, what happened) for the run's log."""
    reason = why_not_recorded(root, params_file, overrides)
    if reason:
        return False, f"not recorded in DVC: {reason}"
    cmd = [sys.executable, "-m", "dvc", "commit", "--force", "--quiet", *stages]
    done = subprocess.run(cmd, cwd=root, capture_output=True, text=True)
    if done.returncode != 0:
        return False, (f"`dvc commit` failed (exit {done.returncode}); the results are on disk, record them "
                       f"with `dvc commit --force` in {root}: {(done.stderr or done.stdout).strip()[-800:]}")
    return True, f"recorded in DVC ({len(stages)} stages in dvc.lock and the cache); `dvc push` sends them"
