"""Offline checks of the Kubernetes manifests (infra/k8s/base.yaml and the workers): every field a
Kubernetes API field, and the objects (namespace, service accounts, roles, ConfigMap, volume) fit together."""

from __future__ import annotations

import pytest

from tests.infra_files import (
    INFRA,
    MANIFESTS,
    QUANTITY,
    TEMPLATES,
    WORKERS,
    manifest_errors,
    resource_quantities,
    template,
    yaml_docs,
)


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_manifest_fields_are_kubernetes_fields(path):
    for doc in yaml_docs(path):
        errors = manifest_errors(doc)
        assert not errors, f"{path.name} {doc['kind']} {doc['metadata']['name']}:\n" + "\n".join(errors)
        if doc["kind"] == "Deployment":
            for name, value in resource_quantities(doc["spec"]["template"]["spec"]):
                assert isinstance(value, str) and QUANTITY.match(value), f"{name}: {value!r}"


def objects() -> dict[tuple[str, str], dict]:
    found = {}
    for path in MANIFESTS:
        for doc in yaml_docs(path):
            key = (doc["kind"], doc["metadata"]["name"])
            assert key not in found, f"{key} is declared twice"
            found[key] = doc
    return found


def test_cluster_objects_fit_together():
    objs = objects()
    namespaces = {name for kind, name in objs if kind == "Namespace"}
    assert namespaces == {"qad"}
    for (kind, name), doc in objs.items():
        if kind != "Namespace":
            assert doc["metadata"].get("namespace") == "qad", f"{kind} {name} is not in namespace qad"

    # What the templates' defaults name exists.
    for pool in TEMPLATES:
        props = template(pool)["variables"]["properties"]
        assert props["namespace"]["default"] == "qad"
        assert ("ServiceAccount", props["service_account_name"]["default"]) in objs
        assert ("ConfigMap", props["config_map_name"]["default"]) in objs
        claim = objs.get(("PersistentVolumeClaim", props["workspace_claim"]["default"]))
        assert claim and "ReadWriteMany" in claim["spec"]["accessModes"], "pods of both pools share the volume"
        secret = props["secret_name"]["default"]
        assert f"create secret generic {secret}" in (INFRA / "README.md").read_text(), (
            f"the README must say how to create the Secret {secret!r}")
    job_sa = objs[("ServiceAccount", template("qad-gpu")["variables"]["properties"]["service_account_name"]["default"])]
    assert job_sa.get("automountServiceAccountToken") is False, "flow-run pods need no Kubernetes API token"

    config = objs[("ConfigMap", "qad-config")]["data"]
    assert config["PREFECT_API_URL"].endswith("/api")
    assert config["HF_HOME"].startswith("/workspace/"), "the Hugging Face cache belongs on the shared volume"
    assert config["PREFECT_RESULTS_LOCAL_STORAGE_PATH"].startswith("/workspace/"), (
        "persisted results (the PTQ cache of a re-run) must outlive the pod")
    # The crash automation of `qad-pipeline prefect-setup` needs heartbeats, every 30 s or more.
    assert int(config["PREFECT_FLOWS_HEARTBEAT_FREQUENCY"]) >= 30

    # The workers' service account may run Jobs and follow their pods, in this namespace.
    rules = {}
    for binding in (d for (k, _), d in objs.items() if k == "RoleBinding"):
        role = objs[("Role", binding["roleRef"]["name"])]
        for subject in binding["subjects"]:
            for rule in role["rules"]:
                for group in rule["apiGroups"]:
                    for resource in rule["resources"]:
                        rules.setdefault((subject["name"], group, resource), set()).update(rule["verbs"])
    for pool, path in WORKERS.items():
        (deployment,) = yaml_docs(path)
        spec = deployment["spec"]["template"]["spec"]
        sa = spec["serviceAccountName"]
        assert ("ServiceAccount", sa) in objs
        assert {"create", "delete", "get", "list", "watch"} <= rules.get((sa, "batch", "jobs"), set())
        for resource in ("pods", "pods/log", "events"):
            assert {"get", "list", "watch"} <= rules.get((sa, "", resource), set()), resource
        (container,) = spec["containers"]
        env = {e["name"]: e for e in container["env"]}
        ref = env["PREFECT_API_URL"]["valueFrom"]["configMapKeyRef"]
        assert ref["key"] in objs[("ConfigMap", ref["name"])]["data"]
        # A namespaced Role needs a namespaced observer; cluster-wide it would need a ClusterRole.
        assert env["PREFECT_INTEGRATIONS_KUBERNETES_OBSERVER_NAMESPACES"]["value"] == "qad"
        assert deployment["spec"]["selector"]["matchLabels"].items() <= deployment["spec"]["template"]["metadata"][
            "labels"].items()
