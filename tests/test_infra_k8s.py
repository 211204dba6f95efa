"""Offline checks of the Kubernetes objects both overlays render (infra/k8s/): every field a Kubernetes
API field, and the objects (namespace, service accounts, roles, ConfigMaps, volume, Secrets) fit
together with each other and with the pools' job templates."""

from __future__ import annotations

import pytest

from tests.infra_files import INFRA, OVERLAYS, QUANTITY, TEMPLATES, manifest_errors, resource_quantities
from tests.infra_kustomize import containers, find, pod_templates, pool_template, rendered, workers


@pytest.mark.parametrize("overlay", sorted(OVERLAYS))
def test_rendered_fields_are_kubernetes_fields(overlay):
    for doc in rendered(overlay):
        errors = manifest_errors(doc)
        assert not errors, f"{overlay} {doc['kind']} {doc['metadata']['name']}:\n" + "\n".join(errors)
    for name, spec in pod_templates(rendered(overlay)).items():
        for quantity, value in resource_quantities(spec):
            assert isinstance(value, str) and QUANTITY.match(value), f"{name} {quantity}: {value!r}"


def references(spec: dict) -> set[tuple[str, str]]:
    """(kind, name) of every ConfigMap, Secret, PVC and service account a pod spec names."""
    refs = {("ServiceAccount", spec.get("serviceAccountName", "default"))}
    for volume in spec.get("volumes", []):
        if "configMap" in volume:
            refs.add(("ConfigMap", volume["configMap"]["name"]))
        if "persistentVolumeClaim" in volume:
            refs.add(("PersistentVolumeClaim", volume["persistentVolumeClaim"]["claimName"]))
    for container in containers(spec):
        for source in container.get("envFrom", []):
            for key, kind in (("configMapRef", "ConfigMap"), ("secretRef", "Secret")):
                if key in source:
                    refs.add((kind, source[key]["name"]))
        for env in container.get("env", []):
            for key, kind in (("configMapKeyRef", "ConfigMap"), ("secretKeyRef", "Secret")):
                ref = env.get("valueFrom", {}).get(key)
                if ref and not ref.get("optional"):
                    refs.add((kind, ref["name"]))
    return refs


@pytest.mark.parametrize("overlay", sorted(OVERLAYS))
def test_rendered_objects_fit_together(overlay):
    objs = rendered(overlay)
    present = {(o["kind"], o["metadata"]["name"]) for o in objs}
    assert len(present) == len(objs), "an object is rendered twice"
    # The platform's Secrets (external overlay) are created by hand; infra/README.md names them all.
    readme = (INFRA / "README.md").read_text()
    pods = dict(pod_templates(objs))
    for pool in TEMPLATES:
        template = pool_template(objs, pool)
        props = template["variables"]["properties"]
        spec = template["job_configuration"]["job_manifest"]["spec"]["template"]["spec"]
        # What the pool's defaults name (the template's placeholders filled with them) exists.
        pods[f"job/{pool}"] = {
            "serviceAccountName": props["service_account_name"]["default"],
            "volumes": [{"persistentVolumeClaim": {"claimName": props["workspace_claim"]["default"]}}],
            "containers": [{"envFrom": [{"configMapRef": {"name": props["config_map_name"]["default"]}},
                                        {"secretRef": {"name": props["hf_secret_name"]["default"]}},
                                        {"secretRef": {"name": props["object_store_secret_name"]["default"]}}]}],
        }
        assert len(spec["containers"][0]["envFrom"]) == 3, f"{pool}: envFrom changed; update this test"
        claim = find(objs, "PersistentVolumeClaim", props["workspace_claim"]["default"])
        assert "ReadWriteMany" in claim["spec"]["accessModes"], "pods of both pools share the volume"
        job_sa = find(objs, "ServiceAccount", props["service_account_name"]["default"])
        assert job_sa.get("automountServiceAccountToken") is False, "flow-run pods need no Kubernetes API token"
    for name, spec in pods.items():
        for kind, ref in references(spec):
            if kind == "ServiceAccount" and ref == "default":
                continue
            if kind == "Secret" and overlay == "external":
                assert f"`{ref}`" in readme, f"{name} needs the Secret {ref}, which infra/README.md does not name"
                continue
            assert (kind, ref) in present, f"{overlay}: {name} names the {kind} {ref}, which is not rendered"

    config = find(objs, "ConfigMap", "qad-config")["data"]
    assert config["PREFECT_API_URL"].endswith("/api")
    assert config["HF_HOME"].startswith("/workspace/"), "the Hugging Face cache belongs on the shared volume"
    assert config["PREFECT_RESULTS_LOCAL_STORAGE_PATH"].startswith("/workspace/"), (
        "persisted results (the PTQ cache of a re-run) must outlive the pod")
    # The crash automation of `qad-pipeline prefect-setup` needs heartbeats, every 30 s or more.
    assert int(config["PREFECT_FLOWS_HEARTBEAT_FREQUENCY"]) >= 30

    # The workers' service account may run Jobs and follow their pods, in this namespace.
    rules = {}
    for binding in (o for o in objs if o["kind"] == "RoleBinding"):
        role = find(objs, "Role", binding["roleRef"]["name"])
        for subject in binding["subjects"]:
            for rule in role["rules"]:
                for group in rule["apiGroups"]:
                    for resource in rule["resources"]:
                        rules.setdefault((subject["name"], group, resource), set()).update(rule["verbs"])
    assert set(workers(objs)) == set(TEMPLATES)
    for pool, deployment in workers(objs).items():
        spec = deployment["spec"]["template"]["spec"]
        sa = spec["serviceAccountName"]
        assert {"create", "delete", "get", "list", "watch"} <= rules.get((sa, "batch", "jobs"), set())
        for resource in ("pods", "pods/log", "events"):
            assert {"get", "list", "watch"} <= rules.get((sa, "", resource), set()), resource
        assert deployment["spec"]["selector"]["matchLabels"].items() <= deployment["spec"]["template"]["metadata"][
            "labels"].items()
