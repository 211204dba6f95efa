"""Offline checks of the Kustomize overlays (infra/k8s/overlays/*): each renders with `kubectl kustomize`,
every object is valid for Kubernetes 1.32 (kubernetes-validate, strict: no unknown field), and what an
overlay sets arrives where it is used: the image in every pool's Jobs (through the worker's init
container, sync_work_pool.py) and nowhere the old one, the namespace on every object and Job, each
Secret in the pods that need it and no other (the optional MLflow credentials in the flow-run Jobs
only), GPU Jobs on GPU nodes, and the trial's Prefect server keeping its leases on disk."""

from __future__ import annotations

import asyncio
import json
import os
import re
import types

import pytest
import yaml

from tests.infra_files import GPU, K8S, OVERLAYS, WORKER_REQUIRED_EXTRAS
from tests.infra_kustomize import (KUBERNETES_VERSION, build, containers, find, pod_templates, pool_template,
                                   render_job, rendered, sync_script, workers)

EXPECTED = {  # what each overlay's kustomization.yaml sets
    "external": {"namespace": "qad", "image": "registry.example.com/ml/qad-pipeline:v1", "storage_class": "nfs-rwx",
                 "gpu_memory_request": "200Gi", "gpu_limit": "16"},
    "trial": {"namespace": "qad-trial", "image": "registry.example.com/ml/qad-pipeline:v1",
              "storage_class": "standard-rwx", "gpu_memory_request": "32Gi", "gpu_limit": "2"},
}
POOLS = ("qad-gpu", "qad-control")
PREFECT_AUTH, HF, OBJECT_STORE, POSTGRES = "qad-prefect-auth", "qad-hf", "qad-object-store", "qad-postgres"
MLFLOW_AUTH = "qad-mlflow-auth"
# Which pods may see which Secret (every container of the pod, init containers included). The workers
# and their init containers talk to Prefect only, never to MLflow: no MLflow credentials there.
SECRETS_OF = {
    "Deployment/prefect-worker-gpu": {PREFECT_AUTH},
    "Deployment/prefect-worker-control": {PREFECT_AUTH},
    "job/qad-gpu": {HF, OBJECT_STORE, PREFECT_AUTH, MLFLOW_AUTH},  # flow-run Jobs: the hub, DVC's remote, Prefect, MLflow
    "job/qad-control": {HF, OBJECT_STORE, PREFECT_AUTH, MLFLOW_AUTH},
    "StatefulSet/postgres": {POSTGRES},
    "StatefulSet/minio": {OBJECT_STORE},  # its root user is the object-store key
    "Deployment/mlflow": {POSTGRES, OBJECT_STORE},
    "Deployment/prefect-server": {POSTGRES, PREFECT_AUTH},
}
# Secrets every pod starts without (an MLflow server that checks no credentials): each reference optional.
OPTIONAL = {MLFLOW_AUTH}
MLFLOW_AUTH_ENV = {"MLFLOW_TRACKING_USERNAME": "username", "MLFLOW_TRACKING_PASSWORD": "password"}
SECRET_ENV = re.compile(r"(PASSWORD|TOKEN|SECRET_ACCESS_KEY|ACCESS_KEY_ID|AUTH_STRING)$")


def flow_run_job(overlay: str, pool: str) -> dict:
    """The Job the overlay's worker submits for a flow run of `pool`, after the worker replaced its
    auth string by a reference to its Secret (prefect-kubernetes' own step, from the worker's settings)."""
    objs = rendered(overlay)
    job = render_job(pool_template(objs, pool), auth_string="qad:secret")  # skips without prefect-kubernetes
    from prefect_kubernetes.settings import KubernetesSettings
    from prefect_kubernetes.worker import KubernetesWorker

    (worker,) = workers(objs)[pool]["spec"]["template"]["spec"]["containers"]
    plain = {e["name"]: e["value"] for e in worker["env"] if "value" in e}
    saved = dict(os.environ)
    try:
        os.environ.update(plain)
        settings = KubernetesSettings().worker
    finally:
        os.environ.clear()
        os.environ.update(saved)
    assert settings.api_auth_string_secret_name and settings.api_auth_string_secret_key, (
        f"{pool} worker: without the Secret's name and key, prefect-kubernetes writes the auth string into the Job")
    asyncio.run(KubernetesWorker._replace_env_variable_with_secret(
        None, "PREFECT_API_AUTH_STRING", types.SimpleNamespace(job_manifest=job),
        settings.api_auth_string_secret_name, settings.api_auth_string_secret_key))
    return job


