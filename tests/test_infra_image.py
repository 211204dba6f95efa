"""Offline checks of infra/ (no Docker, cluster or network): every file parses; the image builds the
project on a CUDA PyTorch; the Prefect and MLflow versions agree across the image, compose and workers;
the image's own checks (scripts/check_image.py) pass here and fail on what they are for."""

from __future__ import annotations

import importlib.metadata as md
import importlib.util
import json
import os
import re
import shlex
import subprocess
import sys

import pytest
import yaml
from packaging.version import Version

from qad_pipeline.core.params_files import read_params_file
from qad_pipeline.core.stages import STAGES
from tests.infra_commands import shell_commands
from tests.infra_files import INFRA, K8S, ROOT, WORKERS, compose, docker_args, dockerfile, pyproject, requirement, yaml_docs

# ---------------------------------------------------------------------------------------------
# the files parse


def test_every_infra_file_parses():
    expected = {
        "Dockerfile", "Dockerfile.dockerignore", "README.md", "compose.yaml", "mlflow.Dockerfile",
        "postgres-init.sql", ".env.example", "k8s/base/kustomization.yaml", "k8s/base/cluster.yaml",
        "k8s/base/qad-config.env", "k8s/base/gpu-base-job-template.json", "k8s/base/control-base-job-template.json",
        "k8s/base/worker-gpu.yaml", "k8s/base/worker-control.yaml", "k8s/base/sync_work_pool.py",
        "k8s/overlays/external/kustomization.yaml", "k8s/overlays/trial/kustomization.yaml",
        "k8s/components/gpu-pool-4/kustomization.yaml",
    }
    present = {p.relative_to(INFRA).as_posix() for p in INFRA.rglob("*") if p.is_file()}
    assert expected <= present, f"missing in infra/: {sorted(expected - present)}"
    for path in INFRA.rglob("*"):
        if path.suffix == ".py":
            compile(path.read_text(), str(path), "exec")
        if path.suffix in (".yaml", ".yml"):
            assert yaml_docs(path), f"{path} is empty"
        elif path.suffix == ".json":
            assert isinstance(json.loads(path.read_text()), dict), path
    for path in (INFRA / "Dockerfile", INFRA / "mlflow.Dockerfile"):
        words = [w for w, _ in dockerfile(path)]
        unknown = set(words) - {"ARG", "FROM", "LABEL", "ENV", "RUN", "WORKDIR", "COPY", "USER", "CMD", "EXPOSE",
                                "ENTRYPOINT", "HEALTHCHECK", "SHELL"}
        assert not unknown, f"{path}: unknown instructions {unknown}"
        assert "FROM" in words and words.index("FROM") <= min(i for i, w in enumerate(words) if w != "ARG")
    assert "not written yet" not in (INFRA / "README.md").read_text()


# ---------------------------------------------------------------------------------------------
# the image and the versions


def test_versions_agree_everywhere():
    args = docker_args()
    prefect_version, mlflow_version = args["PREFECT_VERSION"], args["MLFLOW_VERSION"]
    assert Version(prefect_version) in requirement("prefect").specifier
    assert Version(mlflow_version) in requirement("mlflow").specifier
    images = [compose()["services"]["prefect-server"]["image"]]
    for path in [*WORKERS.values(), *(K8S / "overlays" / "trial").glob("*.yaml"), *(K8S / "components").glob("*/*.yaml")]:
        for doc in yaml_docs(path):
            if doc.get("kind") in ("Deployment", "StatefulSet"):
                spec = doc["spec"]["template"]["spec"]
                images += [c["image"] for c in spec.get("initContainers", []) + spec["containers"]
                           if c["image"].startswith("prefecthq/")]
    for image in images:
        assert re.fullmatch(rf"prefecthq/prefect:{re.escape(prefect_version)}-python3\.\d+(-kubernetes)?", image), (
            f"{image}: the Prefect server, the workers and the flow image share Prefect {prefect_version}")
    assert docker_args(INFRA / "mlflow.Dockerfile")["MLFLOW_VERSION"] == mlflow_version
    for name in ("mlflow", "create-bucket"):
        assert compose()["services"][name]["image"].endswith(f":{mlflow_version}")
    (mlflow,) = [d for d in yaml_docs(K8S / "overlays" / "trial" / "mlflow.yaml") if d["kind"] == "Deployment"]
    spec = mlflow["spec"]["template"]["spec"]
    assert {c["image"] for c in spec["initContainers"] + spec["containers"]} == {f"qad-mlflow-server:{mlflow_version}"}


