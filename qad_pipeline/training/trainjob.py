"""QAD on several nodes of a Kubernetes cluster: the Kubeflow Trainer job (`TrainJob`,
trainer.kubeflow.org/v1alpha1) that runs `qad-pipeline stage qad` on every node.

Why a TrainJob (Kubeflow Trainer v2) and not the training operator's PyTorchJob: the PyTorchJob's
operator (Training Operator v1) is in maintenance, superseded by Trainer v2; its `torch-distributed`
ClusterTrainingRuntime already gives every node's pod torchrun's settings (PET_NNODES,
PET_NODE_RANK, PET_MASTER_ADDR, PET_MASTER_PORT) and a headless service for the first node, and a
TrainJob names only the image, the command, the node count and the GPUs per node: the rest (the
shared volume, the node selector and tolerations of the GPU pool) is a runtime patch of this job.

Every node runs the same command. It starts torchrun with `qad.num_nodes` and `qad.num_gpus`
and the c10d rendezvous at `qad.rdzv_endpoint`, or the first node's address the runtime gives
(`qad_pipeline.training.distributed.rendezvous`). The nodes pass through the out-root's lock that the
pipeline run holds: they get its token in QAD_PIPELINE_NODE_OF (`qad_pipeline.platform.runlock`). The run's
out-root must be on a volume every node mounts (the PVC `qad-workspace`, ReadWriteMany): the
checkpoint shards, the student and loss.json are written there, by the processes that own them.

`trainjob_manifest` renders it; `qad-pipeline trainjob` prints it; tests/test_trainjob.py
validates it against the API's own models (the `kubeflow-trainer-api` package).

Submitted by the QAD stage itself (`run_trainjob`): when `qad.num_nodes > 1` and the stage runs in
a pod whose environment names the job's image (`QAD_TRAINJOB_IMAGE`, from the pool's ConfigMap),
`qad-pipeline stage qad` creates the TrainJob with its own command line instead of starting
torchrun, logs its conditions as they change and waits for `Complete` or `Failed`: a failed job
fails the stage with the job's message, so the flow reports it like any stage; a stopped stage
deletes the job (its pods go with it). Tested against a fake API; no cluster runs it here.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated

import typer

from qad_pipeline.core.config import ConfigError, Params
from qad_pipeline.platform.runlock import NODE_ENV
from qad_pipeline.core.stages import QAD

API_VERSION = "trainer.kubeflow.org/v1alpha1"
NODE = "node"  # the torch-distributed runtime's replicated job and container
WORKSPACE = "/workspace"
PROJECT_DIR = "/opt/qad-pipeline"  # the image's working directory (infra/Dockerfile)
SHARED = ("artifacts", "metrics", "runs", "checkpoints")  # mounted over the image's folders, as in the pools


@dataclass(frozen=True)
class Cluster:
    """Where the job runs: the same values as the `qad-gpu` pool's job template (infra/k8s/base)."""

    image: str
    namespace: str = "qad"
    runtime: str = "torch-distributed"
    workspace_claim: str = "qad-workspace"
    secret_name: str = "qad-hf"  # holds HF_TOKEN (infra/README.md, "Secrets")
    gpu_resource: str = "nvidia.com/gpu"
    node_selector: dict[str, str] = field(default_factory=dict)
    tolerations: list[dict] = field(default_factory=list)
    shm_size: str = "64Gi"


def job_name(out_root: str, token: str) -> str:
    """A DNS-1035 name, the same for the same run and out-root."""
    return "qad-" + hashlib.sha256(f"{out_root}\0{token}".encode()).hexdigest()[:12]