def secret_refs(spec: dict) -> list[tuple[str, dict]]:
    """(Secret name, the reference) for every volume, envFrom and env entry of the pod naming a Secret."""
    refs = [(v["secret"]["secretName"], v["secret"]) for v in spec.get("volumes", []) if "secret" in v]
    for container in containers(spec):
        refs += [(e["secretRef"]["name"], e["secretRef"]) for e in container.get("envFrom", []) if "secretRef" in e]
        refs += [(e["valueFrom"]["secretKeyRef"]["name"], e["valueFrom"]["secretKeyRef"]) for e in container.get("env", [])
                 if "secretKeyRef" in e.get("valueFrom", {})]
    return refs


def secrets_used(spec: dict) -> set[str]:
    return {name for name, _ in secret_refs(spec)}


# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("overlay", sorted(OVERLAYS))
def test_overlay_objects_are_valid_kubernetes_objects(overlay):
    kubernetes_validate = pytest.importorskip(
        "kubernetes_validate", reason="kubernetes-validate is not installed (the test extra): the overlays are not validated")

    objs = rendered(overlay)
    jobs = [flow_run_job(overlay, pool) for pool in POOLS]
    for job in jobs:  # prefect-kubernetes needs these two in the pod spec; the API server drops them
        spec = job["spec"]["template"]["spec"]
        assert {f"spec.template.spec.{k}" for k in ("parallelism", "completions") if k in spec} == WORKER_REQUIRED_EXTRAS
        del spec["parallelism"], spec["completions"]
    for obj in (*objs, *jobs):
        try:
            kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)
        except kubernetes_validate.ValidationError as err:
            raise AssertionError(f"{overlay}: {obj['kind']} {obj['metadata'].get('name')}: "
                                 f"{'.'.join(map(str, err.path))}: {err.message}") from None


@pytest.mark.parametrize("overlay", sorted(OVERLAYS))
def test_overlay_image_and_namespace_reach_every_pod_and_job(overlay):
    objs, want = rendered(overlay), EXPECTED[overlay]
    # The base's image is left nowhere: not in any object, not in the templates the pools get. (The
    # raw JSON files in qad-work-pools keep it: they are the init container's input, overridden.)
    raw = find(objs, "ConfigMap", "qad-work-pools")
    text = yaml.safe_dump_all([o for o in objs if o is not raw] + [pool_template(objs, p) for p in POOLS])
    assert "qad-pipeline:latest" not in text, f"{overlay}: the base's image is left somewhere"
    assert f"image: {want['image']}" in text
    (namespace,) = [o["metadata"]["name"] for o in objs if o["kind"] == "Namespace"]
    assert namespace == want["namespace"]
    for obj in objs:
        if obj["kind"] != "Namespace":
            assert obj["metadata"]["namespace"] == namespace, f"{obj['kind']} {obj['metadata']['name']}"
        for subject in obj.get("subjects", []):
            assert subject["namespace"] == namespace
    for pool in POOLS:
        job = flow_run_job(overlay, pool)
        assert job["metadata"]["namespace"] == namespace
        assert {c["image"] for c in job["spec"]["template"]["spec"]["containers"]} == {want["image"]}
    # The workers' observer watches their own namespace (the Role is namespaced).
    for worker in workers(objs).values():
        for container in containers(worker["spec"]["template"]["spec"]):
            refs = {e["name"]: e["valueFrom"]["fieldRef"]["fieldPath"] for e in container["env"]
                    if "fieldRef" in e.get("valueFrom", {})}
            assert refs.get("POD_NAMESPACE" if container["name"] == "work-pool"
                            else "PREFECT_INTEGRATIONS_KUBERNETES_OBSERVER_NAMESPACES") == "metadata.namespace"
    claim = find(objs, "PersistentVolumeClaim", "qad-workspace")
    assert claim["spec"]["storageClassName"] == want["storage_class"]
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]
    (gpu_worker,) = workers(objs)["qad-gpu"]["spec"]["template"]["spec"]["containers"]
    assert {e["name"]: e.get("value") for e in gpu_worker["env"]}["QAD_WORKER_LIMIT"] == want["gpu_limit"]


