"""Offline checks of infra/ (no Docker, cluster or network): every file parses; the image builds the
project on a CUDA PyTorch; the Prefect and MLflow versions agree across the image, compose and workers."""

from __future__ import annotations

import json
import re
import shlex

import yaml
from packaging.version import Version

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
    missing = {n for n in needed if not any(n == c or n.startswith(c + "/") for c in copied)}
    assert not missing, f"not copied into the image: {sorted(missing)}"
    users = [rest for word, rest in instructions if word == "USER"]
    assert users and users[-1] not in ("root", "0"), "run as a non-root user"
    ignore = (INFRA / "Dockerfile.dockerignore").read_text().split()
    assert {".git", ".venv"} <= set(ignore)