def trainjob_manifest(params: Params, command: list[str], out_root: str, token: str, cluster: Cluster) -> dict:
    """The TrainJob that runs `command` (a `qad-pipeline stage qad` command line) on every node, for
    the run that holds `out_root`'s lock with `token`."""
    q = params.qad
    if q.num_nodes < 2:
        raise ConfigError(f"qad.num_nodes = {q.num_nodes}: a TrainJob is for QAD on several nodes; one node runs "
                          "as a stage of the qad-gpu pool")
    if not q.settled:  # every node must run one choice: the plan's, stated
        raise ConfigError("qad.num_gpus, qad.batch_size or qad.grad_accum is auto: a TrainJob's nodes must share one "
                          "choice; set them (`qad-pipeline plan` prints what auto chooses)")
    if not out_root.startswith("/"):
        raise ConfigError(f"out-root {out_root!r} must be an absolute path on the shared volume (e.g. "
                          f"{PROJECT_DIR}/runs/<name>), the same on every node")
    gpus = str(q.num_gpus)
    env = [{"name": NODE_ENV, "value": token},
           {"name": "HF_HOME", "value": f"{WORKSPACE}/hf-cache"},
           {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": cluster.secret_name, "key": "HF_TOKEN",
                                                                "optional": True}}}]
    mounts = [{"name": "workspace", "mountPath": WORKSPACE}, {"name": "dshm", "mountPath": "/dev/shm"}]
    mounts += [{"name": "workspace", "mountPath": f"{PROJECT_DIR}/{d}", "subPath": d} for d in SHARED]
    pod = {"volumes": [{"name": "workspace", "persistentVolumeClaim": {"claimName": cluster.workspace_claim}},
                       {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": cluster.shm_size}}],
           "containers": [{"name": NODE, "volumeMounts": mounts}]}
    if cluster.node_selector:
        pod["nodeSelector"] = dict(cluster.node_selector)
    if cluster.tolerations:
        pod["tolerations"] = list(cluster.tolerations)
    return {
        "apiVersion": API_VERSION,
        "kind": "TrainJob",
        "metadata": {"name": job_name(out_root, token), "namespace": cluster.namespace,
                     "labels": {"app.kubernetes.io/part-of": "qad-pipeline", "qad-pipeline/stage": QAD.name}},
        "spec": {
            "runtimeRef": {"name": cluster.runtime, "apiGroup": "trainer.kubeflow.org",
                           "kind": "ClusterTrainingRuntime"},
            "trainer": {
                "image": cluster.image,
                "command": command,
                "numNodes": q.num_nodes,
                "numProcPerNode": q.num_gpus,  # the runtime's PET_NPROC_PER_NODE; the command passes it to torchrun too
                "resourcesPerNode": {"limits": {cluster.gpu_resource: gpus}, "requests": {cluster.gpu_resource: gpus}},
                "env": env,
            },
            "runtimePatches": [{
                "manager": "qad-pipeline",
                "trainingRuntimeSpec": {"template": {"spec": {"replicatedJobs": [
                    {"name": NODE, "template": {"spec": {"template": {"spec": pod}}}}]}}},
            }],
        },
    }


def trainjob_command(
    image: Annotated[str, typer.Option("--image", help="the pipeline image, as the qad-gpu pool runs it")],
    out_root: Annotated[Path, typer.Option("--out-root", help="the run's out-root on the shared volume (absolute)")],
    params_file: Annotated[Path, typer.Option("--params", help="the params file, as the image's path")] = Path(
        f"{PROJECT_DIR}/params.yaml"),
    overrides: Annotated[list[str] | None, typer.Option("--set", "-s", help="section.key=value (repeatable)")] = None,
    namespace: Annotated[str, typer.Option("--namespace")] = "qad",
    runtime: Annotated[str, typer.Option("--runtime", help="the ClusterTrainingRuntime")] = "torch-distributed",
    node_selector: Annotated[list[str] | None, typer.Option("--node-selector", help="key=value (repeatable)")] = None,
    gpu_toleration: Annotated[bool, typer.Option(help="tolerate the nvidia.com/gpu taint")] = True,
) -> None:
    """Print the Kubeflow TrainJob that runs the QAD stage of the run holding --out-root on
    qad.num_nodes nodes (apply it with `kubectl apply -f -`)."""
    import yaml

    from qad_pipeline.core.config import load_params
    from qad_pipeline.core.redaction import redact_text
    from qad_pipeline.platform.runlock import LOCK_NAME

    try:
        items = list(overrides or [])
        params = load_params(params_file, items) if params_file.is_file() else None
        if params is None:
            raise ConfigError(f"no params file {params_file} here: give --params the file the image holds, as a "
                              "path on this machine too (e.g. a checkout of the same commit)")
        lock = out_root / LOCK_NAME
        holder = json.loads(lock.read_text()) if lock.is_file() else {}
        if not holder.get("token") or holder.get("finished"):
            raise ConfigError(f"no run holds {out_root} ({lock}): start the run first; the job's nodes pass "
                              "through that run's lock")
        selector = dict(item.split("=", 1) for item in node_selector or [])
        tolerations = [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}] if gpu_toleration else []
        cluster = Cluster(image=image, namespace=namespace, runtime=runtime, node_selector=selector,
                          tolerations=tolerations)
        command = QAD.command(params_file=str(params_file), out_root=str(out_root), overrides=items)
        manifest = trainjob_manifest(params, command, str(out_root), holder["token"], cluster)
    except ConfigError as err:  # as the CLI's other commands refuse: one line, exit 2
        typer.echo(f"error: {redact_text(str(err))}", err=True)
        raise typer.Exit(2) from None
    typer.echo(yaml.safe_dump(manifest, sort_keys=False))


GROUP, VERSION, PLURAL = "trainer.kubeflow.org", "v1alpha1", "trainjobs"
NAMESPACE_FILE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")


def cluster_from_env(environ=None) -> Cluster | None:
    """Where this pod's QAD stage submits its TrainJob: QAD_TRAINJOB_IMAGE (None without it: torchrun
    here), QAD_TRAINJOB_NAMESPACE (else this pod's namespace), QAD_TRAINJOB_RUNTIME,
    QAD_TRAINJOB_NODE_SELECTOR (`key=value,...`), QAD_TRAINJOB_GPU_TOLERATION (`false` to drop it)."""
    import os

    env = os.environ if environ is None else environ
    if not env.get("QAD_TRAINJOB_IMAGE"):
        return None
    namespace = env.get("QAD_TRAINJOB_NAMESPACE") or (
        NAMESPACE_FILE.read_text().strip() if NAMESPACE_FILE.is_file() else "qad")
    selector = dict(item.split("=", 1) for item in env.get("QAD_TRAINJOB_NODE_SELECTOR", "").split(",") if "=" in item)
    tolerate = env.get("QAD_TRAINJOB_GPU_TOLERATION", "true").lower() != "false"
    return Cluster(image=env["QAD_TRAINJOB_IMAGE"], namespace=namespace,
                   runtime=env.get("QAD_TRAINJOB_RUNTIME", "torch-distributed"), node_selector=selector,
                   tolerations=[{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}] if tolerate
                   else [])


def run_trainjob(manifest: dict, api=None, poll: float = 10.0, log=print) -> None:
    """Create the TrainJob and wait for it to end: return when it is Complete, raise StageError
    when it Failed; a stop or an error while waiting deletes it. `api`: a kubernetes_asyncio
    CustomObjectsApi (default: in-cluster credentials)."""
    import asyncio

    asyncio.run(_run_trainjob(manifest, api, poll, log))


async def _run_trainjob(manifest: dict, api, poll: float, log) -> None:
    import asyncio

    from qad_pipeline.core.config import StageError

    if api is None:
        from kubernetes_asyncio import client, config

        config.load_incluster_config()
        api = client.CustomObjectsApi()
    name, namespace = manifest["metadata"]["name"], manifest["metadata"]["namespace"]
    where = dict(group=GROUP, version=VERSION, namespace=namespace, plural=PLURAL)
    await api.create_namespaced_custom_object(body=manifest, **where)
    log(f"qad: TrainJob {namespace}/{name} created: {manifest['spec']['trainer']['numNodes']} nodes")
    seen: dict[str, str] = {}
    try:
        while True:
            job = await api.get_namespaced_custom_object(name=name, **where)
            for condition in (job.get("status") or {}).get("conditions") or []:
                kind, state = condition.get("type"), condition.get("status")
                if seen.get(kind) != state:
                    seen[kind] = state
                    log(f"qad: TrainJob {name}: {kind}={state} {condition.get('message', '')}".rstrip())
                if kind == "Complete" and state == "True":
                    return
                if kind == "Failed" and state == "True":
                    raise StageError(f"qad: TrainJob {namespace}/{name} failed: {condition.get('message') or kind}; "
                                     "its pods' logs have the error (kubectl logs -l "
                                     f"jobset.sigs.k8s.io/jobset-name={name})")
            await asyncio.sleep(poll)
    except BaseException as err:
        if not isinstance(err, StageError):
            await api.delete_namespaced_custom_object(name=name, **where)
            log(f"qad: TrainJob {name} deleted ({type(err).__name__})")
        raise