@pytest.mark.parametrize("overlay", sorted(OVERLAYS))
def test_secrets_reach_only_the_pods_that_need_them(overlay):
    objs = rendered(overlay)
    pods = {**pod_templates(objs), **{f"job/{p}": flow_run_job(overlay, p)["spec"]["template"]["spec"] for p in POOLS}}
    for name, spec in pods.items():
        assert name in SECRETS_OF, f"{overlay}: {name} is not in this test's table of who gets which Secret"
        assert secrets_used(spec) == SECRETS_OF[name], f"{overlay}: {name} gets {sorted(secrets_used(spec))}"
        for secret, ref in secret_refs(spec):
            assert secret not in OPTIONAL or ref.get("optional") is True, f"{overlay}: {name}: {secret} is not optional"
        if MLFLOW_AUTH in SECRETS_OF[name]:  # as the variables MLflow's client reads (tests/test_tracking_store.py)
            mlflow_env = {e["name"]: e["valueFrom"]["secretKeyRef"]["key"] for c in containers(spec) for e in c.get("env", [])
                          if e.get("valueFrom", {}).get("secretKeyRef", {}).get("name") == MLFLOW_AUTH}
            assert mlflow_env == MLFLOW_AUTH_ENV, f"{overlay}: {name}: {mlflow_env}"
        for container in containers(spec):  # a secret's value is never written into a manifest
            for env in container.get("env", []):
                if SECRET_ENV.search(env["name"]):
                    assert "secretKeyRef" in env.get("valueFrom", {}), f"{overlay}: {name} {env['name']} is not a reference"
    generated = {o["metadata"]["name"] for o in objs if o["kind"] == "Secret"}
    if overlay == "trial":  # placeholders, generated for the trial; referenced names exist
        assert generated == {PREFECT_AUTH, HF, OBJECT_STORE, POSTGRES}
        for secret in objs:
            if secret["kind"] == "Secret":
                keys = set(secret["data"])
                used = {e["valueFrom"]["secretKeyRef"]["key"] for spec in pods.values() for c in containers(spec)
                        for e in c.get("env", []) if e.get("valueFrom", {}).get("secretKeyRef", {}).get("name")
                        == secret["metadata"]["name"]}
                assert used <= keys, f"{secret['metadata']['name']} lacks {sorted(used - keys)}"
    else:  # the platform's own Secrets: none generated, so none is kept in git
        assert not generated
    readme = (K8S.parent / "README.md").read_text()
    for secret in {s for names in SECRETS_OF.values() for s in names}:
        assert secret in readme, f"infra/README.md does not say where the Secret {secret} goes"


@pytest.mark.parametrize("overlay", sorted(OVERLAYS))
def test_gpu_jobs_run_on_gpu_nodes_with_the_overlays_sizes(overlay):
    gpu = flow_run_job(overlay, "qad-gpu")["spec"]["template"]["spec"]
    (container,) = gpu["containers"]
    assert container["resources"]["limits"][GPU] == container["resources"]["requests"][GPU] == 1  # the job variable gpus
    assert container["resources"]["requests"]["memory"] == EXPECTED[overlay]["gpu_memory_request"]
    assert gpu["nodeSelector"]["nvidia.com/gpu.present"] == "true"
    assert {"key": GPU, "operator": "Exists", "effect": "NoSchedule"} in gpu["tolerations"]
    control = flow_run_job(overlay, "qad-control")["spec"]["template"]["spec"]
    assert GPU not in json.dumps(control) and not control.get("nodeSelector") and not control.get("tolerations")


