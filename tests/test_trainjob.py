"""The multi-node QAD job (qad_pipeline/training/trainjob.py) and torchrun's rendezvous options, offline.

The TrainJob is validated against Kubeflow Trainer's own API models (the `kubeflow-trainer-api`
package, v1alpha1): it must parse, and parse back to itself, so a misspelt or misplaced field
(which the models would drop) fails as surely as a wrong type. No cluster runs it here.
"""

import json

import pytest
from kubeflow_trainer_api.models import TrainerV1alpha1TrainJob
from typer.testing import CliRunner

from qad_pipeline.cli import app
from qad_pipeline.core.config import PROJECT_PARAMS, ConfigError, StageError, load_params
from qad_pipeline.training.distributed import rendezvous
from qad_pipeline.platform.runlock import LOCK_NAME, NODE_ENV
from qad_pipeline.core.stages import STAGES
from qad_pipeline.training.trainjob import Cluster, cluster_from_env, run_trainjob, trainjob_manifest

TOKEN = "0123456789abcdef" * 2
NODES = ["qad.num_nodes=2", "qad.num_gpus=4", "qad.batch_size=8", "qad.sharding=fsdp", "qad.offload=true"]


def validated(manifest: dict) -> dict:
    """The manifest as the API's models read it back; equal to the input when every field is known."""
    return TrainerV1alpha1TrainJob.from_dict(manifest).to_dict()


def test_the_trainjob_is_valid_and_runs_the_stage_command_on_every_node():
    params = load_params(PROJECT_PARAMS, NODES)
    cluster = Cluster(image="registry.example.com/qad:v2", node_selector={"pool": "h100"},
                      tolerations=[{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}])
    command = STAGES["qad"].command(params_file="params.yaml", out_root="/opt/qad-pipeline/runs/m-1", overrides=NODES)
    manifest = trainjob_manifest(params, command, "/opt/qad-pipeline/runs/m-1", TOKEN, cluster)
    assert json.dumps(validated(manifest), sort_keys=True) == json.dumps(manifest, sort_keys=True)
    trainer = manifest["spec"]["trainer"]
    assert trainer["command"] == command
    assert (trainer["numNodes"], trainer["numProcPerNode"]) == (2, 4)
    assert trainer["resourcesPerNode"]["limits"]["nvidia.com/gpu"] == "4"
    assert {"name": NODE_ENV, "value": TOKEN} in trainer["env"]
    pod = manifest["spec"]["runtimePatches"][0]["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"][0][
        "template"]["spec"]["template"]["spec"]
    assert pod["volumes"][0]["persistentVolumeClaim"]["claimName"] == "qad-workspace"
    assert {"name": "workspace", "mountPath": "/opt/qad-pipeline/runs", "subPath": "runs"} in pod["containers"][0][
        "volumeMounts"]
    assert pod["nodeSelector"] == {"pool": "h100"} and pod["tolerations"][0]["key"] == "nvidia.com/gpu"


def test_the_validation_catches_a_misplaced_field_and_a_wrong_type():
    manifest = trainjob_manifest(load_params(PROJECT_PARAMS, NODES), ["qad-pipeline", "stage", "qad"], "/w/r", TOKEN,
                                 Cluster(image="qad:v2"))
    manifest["spec"]["trainer"]["numNode"] = manifest["spec"]["trainer"].pop("numNodes")  # dropped by the models
    assert "numNode" not in validated(manifest)["spec"]["trainer"]
    manifest["spec"]["trainer"]["numNodes"] = "two"
    with pytest.raises(ValueError):
        validated(manifest)


def test_the_command_renders_for_the_run_holding_the_out_root_and_refuses_otherwise(tmp_path):
    runner = CliRunner()
    base = ["trainjob", "--image", "qad:v2", "--out-root", str(tmp_path), "--params", str(PROJECT_PARAMS)]
    nodes = [arg for item in NODES for arg in ("--set", item)]
    free = runner.invoke(app, base + nodes)
    assert free.exit_code == 2 and f"no run holds {tmp_path}" in free.output
    (tmp_path / LOCK_NAME).write_text(json.dumps({"token": TOKEN, "finished": False}))
    one_node = runner.invoke(app, base)
    assert one_node.exit_code == 2 and "qad.num_nodes = 1: a TrainJob is for QAD on several nodes" in one_node.output
    done = runner.invoke(app, base + nodes)
    assert done.exit_code == 0, done.output
    assert f"value: {TOKEN}" in done.output and "numNodes: 2" in done.output


