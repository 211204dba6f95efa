"""Rendering infra/k8s/ as a cluster would get it, for the tests/test_infra_*.py checks: the overlays
built by `kubectl kustomize` (or `kustomize build`), each pool's base job template as the worker's
init container makes it (infra/k8s/base/sync_work_pool.py, run on the rendered ConfigMaps), and the
Job a worker would submit from it (prefect-kubernetes' own `KubernetesWorkerJobConfiguration`).
No cluster and no network: without kubectl or kustomize, or prefect-kubernetes, the checks skip."""

from __future__ import annotations

import asyncio
import copy
import functools
import importlib.util
import json
import re
import shutil
import subprocess
import uuid
from pathlib import Path

import pytest
import yaml

from tests.infra_files import BASE, NEEDS_PREFECT_KUBERNETES, OVERLAYS

KUBERNETES_VERSION = "1.32"  # the schemas kubernetes-validate checks against (kubectl here is 1.32)
API_URL = "http://prefect-server.qad.svc:4200/api"


def kustomize_command() -> list[str]:
    if shutil.which("kubectl"):
        return ["kubectl", "kustomize"]
    if shutil.which("kustomize"):
        return ["kustomize", "build"]
    pytest.skip("neither kubectl nor kustomize is installed: the overlays of infra/k8s/ are not rendered")


def build(path: Path) -> tuple[dict, ...]:
    """The objects `kubectl kustomize <path>` renders; a failing build fails with kustomize's message."""
    done = subprocess.run([*kustomize_command(), str(path)], capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, f"kustomize {path}: {done.stderr.strip()}"
    return tuple(doc for doc in yaml.safe_load_all(done.stdout) if doc)


@functools.cache
def rendered(overlay: str) -> tuple[dict, ...]:
    return build(OVERLAYS[overlay])


def find(objs, kind: str, name: str) -> dict:
    """The object of that kind and name; a generated one is found by its name without the hash suffix."""
    pattern = re.compile(rf"{re.escape(name)}(-[a-z0-9]{{10}})?")
    found = [o for o in objs if o["kind"] == kind and pattern.fullmatch(o["metadata"]["name"])]
    assert len(found) == 1, f"{kind} {name}: {len(found)} rendered"
    return found[0]


def pod_templates(objs) -> dict[str, dict]:
    """`<Kind>/<name>` -> pod spec of every workload."""
    return {f"{o['kind']}/{o['metadata']['name']}": o["spec"]["template"]["spec"]
            for o in objs if o["kind"] in ("Deployment", "StatefulSet", "DaemonSet", "Job")}


def containers(spec: dict) -> list[dict]:
    return spec.get("initContainers", []) + spec["containers"]


@functools.cache
def sync_script():
    """infra/k8s/base/sync_work_pool.py, imported as the init container runs it."""
    spec = importlib.util.spec_from_file_location("sync_work_pool", BASE / "sync_work_pool.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def workers(objs) -> dict[str, dict]:
    """pool -> the worker Deployment whose init container syncs that pool."""
    out = {}
    for obj in objs:
        if obj["kind"] == "Deployment":
            for init in obj["spec"]["template"]["spec"].get("initContainers", []):
                if init["name"] == "work-pool":
                    out[init["command"][2]] = obj
    return out


def pool_template(objs, pool: str) -> dict:
    """The base job template the worker's init container writes for `pool`, from the rendered
    ConfigMaps it mounts, in the worker's namespace (its POD_NAMESPACE)."""
    worker = workers(objs)[pool]
    spec = worker["spec"]["template"]["spec"]
    (init,) = [c for c in spec["initContainers"] if c["name"] == "work-pool"]
    script, _, template_path, values_dir = init["command"][1:]
    mounts = {m["mountPath"]: m["name"] for m in init["volumeMounts"]}
    volumes = {v["name"]: v["configMap"]["name"] for v in spec["volumes"] if "configMap" in v}

    def mounted(path: str) -> dict:
        folder = str(Path(path).parent) if path != values_dir else path
        name = volumes[mounts[folder]]
        return next(o for o in objs if o["kind"] == "ConfigMap" and o["metadata"]["name"] == name)["data"]

    files = mounted(template_path)
    assert Path(script).name in mounted(script), f"{pool}: {script} is not in the mounted ConfigMap"
    template = json.loads(files[Path(template_path).name])
    return sync_script().with_values(template, mounted(values_dir), worker["metadata"]["namespace"])


def render_job(template: dict, values: dict | None = None, auth_string: str | None = None) -> dict:
    """The Job manifest prefect-kubernetes would submit for a flow run of a deployment with these job
    variables, from a worker with PREFECT_API_URL (and PREFECT_API_AUTH_STRING when given) set."""
    if importlib.util.find_spec("prefect_kubernetes") is None:
        pytest.skip(NEEDS_PREFECT_KUBERNETES)
    from prefect.client.schemas.objects import FlowRun
    from prefect.settings import PREFECT_API_AUTH_STRING, PREFECT_API_URL, temporary_settings
    from prefect_kubernetes.worker import KubernetesWorkerJobConfiguration

    class NoApi:
        """Stands in for the API client: the templates hold no block or variable references."""

    async def build_config():
        return await KubernetesWorkerJobConfiguration.from_template_and_values(
            copy.deepcopy(template), values or {}, client=NoApi()
        )

    settings = {PREFECT_API_URL: API_URL, **({PREFECT_API_AUTH_STRING: auth_string} if auth_string else {})}
    with temporary_settings(settings):
        config = asyncio.run(build_config())
        config.prepare_for_flow_run(FlowRun(id=uuid.uuid4(), name="brave-otter", flow_id=uuid.uuid4()))
    return config.job_manifest