def test_trial_prefect_server_keeps_leases_on_disk():
    objs = rendered("trial")
    spec = find(objs, "Deployment", "prefect-server")["spec"]["template"]["spec"]
    (container,) = spec["containers"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["PREFECT_SERVER_CONCURRENCY_LEASE_STORAGE"] == "prefect.server.concurrency.lease_storage.filesystem"
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    claims = {v["name"]: v["persistentVolumeClaim"]["claimName"] for v in spec["volumes"] if "persistentVolumeClaim" in v}
    assert claims[mounts[env["PREFECT_HOME"]]] == "prefect-home", "the leases live under PREFECT_HOME, on a volume"
    assert find(objs, "Deployment", "prefect-server")["spec"]["strategy"]["type"] == "Recreate"
    from prefect.settings import Settings

    assert Settings(server={"concurrency": {"lease_storage": env["PREFECT_SERVER_CONCURRENCY_LEASE_STORAGE"]}})
    # The services the ConfigMap points the pods at are this overlay's.
    config = find(objs, "ConfigMap", "qad-config")["data"]
    for key, service in (("PREFECT_API_URL", "prefect-server"), ("MLFLOW_TRACKING_URI", "mlflow")):
        host, port = re.match(r"http://([\w-]+):(\d+)", config[key]).groups()
        ports = {p["port"] for p in find(objs, "Service", host)["spec"]["ports"]}
        assert host == service and int(port) in ports, f"{key}={config[key]}"


def with_component(tmp_path, component: str) -> tuple[dict, ...]:
    """The external overlay with infra/k8s/components/<component> added (as a user adds it), rendered."""
    overlay = tmp_path / f"with-{component}"
    overlay.mkdir()
    rel = os.path.relpath(K8S, overlay)
    text = (OVERLAYS["external"] / "kustomization.yaml").read_text()
    overlay.joinpath("kustomization.yaml").write_text(
        text.replace("  - ../../base\n", f"  - {rel}/base\ncomponents:\n  - {rel}/components/{component}\n"))
    return build(overlay)


def test_gpu_pool_component_adds_a_pool_with_more_gpus(tmp_path):
    """An overlay with components/gpu-pool-4 (as a user adds it): a third worker and pool whose Jobs
    may ask for up to 4 GPUs, with the overlay's image and the MLflow credentials' Secret; qad-gpu's
    nodes have 8."""
    objs = with_component(tmp_path, "gpu-pool-4")
    assert set(workers(objs)) == {"qad-gpu", "qad-control", "qad-gpu-4"}
    assert pool_template(objs, "qad-gpu-4")["variables"]["properties"]["gpus"]["maximum"] == 4
    assert pool_template(objs, "qad-gpu")["variables"]["properties"]["gpus"]["maximum"] == 8
    job = render_job(pool_template(objs, "qad-gpu-4"), {"gpus": 4})
    (container,) = job["spec"]["template"]["spec"]["containers"]
    assert str(container["resources"]["limits"][GPU]) == str(container["resources"]["requests"][GPU]) == "4"
    assert container["image"] == EXPECTED["external"]["image"]
    assert job["spec"]["template"]["spec"]["nodeSelector"]["nvidia.com/gpu.present"] == "true"
    (one,) = render_job(pool_template(objs, "qad-gpu"))["spec"]["template"]["spec"]["containers"]
    assert str(one["resources"]["limits"][GPU]) == "1", "a flow run that asks for nothing gets one GPU"
    # its Jobs get MLflow's credentials like every pool's; its worker does not
    assert MLFLOW_AUTH in secrets_used(job["spec"]["template"]["spec"])
    assert secrets_used(workers(objs)["qad-gpu-4"]["spec"]["template"]["spec"]) == SECRETS_OF["Deployment/prefect-worker-gpu"]


def test_multinode_qad_component_lets_the_qad_pod_launch_its_trainjob(tmp_path):
    """components/multinode-qad: the flow-run pods' identity may create, follow and delete TrainJobs
    (and nothing more), with a token; the job's image in qad-config is the overlay's."""
    objs = with_component(tmp_path, "multinode-qad")
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    for obj in objs:
        kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)
    from qad_pipeline.training.trainjob import cluster_from_env

    config = find(objs, "ConfigMap", "qad-config")["data"]
    cluster = cluster_from_env({**config, "QAD_TRAINJOB_NAMESPACE": "qad"})
    assert cluster.image == EXPECTED["external"]["image"] and cluster.runtime == "torch-distributed"
    assert find(objs, "ServiceAccount", "qad-job")["automountServiceAccountToken"] is True
    (rule,) = find(objs, "Role", "qad-trainjob-launcher")["rules"]
    assert (rule["apiGroups"], rule["resources"], set(rule["verbs"])) == (
        ["trainer.kubeflow.org"], ["trainjobs"], {"create", "get", "delete"})
    binding = find(objs, "RoleBinding", "qad-trainjob-launcher")
    assert binding["subjects"][0]["name"] == "qad-job" and binding["roleRef"]["name"] == "qad-trainjob-launcher"


