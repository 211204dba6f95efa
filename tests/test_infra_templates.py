"""Offline checks of the work pools' base job templates (infra/k8s/base/*-base-job-template.json): against
Prefect's work-pool validation, JSON Schema, and prefect-kubernetes' `KubernetesWorkerJobConfiguration`,
which renders them exactly as the worker does; the rendered Jobs against the Kubernetes API models."""

from __future__ import annotations

import copy
import importlib.util
import json
import re

import jsonschema
import pytest

from tests.infra_files import (
    GPU,
    INFRA,
    NEEDS_PREFECT_KUBERNETES,
    OVERLAYS,
    ROOT,
    QUANTITY,
    TEMPLATES,
    WORKER_REQUIRED_EXTRAS,
    manifest_errors,
    pod_spec,
    env_file,
    resource_quantities,
    template,
    yaml_docs,
)
from tests.infra_kustomize import API_URL, render_job

# ---------------------------------------------------------------------------------------------
# rendering a base job template as the Kubernetes worker does


def sample_value(schema: dict):
    """A value of the schema's first non-null type (to render every optional placeholder)."""
    options = schema.get("anyOf", [schema])
    kind = next(o.get("type") for o in options if o.get("type") != "null")
    if "enum" in schema:
        return schema["enum"][-1]
    if kind == "integer" and "maximum" in schema:
        return schema["maximum"]
    return {"string": "2", "integer": 3600, "boolean": False, "object": {}, "array": []}[kind]


def render(pool: str, values: dict) -> dict:
    """The Job manifest prefect-kubernetes would submit for a flow run of a deployment on `pool`."""
    return render_job(template(pool), values)


# ---------------------------------------------------------------------------------------------
# the base job templates


@pytest.mark.parametrize("pool", sorted(TEMPLATES))
def test_base_job_template_passes_prefects_work_pool_validation(pool):
    from prefect.server.schemas.actions import WorkPoolCreate
    from prefect.utilities.templating import find_placeholders

    tpl = template(pool)
    # What the server runs on `prefect work-pool create --base-job-template`: every placeholder of the
    # job configuration must be a declared variable.
    WorkPoolCreate(name=pool, type="kubernetes", base_job_template=tpl)
    used = {p.name for p in find_placeholders(json.dumps(tpl["job_configuration"]))}
    declared = set(tpl["variables"]["properties"])
    assert used <= declared, f"undeclared variables: {sorted(used - declared)}"
    assert declared <= used, f"variables that change nothing: {sorted(declared - used)}"

    schema = tpl["variables"]
    jsonschema.validators.validator_for(schema).check_schema(schema)
    defaults = {k: v["default"] for k, v in schema["properties"].items() if "default" in v}
    jsonschema.validate(defaults, schema)  # what a deployment without job variables gets
    every = {k: sample_value(v) for k, v in schema["properties"].items()}
    jsonschema.validate(every, schema)


@pytest.mark.parametrize("pool", sorted(TEMPLATES))
def test_base_job_template_has_the_structure_of_prefect_kubernetes_default(pool):
    if importlib.util.find_spec("prefect_kubernetes") is None:
        pytest.skip(NEEDS_PREFECT_KUBERNETES)
    from prefect_kubernetes.worker import KubernetesWorker

    default = KubernetesWorker.get_default_base_job_template()
    tpl = template(pool)
    # cluster_config (kubeconfig block for an out-of-cluster worker) is left out: the workers run
    # in the cluster.
    assert set(tpl["job_configuration"]) == set(default["job_configuration"]) - {"cluster_config"}
    for name, spec in default["variables"]["properties"].items():
        if name != "cluster_config":
            assert name in tpl["variables"]["properties"], f"{pool}: the worker's variable {name!r} is missing"
            if "enum" in spec:
                assert tpl["variables"]["properties"][name]["enum"] == spec["enum"]


