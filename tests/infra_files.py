"""Reading infra/ as the tools that consume it do, for the tests/test_infra_*.py checks.

Nothing here needs Docker, a cluster or a network: the paths of infra/; its YAML, JSON, .env, compose
(with compose's variable interpolation) and Dockerfiles parsed; and every Kubernetes manifest checked
field by field against the Kubernetes API models of `kubernetes_asyncio` (a prefect-kubernetes
dependency) or `kubernetes`. Without prefect-kubernetes the Kubernetes checks are skipped with a
message that says so. The command lines are checked by tests/infra_commands.py.
"""

from __future__ import annotations

import functools
import importlib
import json
import re
from pathlib import Path

import pytest
import yaml
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parent.parent
INFRA = ROOT / "infra"
K8S = INFRA / "k8s"
BASE = K8S / "base"
TEMPLATES = {"qad-gpu": BASE / "gpu-base-job-template.json", "qad-control": BASE / "control-base-job-template.json"}
WORKERS = {"qad-gpu": BASE / "worker-gpu.yaml", "qad-control": BASE / "worker-control.yaml"}
OVERLAYS = {"external": K8S / "overlays" / "external", "trial": K8S / "overlays" / "trial"}
GPU = "nvidia.com/gpu"

# prefect-kubernetes refuses a job manifest without these two keys in the pod template's spec
# (KubernetesWorkerJobConfiguration._validate_job_manifest), although they are Job fields, not pod
# fields; the API server drops them with a warning. They are the only unknown fields allowed.
WORKER_REQUIRED_EXTRAS = {"spec.template.spec.parallelism", "spec.template.spec.completions"}
NEEDS_PREFECT_KUBERNETES = (
    "prefect-kubernetes is not installed (add `prefect-kubernetes>=0.8` to the test extra): "
    "the Kubernetes checks of infra/ are skipped"
)


# ---------------------------------------------------------------------------------------------
# loading


@functools.cache
def yaml_docs(path: Path) -> tuple:
    return tuple(doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None)


@functools.cache
def template(pool: str) -> dict:
    return json.loads(TEMPLATES[pool].read_text())


@functools.cache
def pyproject() -> dict:
    text = (ROOT / "pyproject.toml").read_text()
    try:
        import tomllib

        return tomllib.loads(text)
    except ModuleNotFoundError:  # Python 3.10
        import toml

        return toml.loads(text)


def requirement(name: str) -> Requirement:
    reqs = [Requirement(r) for r in pyproject()["project"]["dependencies"]]
    return next(r for r in reqs if r.name == name)


def dotenv_example() -> dict:
    return env_file(INFRA / ".env.example")


_COMPOSE_VAR = re.compile(
    r"\$\$|\$\{(?P<name>[A-Za-z_][A-Za-z0-9_]*)(?:(?P<op>:?[-?])(?P<arg>[^}]*))?\}|\$(?P<bare>[A-Za-z_][A-Za-z0-9_]*)"
)


def compose_variables(text: str) -> list[tuple[str, str | None]]:
    """(name, operator) of every ${...} in `text`."""
    return [(m["name"] or m["bare"], m["op"]) for m in _COMPOSE_VAR.finditer(text) if m[0] != "$$"]


def interpolate(value, env: dict):
    """Compose's variable interpolation (${X}, ${X:-default}, ${X-default}, ${X:?err}, $$)."""
    if isinstance(value, dict):
        return {k: interpolate(v, env) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate(v, env) for v in value]
    if not isinstance(value, str):
        return value

    def one(m: re.Match) -> str:
        if m[0] == "$$":
            return "$"
        name, op, arg = m["name"] or m["bare"], m["op"], m["arg"]
        val = env.get(name)
        if op in (":-", ":?") and not val or op in ("-", "?") and val is None:
            if op.endswith("?"):
                raise AssertionError(f"compose needs {name}: {arg}")
            return arg
        return val or ""

    return _COMPOSE_VAR.sub(one, value)


@functools.cache
def compose() -> dict:
    return interpolate(yaml_docs(INFRA / "compose.yaml")[0], dotenv_example())