@pytest.mark.parametrize("values, error", [
    ({"memroy_request": "8Gi"}, "'memroy_request' is not a job variable of this template (valid: active_deadline_seconds, "),
    ({"node_selector": "{gpu: yes"}, "node_selector: '{gpu: yes' is not JSON"),
    ({"tolerations": '{"key": "x"}'}, "tolerations: {'key': 'x'} is not of type 'array'"),
    ({"gpus": "0"}, "gpus: '0' is not a GPU count"),
])
def test_sync_work_pool_refuses_bad_values(values, error):
    from tests.infra_files import template

    with pytest.raises(ValueError) as err:
        sync_script().with_values(template("qad-gpu"), values)
    assert str(err.value).startswith(error), err.value
    with pytest.raises(ValueError, match="requests no GPU"):
        sync_script().with_values(template("qad-control"), {"gpus": "2"})


@pytest.mark.slow
def test_sync_work_pool_against_a_prefect_server(tmp_path, monkeypatch, capsys):
    """The init container's script against a real (temporary) Prefect server: it creates the pool
    from the mounted files, updates only the template when the image changes (the pool's
    concurrency limit stays), and refuses a process pool of the same name."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolCreate, WorkPoolUpdate
    from prefect.testing.utilities import prefect_test_harness

    script, objs = sync_script(), rendered("trial")
    mount = tmp_path / "pool-values"
    mount.mkdir()
    for key, text in find(objs, "ConfigMap", "qad-pool-gpu")["data"].items():
        (mount / key).write_text(text)
    (mount / "..data").mkdir()  # what a mounted ConfigMap also holds
    template_file = tmp_path / "gpu-base-job-template.json"
    template_file.write_text(find(objs, "ConfigMap", "qad-work-pools")["data"]["gpu-base-job-template.json"])
    monkeypatch.setenv("POD_NAMESPACE", "qad-trial")
    with prefect_test_harness(server_startup_timeout=120), get_client(sync_client=True) as client:
        assert script.main(["qad-gpu", str(template_file), str(mount)]) == 0
        assert "work pool qad-gpu created" in capsys.readouterr().out
        pool = client.read_work_pool("qad-gpu")
        assert pool.type == "kubernetes" and pool.base_job_template == pool_template(objs, "qad-gpu")
        client.update_work_pool("qad-gpu", WorkPoolUpdate(concurrency_limit=3))
        assert script.sync("qad-gpu", pool.base_job_template).endswith("unchanged")

        # what the pipeline's preflight reads of the pool (qad_pipeline/plan/pools.py), and what the server
        # does with a flow run that asks for more GPUs than the pool's nodes have
        from prefect.exceptions import PrefectHTTPStatusError

        from qad_pipeline.plan import pools

        flow_id = client.create_flow_from_name("gpu-stage")
        deployment = client.create_deployment(flow_id=flow_id, name="gpu", work_pool_name="qad-gpu")
        assert pools.server_limits({"gpu-stage/gpu"}) == {"gpu-stage/gpu": 8}
        assert client.create_flow_run_from_deployment(deployment, job_variables={"gpus": 8}).id
        with pytest.raises(PrefectHTTPStatusError, match="greater than the maximum"):
            client.create_flow_run_from_deployment(deployment, job_variables={"gpus": 9})

        (mount / "image").write_text("registry.example.com/ml/qad-pipeline:v2")
        assert script.main(["qad-gpu", str(template_file), str(mount)]) == 0
        assert "base job template updated" in capsys.readouterr().out
        pool = client.read_work_pool("qad-gpu")
        assert pool.base_job_template["variables"]["properties"]["image"]["default"].endswith(":v2")
        assert pool.concurrency_limit == 3

        client.create_work_pool(WorkPoolCreate(name="qad-control", type="process"))
        assert script.main(["qad-control", str(template_file), str(mount)]) == 1
        assert "exists as a 'process' pool" in capsys.readouterr().err
