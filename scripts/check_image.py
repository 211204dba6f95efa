"""Check an installed qad-pipeline, as the image's last build step does: `python scripts/check_image.py`.

    python scripts/check_image.py [--constraints FILE] [--vllm | --vllm-env DIR] [--module MODULE[:NAME] ...]

What a flow-run pod needs from the image, each checked here, one line per failure and exit 1:

* every entry point imports: each module of the `tasks` and `flows` packages (found in the source
  tree, so a moved or renamed module cannot be missed), each `module:name` the stage table
  (`qad_pipeline.core.stages.STAGES`) and `prefect.yaml`'s deployments name, and the console scripts of
  the installed distribution (`qad-pipeline`); `--module` adds more;
* `qad-pipeline --help` runs;
* the pins of the torch constraints file (`--constraints`, default `$QAD_TORCH_CONSTRAINTS`; none:
  not checked) are still the installed versions: no dependency swapped the base image's torch;
* with `--vllm` (the environment `qad-pipeline setup-vllm` makes: `$QAD_VLLM_ENV`, else `.venv-vllm`),
  `--vllm-env DIR`, or `$QAD_VLLM_ENV` set: that environment exists and imports vLLM at the pinned version.

`tests/test_infra_image.py` runs it in the test environment; infra/Dockerfile runs it after installing.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata as md
import os
import shutil
import subprocess
import sys
from pathlib import Path

import yaml

from qad_pipeline.core.config import PROJECT_ROOT
from qad_pipeline.core.stages import STAGES

DISTRIBUTION = "qad-pipeline"
ENTRY_PACKAGES = ("tasks", "flows")  # every module of these is an entry point: stages and flows
# the `module:name` fields of a Stage
STAGE_REFERENCES = ("entry", "schema", "mlflow", "memory", "gpus", "cost", "eval_cost", "report")


def package_modules(package: str) -> list[str]:
    """Every module of a project package, by its file's dotted path (the import path is the file path)."""
    names = []
    for path in sorted((PROJECT_ROOT / package).rglob("*.py")):
        parts = path.relative_to(PROJECT_ROOT).with_suffix("").parts
        names.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return names


def entry_points() -> list[str]:
    """Every entry point of the installed project, as `module` or `module:name`, each once."""
    found = [m for package in ENTRY_PACKAGES for m in package_modules(package)]
    found += [ref for stage in STAGES.values() for field in STAGE_REFERENCES if (ref := getattr(stage, field))]
    deployments = yaml.safe_load((PROJECT_ROOT / "prefect.yaml").read_text()).get("deployments") or []
    found += [d["entrypoint"] for d in deployments]
    found += [ep.value for ep in md.distribution(DISTRIBUTION).entry_points if ep.group == "console_scripts"]
    return list(dict.fromkeys(found))


def one_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0]}" if text else type(err).__name__


def import_failures(references: list[str]) -> list[str]:
    """One line per `module` or `module:name` that does not import (or names nothing there)."""
    failures = []
    for ref in references:
        module, _, name = ref.partition(":")
        try:
            obj = importlib.import_module(module)
        except (Exception, SystemExit) as err:  # noqa: BLE001 (whatever breaks an import is the finding)
            failures.append(f"entry point {ref} does not import: {one_line(err)}")
            continue
        if name and not hasattr(obj, name):
            failures.append(f"entry point {ref}: module {module} imports but has no {name}")
    return failures


def cli_failures() -> list[str]:
    """`qad-pipeline --help`, the console script beside this interpreter (else on PATH)."""
    path = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    command = shutil.which(DISTRIBUTION, path=path)
    if command is None:
        return [f"no `{DISTRIBUTION}` command beside {sys.executable} or on PATH: is the project installed?"]
    done = subprocess.run([command, "--help"], capture_output=True, text=True, timeout=300, check=False)
    if done.returncode != 0:
        last = (done.stderr.strip() or done.stdout.strip() or "no output").splitlines()[-1]
        return [f"`{command} --help` exits {done.returncode}: {last}"]
    return []


def pin_failures(constraints: Path) -> list[str]:
    """One line per `name==version` of the constraints file that is not the installed version."""
    if not constraints.is_file():
        return [f"no torch constraints file at {constraints}"]
    failures = []
    for line in constraints.read_text().splitlines():
        line = line.split("#")[0].strip()
        if not line:
            continue
        name, sep, pinned = line.partition("==")
        if not sep:
            failures.append(f"{constraints}: {line!r} is not a name==version pin")
            continue
        try:
            installed = md.version(name.strip())
        except md.PackageNotFoundError:
            failures.append(f"{name.strip()} is pinned to {pinned.strip()} in {constraints} but not installed")
            continue
        if installed != pinned.strip():
            failures.append(f"{name.strip()} {installed} is installed, {constraints} pins {pinned.strip()}: "
                            "a dependency replaced the base image's build")
    return failures


def vllm_failures(env: Path) -> list[str]:
    """The serving environment at `env` exists and imports the pinned vLLM."""
    from qad_pipeline.checks.vllm_setup import VLLM_VERSION, installed_vllm

    python = env / "bin" / "python"
    if not python.is_file():
        return [f"no vLLM environment at {env} (no {python}): create it with "
                f"`qad-pipeline setup-vllm --env {env}`"]
    version = installed_vllm(python)
    if version is None:
        return [f"the vLLM environment {env} does not import vllm: run `qad-pipeline setup-vllm --env {env}`"]
    if version != VLLM_VERSION:
        return [f"the vLLM environment {env} has vLLM {version}, the serving check is pinned to {VLLM_VERSION}"]
    return []


def vllm_to_check(args: argparse.Namespace) -> Path | None:
    if args.vllm_env:
        return Path(args.vllm_env)
    if args.vllm or os.environ.get("QAD_VLLM_ENV"):
        from qad_pipeline.checks.vllm_setup import vllm_env

        return vllm_env()
    return None


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--constraints", default=os.environ.get("QAD_TORCH_CONSTRAINTS"),
                        help="name==version pins that must be the installed versions (default: $QAD_TORCH_CONSTRAINTS)")
    parser.add_argument("--vllm", action="store_true",
                        help="check the vLLM environment that qad-pipeline finds ($QAD_VLLM_ENV, else .venv-vllm)")
    parser.add_argument("--vllm-env", help="check the vLLM environment in this folder")
    parser.add_argument("--module", action="append", default=[], help="one more entry point, module or module:name")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    references = [*entry_points(), *args.module]
    failures = import_failures(references) + cli_failures()
    if args.constraints:
        failures += pin_failures(Path(args.constraints))
    vllm = vllm_to_check(args)
    if vllm is not None:
        failures += vllm_failures(vllm)
    for line in failures:
        print(line, file=sys.stderr)
    if failures:
        return 1
    checked = [f"{len(references)} entry points import", f"`{DISTRIBUTION} --help` runs"]
    checked += [f"the pins of {args.constraints} are installed"] if args.constraints else []
    checked += [f"{vllm} imports vLLM"] if vllm is not None else []
    print("image check passed: " + "; ".join(checked))
    return 0


if __name__ == "__main__":
    sys.exit(main())
