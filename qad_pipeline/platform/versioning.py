"""Record a Prefect run's outputs in DVC, so that `dvc status` is clean and `dvc push` sends them.

`dvc repro` records what it runs in `dvc.lock` and DVC's cache by itself. A `qad-pipeline run`
writes the same files through the same stage commands; at its end, `record_in_dvc_lock` runs
`dvc commit --force` for the stages that ran, which hashes their dependencies and outputs into
`dvc.lock` and the cache exactly as `dvc repro` would have. It only does so when the run is what
`dvc.yaml` describes: the out-root is the DVC project, the params file is its params.yaml, and
the run's overrides leave every value as params.yaml has it. Otherwise `dvc.lock` would claim
outputs for parameters they were not made with, so it says why and records nothing.

The same is one command by hand: `dvc commit --force` in the project folder.

`dvc.yaml` itself is generated from the stage registry (`qad_pipeline.core.stages`) by `dvc_yaml`
(`qad-pipeline dvc-yaml`), so it cannot drift from what the flow runs.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import yaml

from qad_pipeline.core.config import PROJECT_PARAMS, PROJECT_ROOT, ConfigError, Params, load_params, looks_local
from qad_pipeline.core.params_files import read_params_file
from qad_pipeline.core.stage_types import Stage, fill
from qad_pipeline.core.stages import STAGES


def dvc_project(root: Path) -> bool:
    return (root / ".dvc").is_dir() and (root / "dvc.yaml").is_file()


def stage_names(ran: list[tuple[str, str | None]]) -> list[str]:
    """The DVC names of the (stage, recipe) pairs that ran: `ptq@<recipe>` for the foreach stage."""
    return [STAGES[name].dvc_name(recipe) for name, recipe in ran]


def why_not_recorded(root: Path, params_file: Path, overrides: list[str]) -> str | None:
    """None when the run matches dvc.yaml and params.yaml; else the reason it cannot be recorded."""
    if not dvc_project(root):
        return f"{root} is not a DVC project (no .dvc/ and dvc.yaml)"
    if params_file.resolve() != (root / "params.yaml").resolve():
        return f"the run used {params_file}, not the DVC project's {root / 'params.yaml'}"
    if read_params_file(params_file).parent is not None:
        return f"{params_file} extends another params file, which DVC does not follow (it reads params.yaml alone)"
    unversioned = {"versioning": None}  # where the outputs are pushed changes none of them
    if overrides and (load_params(params_file, overrides).model_copy(update=unversioned)
                      != load_params(params_file).model_copy(update=unversioned)):
        return (f"the run overrode params.yaml ({', '.join(overrides)}); "
                "`dvc exp run --set-param ...` records such runs")
    return None


def record_in_dvc_lock(root: Path, params_file: Path, overrides: list[str], stages: list[str]) -> tuple[bool, str]:
    """`dvc commit --force` the stages that ran; (recorded?, what happened) for the run's log."""
    reason = why_not_recorded(root, params_file, overrides)
    if reason:
        return False, f"not recorded in DVC: {reason}"
    declared = yaml.safe_load((root / "dvc.yaml").read_text()).get("stages", {})
    left_out = [name for name in stages if name.split("@")[0] not in declared]
    stages = [name for name in stages if name not in left_out]
    cmd = [sys.executable, "-m", "dvc", "commit", "--force", "--quiet", *stages]
    done = subprocess.run(cmd, cwd=root, capture_output=True, text=True)
    if done.returncode != 0:
        return False, (f"`dvc commit` failed (exit {done.returncode}); the results are on disk, record them "
                       f"with `dvc commit --force` in {root}: {(done.stderr or done.stdout).strip()[-800:]}")
    return True, (f"recorded in DVC ({len(stages)} stages in dvc.lock and the cache); `dvc push` sends them"
                  + (f"; not in dvc.yaml, so not recorded: {', '.join(left_out)} (the BPE sweep's stages are in "
                     "dvc.yaml when params.yaml sets selection.sweep: run `qad-pipeline dvc-yaml`)" if left_out else ""))


DVC_YAML_HEADER = """\
# Generated from qad_pipeline/core/stages.py by `qad-pipeline dvc-yaml`: change a stage there and run it
# again (a test fails while this file differs from what the registry generates).
#
# The same DAG as the Prefect flow (flows/pipeline.py), stage for stage and name for name: each
# stage runs the command that the flow's task runs, `qad-pipeline stage <name>`, into this folder
# (`--out-root .`: a run's default out-root is runs/<params stem> in this repository). The BPE sweep's
# stages are here only when params.yaml asks for them (selection.sweep not none, with budgets), as
# in a `qad-pipeline run`: after changing that, run `qad-pipeline dvc-yaml` again.
#
#   dvc repro                                   # everything that changed, nothing else
#   dvc exp run --set-param qad.steps=80        # an experiment with one parameter changed
#   dvc metrics diff / dvc params diff / dvc plots show
#
# Each stage lists the params.yaml keys it reads, its code (every project module it imports) and
# its input data as dependencies, and everything it writes as outputs. A local base model
# (${base_model.path}) should be tracked with `dvc add` (see docs/dvc.md) so that a new version is a
# DVC change; a hub model or dataset is no path: its id and revision (params) stand for it, so pin
# the revision. QAD with qad.source set reads that text too, which no stage
# declares (its default, null, is no path): to track it, add "${qad.source}" to the qad stage's
# inputs in qad_pipeline/core/stages.py and run `qad-pipeline dvc-yaml`, rather than edit this file.
"""