@functools.cache
def dockerfile(path: Path = INFRA / "Dockerfile") -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) per instruction, continuation lines joined, comments dropped."""
    out, current = [], ""
    for line in path.read_text().splitlines():
        if not current and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if line.rstrip().endswith("\\"):
            current += line.rstrip()[:-1] + " "
            continue
        current += line
        word, _, rest = current.strip().partition(" ")
        out.append((word.upper(), rest.strip()))
        current = ""
    return out


def docker_args(path: Path = INFRA / "Dockerfile") -> dict:
    """ARG defaults of a Dockerfile."""
    args = {}
    for word, rest in dockerfile(path):
        if word == "ARG":
            name, _, default = rest.partition("=")
            args[name] = default
    return args


def container_args(container: dict) -> list[str]:
    """command + args, with the `$(VAR)` references Kubernetes fills from the container's env values."""
    env = {e["name"]: e["value"] for e in container.get("env", []) if "value" in e}
    return [re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env.get(m[1], m[0]), arg)
            for arg in container.get("command", []) + container.get("args", [])]


def worker_args(pool: str) -> list[str]:
    (deployment,) = yaml_docs(WORKERS[pool])
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    return container_args(container)


@functools.cache
def env_file(path: Path) -> dict:
    """KEY=value lines of an env file (kustomize's `envs:`, compose's `.env`), comments dropped."""
    env = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            key, _, value = line.partition("=")
            env[key.strip()] = value.strip()
    return env


# ---------------------------------------------------------------------------------------------
# Kubernetes API models


@functools.cache
def k8s_models():
    for name in ("kubernetes_asyncio.client.models", "kubernetes.client.models"):
        try:
            return importlib.import_module(name)
        except ImportError:
            continue
    pytest.skip(NEEDS_PREFECT_KUBERNETES)


_PRIMITIVES = {"str": str, "int": int, "float": (int, float), "bool": bool, "datetime": str, "date": str}


def model_errors(obj, type_name: str, path: str = "") -> list[str]:
    """Every field of `obj` that the Kubernetes model `type_name` does not have, or has another type.

    Walks the models' `attribute_map` (JSON name) and `openapi_types` recursively; required fields
    are checked by building each model, which refuses a missing one.
    """
    models = k8s_models()
    here = path or "<root>"
    if type_name.startswith("list["):
        if not isinstance(obj, list):
            return [f"{here}: a list expected, got {type(obj).__name__}"]
        return [e for i, item in enumerate(obj) for e in model_errors(item, type_name[5:-1], f"{path}[{i}]")]
    if type_name.startswith("dict("):
        value_type = type_name[5:-1].split(", ", 1)[1]
        if not isinstance(obj, dict):
            return [f"{here}: a mapping expected, got {type(obj).__name__}"]
        return [e for k, v in obj.items() for e in model_errors(v, value_type, f"{path}[{k!r}]")]
    if type_name == "object":
        return []
    if type_name in _PRIMITIVES:
        ok = isinstance(obj, _PRIMITIVES[type_name]) and not (type_name in ("int", "float") and isinstance(obj, bool))
        return [] if ok else [f"{here}: {type_name} expected, got {obj!r}"]
    cls = getattr(models, type_name)
    if not isinstance(obj, dict):
        return [f"{here}: a {type_name} mapping expected, got {obj!r}"]
    by_json = {json_name: attr for attr, json_name in cls.attribute_map.items()}
    errors, kwargs = [], {}
    for key, value in obj.items():
        sub = f"{path}.{key}" if path else key
        if key not in by_json:
            errors.append(f"{sub}: no such field in {type_name}")
            continue
        kwargs[by_json[key]] = value
        errors += model_errors(value, cls.openapi_types[by_json[key]], sub)
    try:
        cls(**kwargs)
    except ValueError as err:
        errors.append(f"{here} ({type_name}): {err}")
    return errors


def manifest_errors(doc: dict) -> list[str]:
    version = doc["apiVersion"].rsplit("/", 1)[-1]
    type_name = version[0].upper() + version[1:] + doc["kind"]
    if not hasattr(k8s_models(), type_name):
        return [f"{doc['apiVersion']} {doc['kind']}: no Kubernetes model {type_name}"]
    return model_errors(doc, type_name)


QUANTITY = re.compile(r"^[+-]?(\d+(\.\d*)?|\.\d+)([eE][+-]?\d+|[KMGTPE]i|[numkMGTPE])?$")


def resource_quantities(pod_spec: dict):
    for container in pod_spec.get("containers", []) + pod_spec.get("initContainers", []):
        for kind in ("limits", "requests"):
            for name, value in (container.get("resources", {}).get(kind) or {}).items():
                yield f"{container['name']}.{kind}.{name}", value


def pod_spec(manifest: dict) -> dict:
    return manifest["spec"]["template"]["spec"]
