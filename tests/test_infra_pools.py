"""Offline checks of the workers, the work pools and prefect.yaml's deployments: each worker polls its
pool, each deployment runs on the pool infra/ gives it, its entrypoint loads the imported flow, and its
outputs land on the shared volume."""

from __future__ import annotations

import ast
import importlib
import itertools
import re
from pathlib import Path

import jsonschema
import pytest
import yaml

from qad_pipeline.core.code_deps import module_file
from tests.infra_commands import check_command
from tests.infra_files import ROOT, TEMPLATES, WORKERS, dockerfile, template, worker_args, yaml_docs

# The deployments of prefect.yaml (the table of deployments in docs/deployments.md) and the pool each must run on.
DEPLOYMENT_POOLS = {
    "qad-pipeline/default": "qad-control",
    "bpe-sweep/default": "qad-control",
    "ptq-recipe/gpu": "qad-gpu",
    "gpu-stage/gpu": "qad-gpu",
    "watch-base-checkpoints/cron": "qad-control",
}


@pytest.mark.parametrize("pool", sorted(WORKERS))
def test_workers_poll_their_pool(pool):
    args = worker_args(pool)
    assert check_command(args, WORKERS[pool].name)
    assert args[:3] == ["prefect", "worker", "start"]
    option = dict(itertools.pairwise(args))
    assert option["--pool"] == pool and option["--type"] == "kubernetes"
    assert int(option["--limit"]) >= 1, "a worker without --limit would start every queued run at once"
    assert "--no-create-pool-if-not-found" in args, "a worker must not create its pool with the default template"
    (deployment,) = yaml_docs(WORKERS[pool])
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    if "--with-healthcheck" in args:
        probe = container["livenessProbe"]["httpGet"]
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        assert probe["path"] == "/health" and ports.get(probe["port"], probe["port"]) == 8080  # Prefect's default
    assert deployment["spec"]["replicas"] == 1, "each replica applies its own --limit"


def entrypoint_source(entrypoint: str) -> tuple[Path, str]:
    """The source file and function name of a prefect.yaml entrypoint `package.module:function`."""
    module, _, function = entrypoint.partition(":")
    assert not module.endswith(".py") and "/" not in module, (
        f"prefect.yaml entrypoint {entrypoint}: a file path loads a second copy of the flow's module; "
        "name it by module path (flows.pipeline:qad_pipeline)")
    return module_file(module), function


def flow_name(entrypoint: str) -> str:
    """The @flow(name=...) of a prefect.yaml entrypoint `package.module:function`."""
    file, function = entrypoint_source(entrypoint)
    for node in ast.walk(ast.parse(file.read_text())):
        if isinstance(node, ast.FunctionDef) and node.name == function:
            for dec in node.decorator_list:
                if isinstance(dec, ast.Call) and getattr(dec.func, "id", getattr(dec.func, "attr", "")) == "flow":
                    for kw in dec.keywords:
                        if kw.arg == "name":
                            value = kw.value
                            if isinstance(value, ast.Name):  # name=FLOW_NAME, a module constant
                                value = next(n.value for n in ast.parse(file.read_text()).body
                                             if isinstance(n, ast.Assign) and getattr(n.targets[0], "id", "") == value.id)
                            return value.value
            return function.replace("_", "-")
    raise AssertionError(f"prefect.yaml entrypoint {entrypoint}: no function {function} in {file}")


def test_pools_match_prefect_yaml():
    path = ROOT / "prefect.yaml"
    assert path.is_file(), "prefect.yaml is missing: the deployments' work pools cannot be checked against infra/"
    declared = yaml.safe_load(path.read_text()) or {}
    found = {}
    for dep in declared.get("deployments") or []:
        pool = (dep.get("work_pool") or {}).get("name")
        full = f"{flow_name(dep['entrypoint'])}/{dep['name']}"
        found[full] = pool
        assert pool in TEMPLATES, f"prefect.yaml: {full} runs on {pool!r}; infra/ has pools {sorted(TEMPLATES)}"
        # Job variables must be variables of the pool's template, with valid values.
        job_variables = (dep.get("work_pool") or {}).get("job_variables") or {}
        props = template(pool)["variables"]["properties"]
        unknown = set(job_variables) - set(props)
        assert not unknown, f"prefect.yaml: {full} sets job variables its pool lacks: {sorted(unknown)}"
        merged = {k: v["default"] for k, v in props.items() if "default" in v} | job_variables
        jsonschema.validate(merged, template(pool)["variables"])
    for full, pool in DEPLOYMENT_POOLS.items():
        assert found.get(full) == pool, f"prefect.yaml: {full} should run on {pool}, found {found.get(full)!r}"