def test_dockerfile_builds_the_project_on_cuda_torch():
    instructions = dockerfile()
    args = docker_args()
    base = args["BASE_IMAGE"]
    assert re.fullmatch(r"(nvcr\.io/nvidia/pytorch:\d\d\.\d\d-py3|pytorch/pytorch:[\d.]+-cuda1[2-9]\.\d+-cudnn\d+-(runtime|devel))",
                        base), f"{base}: not a CUDA PyTorch image"
    assert ("FROM", "${BASE_IMAGE}") in instructions
    text = (INFRA / "Dockerfile").read_text()
    assert not re.search(r"torch==2\.13\.0|download\.pytorch\.org/whl/cpu|\+cpu", text), "the CPU torch must stay out"
    runs = [rest for word, rest in instructions if word == "RUN"]
    installs = [part for run in runs for part in run.split("&&") if re.search(r"\bpip install\b", part)]
    assert installs and all("PIP_CONSTRAINT=" in part for part in installs), "every pip install keeps the base torch"
    assert any(re.search(r"pip install -e \.", part) for part in installs)
    for run in runs:  # the inline Python of the RUN lines at least compiles
        for argv in shell_commands(run):
            if argv[:2] == ["python", "-c"]:
                compile(argv[2], "<Dockerfile RUN>", "exec")

    workdir = next(rest for word, rest in instructions if word == "WORKDIR")
    assert workdir.startswith("/")
    copied = set()
    for word, rest in instructions:
        if word == "COPY":
            *sources, _ = shlex.split(rest)
            for source in sources:
                assert (ROOT / source).exists(), f"COPY {source}: no such path in the repository"
                copied.add(source.rstrip("/"))
    # What the package and the default params need at run time is in the image.
    packages = {p.replace(".", "/") for p in pyproject()["tool"]["setuptools"]["packages"]}
    needed = packages | {"pyproject.toml", "params.yaml", "prefect.yaml"}  # deployed from inside the image
    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    for value in (params["base_model"]["path"], params["calibration"]["source"], params["ptq"]["recipe_dir"],
                  params["eval"]["task_dir"]):
        if not value.startswith("/") and (ROOT / value).exists():
            needed.add(value)
    for profile in sorted((ROOT / "profiles").glob("*.yaml")):  # a profile and every file it extends
        file = read_params_file(profile)
        while file is not None:
            needed.add(str(file.path.resolve().relative_to(ROOT)))
            file = file.parent
    missing = {n for n in needed if not any(n == c or n.startswith(c + "/") for c in copied)}
    assert not missing, f"not copied into the image: {sorted(missing)}"
    users = [rest for word, rest in instructions if word == "USER"]
    assert users and users[-1] not in ("root", "0"), "run as a non-root user"
    ignore = (INFRA / "Dockerfile.dockerignore").read_text().split()
    assert {".git", ".venv"} <= set(ignore)


# ---------------------------------------------------------------------------------------------
# the image's checks: scripts/check_image.py, which the Dockerfile runs after installing

CHECK_IMAGE = ROOT / "scripts" / "check_image.py"