def write_dvc_yaml(params_file: Path, check: bool = False) -> tuple[bool, str]:
    """`qad-pipeline dvc-yaml`: dvc.yaml beside `params_file`, written unless `check` or current;
    (was it current?, the line to print)."""
    params = load_params(params_file)
    if read_params_file(params_file).parent is not None:
        raise ConfigError(f"{params_file} extends another params file: DVC reads the params of dvc.yaml's stages "
                          "from the params.yaml beside it and does not follow extends; give a file that states "
                          "every key")
    path, text = params_file.resolve().parent / "dvc.yaml", dvc_yaml(params)
    current = path.is_file() and path.read_text() == text
    if check:
        return current, f"{path} is {'current' if current else 'out of date: run `qad-pipeline dvc-yaml`'}"
    if not current:
        path.write_text(text)
    return current, f"{path}: {'unchanged' if current else 'written'} ({len(dvc_stages(params))} stages)"


def _yaml_value(value) -> str:
    return yaml.safe_dump(value, default_flow_style=True, width=200).strip().removesuffix("\n...")


def _hub_id(path: str, params: Params) -> bool:
    """An input `${section.key}` whose value is a hub id (a dataset, a model): no path for DVC to
    hash; its params (the id, its revision) are the stage's dependency instead."""
    found = re.fullmatch(r"\$\{(\w+)\.(\w+)\}", path)
    if not found:
        return False
    value = getattr(getattr(params, found[1]), found[2])
    return isinstance(value, str) and not looks_local(value)


def dvc_stages(params: Params) -> list[Stage]:
    """The stages dvc.yaml holds for these params: those whose gates marked `dvc` hold
    (`Stage.runs(..., dvc=True)`): the BPE sweep's only when the params ask for it
    (`stages.with_sweep`), the race only with `race.enabled`, the teacher cache only with
    `qad.teacher: cached`, the served eval only with `eval.backend: vllm`, as in a `qad-pipeline
    run` with them; QAD's and the export's whatever the selection policy and the export source."""
    return [stage for stage in STAGES.values() if stage.runs(params, dvc=True)]


def _written_by(stages: list[Stage]) -> set[str]:
    """The out-root folders and files these stages write (a per-item output: its parent folder)."""
    return {o.path.split("/{recipe}")[0] for stage in stages for o in stage.outputs}


def dvc_yaml(params: Params | None = None) -> str:
    """dvc.yaml's text, generated from the stage registry for `params` (default: the project's
    params.yaml): a stage left out (the sweep's, when the params do not sweep) is no one's input."""
    params = params or load_params(PROJECT_PARAMS)
    stages = dvc_stages(params)
    absent = _written_by([s for s in STAGES.values() if s not in stages])
    lines = [DVC_YAML_HEADER.rstrip("\n"), "stages:"]
    for stage in stages:
        lines.append(f"  {stage.name}:")
        pad = "    "
        recipe = "${item}" if stage.per_recipe else None
        if stage.per_recipe:
            lines += [f"{pad}foreach: ${{{stage.foreach}}}", f"{pad}do:"]
            pad += "  "
        lines.append(f"{pad}cmd: {' '.join(stage.command(recipe, out_root='.'))}")  # where the outs are declared
        code = [path.relative_to(PROJECT_ROOT).as_posix() for path in stage.code_files()]
        inputs = [fill(i, recipe) for i in stage.inputs if i not in absent and not _hub_id(i, params)]
        lines += [f"{pad}deps:", *(f"{pad}  - {d}" for d in [*code, *inputs])]
        lines += [f"{pad}params:", *(f"{pad}  - {key}" for key in stage.params)]
        for kind in ("outs", "metrics", "plots"):
            outputs = [o for o in stage.outputs if o.kind == kind]
            if outputs:
                lines.append(f"{pad}{kind}:")
            for output in outputs:
                path = fill(output.path, recipe)
                note = f"  # {output.note}" if output.note else ""
                options = {**(output.plot or {}), **({"persist": True} if output.persist else {})}
                lines.append(f"{pad}  - {path}" + (":" if options else "") + note)
                lines += [f"{pad}      {key}: {_yaml_value(value)}" for key, value in options.items()]
        lines.append("")
    return "\n".join(lines).rstrip("\n") + "\n"