def test_prefect_yaml_entrypoints_load_the_imported_flows():
    """What a worker and `prefect deploy` load (`load_flow_from_entrypoint`) is the flow object of the
    imported module, so a process holds one copy of each flow module (a file path would load another)."""
    from prefect.flows import load_flow_from_entrypoint

    for dep in yaml.safe_load((ROOT / "prefect.yaml").read_text())["deployments"]:
        module, _, function = dep["entrypoint"].partition(":")
        loaded = load_flow_from_entrypoint(dep["entrypoint"], use_placeholder_flow=False)
        assert loaded is getattr(importlib.import_module(module), function), dep["entrypoint"]
        assert loaded.name == flow_name(dep["entrypoint"])


def test_the_docs_list_every_deployment_of_prefect_yaml():
    """docs/deployments.md's table of deployments: one row per deployment of prefect.yaml, on its pool, and the count."""
    declared = {f"{flow_name(d['entrypoint'])}/{d['name']}": d["work_pool"]["name"]
                for d in yaml.safe_load((ROOT / "prefect.yaml").read_text())["deployments"]}
    text = (ROOT / "docs" / "deployments.md").read_text()
    section = text[:text.index("\n## ")]  # the page up to its first subsection (The schedule)
    rows = dict(re.findall(r"^\| `([\w-]+/[\w-]+)` \| `([\w-]+)` \|", section, re.MULTILINE))
    assert rows == declared, f"docs/deployments.md's deployments {rows} != prefect.yaml's {declared}"
    words = {3: "three", 4: "four", 5: "five", 6: "six", 7: "seven"}
    assert f"declares {words.get(len(declared), len(declared))} deployments" in section


def flow_defaults(entrypoint: str) -> dict:
    """The literal parameter defaults of a prefect.yaml entrypoint's flow function."""
    file, function = entrypoint_source(entrypoint)
    for node in ast.walk(ast.parse(file.read_text())):
        if isinstance(node, ast.FunctionDef) and node.name == function:
            args = node.args
            pairs = list(zip(args.args[len(args.args) - len(args.defaults):], args.defaults))
            pairs += [(a, d) for a, d in zip(args.kwonlyargs, args.kw_defaults) if d is not None]
            defaults = {}
            for arg, default in pairs:
                try:
                    defaults[arg.arg] = ast.literal_eval(default)
                except ValueError:
                    pass
            return defaults
    raise AssertionError(f"{entrypoint}: no function {function} in {file}")


def shared_mounts(pool: str) -> dict[str, str]:
    """mountPath -> subPath ("" for all of it) of the pool's shared volume in its Jobs."""
    spec = template(pool)["job_configuration"]["job_manifest"]["spec"]["template"]["spec"]
    shared = {v["name"] for v in spec["volumes"] if "persistentVolumeClaim" in v}
    (container,) = spec["containers"]
    return {m["mountPath"]: m.get("subPath", "") for m in container["volumeMounts"] if m["name"] in shared}


def test_flow_outputs_land_on_the_shared_volume():
    workdir = next(rest for word, rest in dockerfile() if word == "WORKDIR")
    for pool in TEMPLATES:
        mounts = shared_mounts(pool)
        assert mounts.get("/workspace") == "", f"{pool}: the whole volume belongs at /workspace"
        for path, sub in mounts.items():
            assert not sub or path == f"{workdir}/{sub}", f"{pool}: {sub}/ should be mounted at {workdir}/{sub}"

    def on_volume(pool: str, path: str) -> bool:
        full = Path(path) if path.startswith("/") else Path(workdir) / path
        return any(full == Path(m) or Path(m) in full.parents for m in shared_mounts(pool) if m != workdir)

    for pool in TEMPLATES:  # out_root's default for the image's params files (layout.output_root): shared
        assert on_volume(pool, "runs/params/artifacts/calibration")
        assert on_volume(pool, "runs/params/metrics/baseline.json")
    path = ROOT / "prefect.yaml"
    assert path.is_file(), "prefect.yaml is missing: the deployments' paths cannot be checked"
    for dep in (yaml.safe_load(path.read_text()) or {}).get("deployments") or []:
        pool = (dep.get("work_pool") or {}).get("name")
        values = flow_defaults(dep["entrypoint"]) | (dep.get("parameters") or {})
        paths = [(key, values.get(key)) for key in ("out_root", "state_file", "runs_root", "watch_dir")]
        paths += [("sources[].watch_dir", source.get("watch_dir")) for source in values.get("sources") or []]
        for key, value in paths:
            if isinstance(value, str):
                assert on_volume(pool, value), (
                    f"prefect.yaml {dep['name']}: {key}={value!r} is not on the shared volume in {pool}'s pods")
        for source in values.get("sources") or []:  # resolved in the image's working directory, on every pod
            params_file = source.get("params_file", "params.yaml")
            assert params_file.startswith("/") or (ROOT / params_file).is_file(), (
                f"prefect.yaml {dep['name']}: params_file {params_file!r} is not in the image's working directory")