@pytest.fixture(scope="module")
def check_image():
    spec = importlib.util.spec_from_file_location("check_image", CHECK_IMAGE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def torch_pins(path) -> str:
    """A constraints file as the Dockerfile writes it: the torch family as installed here."""
    have = {d.metadata["Name"].lower(): d.version for d in md.distributions()}
    pins = [f"{n}=={have[n]}" for n in ("torch", "torchvision", "torchaudio", "triton", "pytorch-triton") if n in have]
    path.write_text("\n".join(pins) + "\n")
    return str(path)


def test_dockerfile_runs_the_image_check_after_installing():
    runs = [rest for word, rest in dockerfile() if word == "RUN"]
    # the command after a shell keyword (`if ...; then CMD; else CMD; fi`)
    commands = [argv[1:] if argv[0] in ("then", "else") else argv for run in runs for argv in shell_commands(run)]
    checks = [i for i, argv in enumerate(commands) if argv[:2] == ["python", "scripts/check_image.py"]]
    installs = [i for i, argv in enumerate(commands) if "pip" in argv and "--no-deps" in argv]
    assert checks and installs and min(checks) > max(installs), "the check runs after the project is installed"
    for i in checks:
        assert commands[i][2:4] == ["--constraints", "$QAD_TORCH_CONSTRAINTS"], commands[i]
    assert any("--vllm-env" in commands[i] for i in checks), "the vLLM environment is checked when it is built"
    assert not [argv for argv in commands if argv[:2] == ["python", "-c"] and "import qad_pipeline." in argv[2]], (
        "the entry points are checked by scripts/check_image.py, not by an inline import list")
    copied = [shlex.split(rest)[:-1] for word, rest in dockerfile() if word == "COPY"]
    assert any(s.rstrip("/") == "scripts" for sources in copied for s in sources)


def test_the_image_check_lists_every_entry_point_from_the_tree(check_image):
    listed = check_image.entry_points()
    modules = {ref.partition(":")[0] for ref in listed}
    for package in ("tasks", "flows"):
        files = {p.stem for p in (ROOT / package).glob("*.py") if p.stem != "__init__"}
        assert {f"{package}.{name}" for name in files} <= modules
    assert {s.entry for s in STAGES.values()} <= set(listed)
    assert "qad_pipeline.cli:app" in listed
    deployments = yaml.safe_load((ROOT / "prefect.yaml").read_text())["deployments"]
    assert {d["entrypoint"] for d in deployments} <= set(listed)


def test_the_image_check_passes_in_the_test_environment(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "QAD_VLLM_ENV"}
    done = subprocess.run([sys.executable, str(CHECK_IMAGE), "--constraints", torch_pins(tmp_path / "pins.txt")],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stderr.strip() == ""
    assert re.fullmatch(r"image check passed: \d+ entry points import; `qad-pipeline --help` runs; "
                        r"the pins of .*pins\.txt are installed", done.stdout.strip())


def test_the_image_check_fails_with_one_line_per_problem(check_image, tmp_path, monkeypatch, capsys):
    """A moved module (the Dockerfile's old `qad_pipeline.flows.pipeline`) and a replaced torch."""
    monkeypatch.delenv("QAD_VLLM_ENV", raising=False)
    monkeypatch.setattr(check_image, "entry_points", lambda: ["qad_pipeline.core.stages:STAGES"])
    bad = tmp_path / "pins.txt"
    bad.write_text("torch==0.0.1\n")
    code = check_image.main(["--constraints", str(bad), "--module", "qad_pipeline.flows.pipeline",
                             "--module", "tasks.ptq:no_such_function"])
    out = capsys.readouterr()
    assert code == 1
    assert out.out == ""
    assert out.err.splitlines() == [
        "entry point qad_pipeline.flows.pipeline does not import: ModuleNotFoundError: "
        "No module named 'qad_pipeline.flows'",
        "entry point tasks.ptq:no_such_function: module tasks.ptq imports but has no no_such_function",
        f"torch {md.version('torch')} is installed, {bad} pins 0.0.1: a dependency replaced the base image's build",
    ]


def test_the_image_check_refuses_a_missing_or_broken_vllm_environment(check_image, tmp_path, monkeypatch):
    missing = tmp_path / "missing"
    assert check_image.vllm_failures(missing) == [
        f"no vLLM environment at {missing} (no {missing}/bin/python): create it with "
        f"`qad-pipeline setup-vllm --env {missing}`"]
    broken = tmp_path / "broken"  # a Python without vLLM
    (broken / "bin").mkdir(parents=True)
    (broken / "bin" / "python").symlink_to(sys.executable)
    assert check_image.vllm_failures(broken) == [
        f"the vLLM environment {broken} does not import vllm: run `qad-pipeline setup-vllm --env {broken}`"]
    # checked when asked: --vllm-env, --vllm, or $QAD_VLLM_ENV set
    monkeypatch.delenv("QAD_VLLM_ENV", raising=False)
    assert check_image.vllm_to_check(check_image.parse_args([])) is None
    assert check_image.vllm_to_check(check_image.parse_args(["--vllm-env", str(broken)])) == broken
    monkeypatch.setenv("QAD_VLLM_ENV", str(missing))
    assert check_image.vllm_to_check(check_image.parse_args([])) == missing


@pytest.mark.slow
def test_the_image_check_passes_on_the_vllm_environment_of_setup_vllm(check_image):
    """The environment `qad-pipeline setup-vllm` made (the README's test command makes it) imports vLLM."""
    from qad_pipeline.checks.vllm_setup import vllm_env

    assert check_image.vllm_failures(vllm_env()) == []