def test_rendezvous_options(monkeypatch):
    for name in ("PET_MASTER_ADDR", "PET_MASTER_PORT", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    assert rendezvous(load_params(PROJECT_PARAMS, ["qad.num_gpus=2"]), TOKEN) == ["--standalone", "--nproc-per-node=2"]
    two = load_params(PROJECT_PARAMS, ["qad.num_nodes=2", "qad.num_gpus=1"])  # settled, as launch_processes has them
    with pytest.raises(ConfigError, match="qad.num_nodes = 2 needs a rendezvous: set qad.rdzv_endpoint"):
        rendezvous(two, TOKEN)
    monkeypatch.setenv("PET_MASTER_ADDR", "qad-abc-node-0-0.qad-abc")  # as Kubeflow Trainer's torch runtime sets it
    monkeypatch.setenv("PET_MASTER_PORT", "29400")
    assert rendezvous(two, TOKEN) == ["--nnodes=2", "--nproc-per-node=1", "--rdzv-backend=c10d",
                                      "--rdzv-endpoint=qad-abc-node-0-0.qad-abc:29400", f"--rdzv-id=qad-{TOKEN[:16]}"]
    given = load_params(PROJECT_PARAMS, ["qad.num_nodes=2", "qad.num_gpus=1", "qad.rdzv_endpoint=head.example:1234"])
    assert "--rdzv-endpoint=head.example:1234" in rendezvous(given, TOKEN)


class FakeTrainJobs:
    """Kubernetes' custom objects API for TrainJobs, with the conditions a job goes through."""

    def __init__(self, statuses, fail_get=None):
        self.statuses, self.fail_get, self.calls = list(statuses), fail_get, []

    async def create_namespaced_custom_object(self, group, version, namespace, plural, body):
        self.calls.append(("create", group, version, namespace, plural, body["metadata"]["name"]))

    async def get_namespaced_custom_object(self, group, version, namespace, plural, name):
        self.calls.append(("get", name))
        if self.fail_get and len(self.calls) > 2:
            raise self.fail_get
        return {"status": {"conditions": self.statuses.pop(0) if len(self.statuses) > 1 else self.statuses[0]}}

    async def delete_namespaced_custom_object(self, group, version, namespace, plural, name):
        self.calls.append(("delete", name))


def manifest_for_a_run():
    return trainjob_manifest(load_params(PROJECT_PARAMS, NODES), ["qad-pipeline", "stage", "qad"], "/w/r", TOKEN,
                             Cluster(image="qad:v2", namespace="ml"))


def test_the_stage_waits_for_its_trainjob_and_reports_how_it_ended():
    created = [{"type": "Created", "status": "True"}]
    complete = [*created, {"type": "Complete", "status": "True", "message": "done"}]
    api, lines = FakeTrainJobs([[], created, complete]), []
    run_trainjob(manifest_for_a_run(), api=api, poll=0, log=lines.append)
    name = manifest_for_a_run()["metadata"]["name"]
    assert api.calls[0] == ("create", "trainer.kubeflow.org", "v1alpha1", "ml", "trainjobs", name)
    assert [c[0] for c in api.calls].count("get") == 3 and ("delete", name) not in api.calls
    assert lines[-1] == f"qad: TrainJob {name}: Complete=True done"

    failed = FakeTrainJobs([[{"type": "Failed", "status": "True", "message": "node 1: exit code 1"}]])
    with pytest.raises(StageError, match=f"TrainJob ml/{name} failed: node 1: exit code 1"):
        run_trainjob(manifest_for_a_run(), api=failed, poll=0, log=lines.append)
    assert ("delete", name) not in failed.calls  # kept, with its pods' logs

    stopped = FakeTrainJobs([[]], fail_get=KeyboardInterrupt())  # the stage is stopped while it waits
    with pytest.raises(KeyboardInterrupt):
        run_trainjob(manifest_for_a_run(), api=stopped, poll=0, log=lines.append)
    assert stopped.calls[-1] == ("delete", name)


def test_a_pod_names_its_cluster_in_its_environment():
    assert cluster_from_env({}) is None
    cluster = cluster_from_env({"QAD_TRAINJOB_IMAGE": "reg/qad:v3", "QAD_TRAINJOB_NAMESPACE": "ml",
                                "QAD_TRAINJOB_NODE_SELECTOR": "pool=h100,zone=a", "QAD_TRAINJOB_GPU_TOLERATION": "false"})
    assert (cluster.image, cluster.namespace, cluster.node_selector, cluster.tolerations) == (
        "reg/qad:v3", "ml", {"pool": "h100", "zone": "a"}, [])