@pytest.mark.parametrize("pool", sorted(TEMPLATES))
@pytest.mark.parametrize("variables", ["defaults", "every variable set"])
def test_rendered_job_is_a_valid_kubernetes_job(pool, variables):
    props = template(pool)["variables"]["properties"]
    values = {} if variables == "defaults" else {k: sample_value(v) for k, v in props.items() if k != "command"}
    manifest = render(pool, values)
    # the GPU count is the integer job variable `gpus`: Kubernetes reads a number as a quantity (NVIDIA's
    # own manifests write `nvidia.com/gpu: 1`); only the Python client's model types quantities as str
    errors = [e for e in manifest_errors(manifest)
              if not re.search(r"\['nvidia.com/gpu'\]: str expected, got \d+$", e)]
    unknown = {e.split(":")[0] for e in errors if "no such field" in e}
    assert unknown == WORKER_REQUIRED_EXTRAS, errors
    assert all("no such field" in e for e in errors), errors
    for name, value in resource_quantities(pod_spec(manifest)):
        count = name.endswith(GPU) and isinstance(value, int)
        assert count or isinstance(value, str) and QUANTITY.match(value), f"{name}: {value!r} is not a Kubernetes quantity"
    container = pod_spec(manifest)["containers"][0]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["PREFECT_API_URL"] == API_URL, "the worker passes its API URL on"
    assert container["args"][:3] == ["prefect", "flow-run", "execute"]


def test_a_gpu_job_requests_the_gpus_its_flow_run_asks_for_up_to_the_pools_maximum():
    import jsonschema

    tpl = template("qad-gpu")
    raw = tpl["job_configuration"]["job_manifest"]["spec"]["template"]["spec"]["containers"]
    assert len(raw) == 1
    for kind in ("limits", "requests"):
        assert raw[0]["resources"][kind][GPU] == "{{ gpus }}", f"{kind}: the GPU count is the job variable gpus"
    variable = tpl["variables"]["properties"]["gpus"]
    assert (variable["type"], variable["default"], variable["minimum"]) == ("integer", 1, 0)
    for values, count in (({}, 1), ({"gpus": 8, "cpu_limit": "64", "memory_limit": "1Ti"}, 8), ({"gpus": 0}, 0)):
        spec = pod_spec(render("qad-gpu", values))
        limits, requests = (spec["containers"][0]["resources"][kind][GPU] for kind in ("limits", "requests"))
        assert str(limits) == str(requests) == str(count), f"GPUs of the rendered Job with {values}: {limits}, {requests}"
    # what Prefect's server checks a flow run's job variables against: more than a node's GPUs is refused
    jsonschema.validate({"gpus": variable["maximum"]}, tpl["variables"])
    with pytest.raises(jsonschema.ValidationError, match="is greater than the maximum"):
        jsonschema.validate({"gpus": variable["maximum"] + 1}, tpl["variables"])
    spec = pod_spec(render("qad-gpu", {}))
    assert spec["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert {"key": GPU, "operator": "Exists", "effect": "NoSchedule"} in spec["tolerations"]


def test_control_jobs_request_no_gpu():
    manifest = render("qad-control", {})
    assert GPU not in json.dumps(manifest)
    assert pod_spec(manifest).get("nodeSelector", {}) == {} and pod_spec(manifest).get("tolerations", []) == []


def test_the_two_templates_differ_only_in_the_gpu():
    gpu, control = copy.deepcopy(template("qad-gpu")), template("qad-control")
    container = gpu["job_configuration"]["job_manifest"]["spec"]["template"]["spec"]["containers"][0]
    for kind in ("limits", "requests"):
        del container["resources"][kind][GPU]
    assert gpu["job_configuration"] == control["job_configuration"]
    assert gpu["variables"]["properties"].keys() == control["variables"]["properties"].keys() | {"gpus"}


def test_hf_token_reaches_the_pods_from_the_secret_the_docs_create():
    """The pods' HF_TOKEN (gated models) comes from the Secret named by `hf_secret_name`: the trial
    overlay generates that Secret with the key, and the docs say how to create it under that name."""
    defaults = {template(pool)["variables"]["properties"]["hf_secret_name"]["default"] for pool in TEMPLATES}
    assert len(defaults) == 1, "both pools read the same Secret"
    (name,) = defaults
    for pool in TEMPLATES:
        (container,) = template(pool)["job_configuration"]["job_manifest"]["spec"]["template"]["spec"]["containers"]
        assert {"secretRef": {"name": "{{ hf_secret_name }}"}} in container["envFrom"], pool
    (trial,) = yaml_docs(OVERLAYS["trial"] / "kustomization.yaml")
    (generator,) = [g for g in trial["secretGenerator"] if g["name"] == name]
    assert [set(env_file(OVERLAYS["trial"] / f)) for f in generator["envs"]] == [{"HF_TOKEN"}]
    create = f"create secret generic {name} --from-literal=HF_TOKEN="
    for doc in (INFRA / "README.md", ROOT / "README.md", ROOT / "docs" / "deployments.md",
                OVERLAYS["external"] / "kustomization.yaml"):
        assert create in doc.read_text(), f"{doc} does not say how to create the Secret {name} with HF_TOKEN"
