"""The watch-base-checkpoints flow: which checkpoints start a pipeline run, and how many times.

The flow runs against a temporary Prefect server (one for the module) and starts a stub
deployment that needs no worker: the runs it creates stay Scheduled, and the tests count them
and read their parameters back from the server. No test contacts the Hugging Face hub.
"""

import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from flows import watcher
from flows.watcher import WatcherError, load_state, scan_folder, slug, state_lock, watch_base_checkpoints

STUB_FLOW = "qad-pipeline-stub"
SHA_A, SHA_B = "a" * 40, "b" * 40


def pipeline_parameters(base_model: str, overrides: list[str], out_root: str):
    """The parameters the watcher passes; the stub deployment enforces this schema."""


def write_checkpoint(folder: Path, weights: bytes = b"\x00\x01" * 64) -> Path:
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({"model_type": "llama", "name": folder.name}))
    (folder / "model.safetensors").write_bytes(weights)
    (folder / "tokenizer").mkdir()
    (folder / "tokenizer" / "tokenizer.json").write_text("{}")
    return folder


def expected_sha256(folder: Path) -> str:
    """The documented identity, computed here independently: relative path + bytes, sorted."""
    digest = hashlib.sha256()
    for rel in ["config.json", "model.safetensors", "tokenizer/tokenizer.json"]:
        digest.update(rel.encode() + (folder / rel).read_bytes())
    return digest.hexdigest()


def set_age(folder: Path, seconds: float) -> None:
    past = time.time() - seconds
    for p in [folder, *folder.rglob("*")]:
        os.utime(p, (past, past))


# --- the folder rules, without a server ---------------------------------------------------------


def test_only_settled_complete_folders_are_picked_up(tmp_path):
    incoming = tmp_path / "incoming"
    ready = write_checkpoint(incoming / "ready")
    fresh = write_checkpoint(incoming / "fresh")
    downloading = write_checkpoint(incoming / "downloading")
    (downloading / "model-00002.safetensors.incomplete").write_bytes(b"x")
    copying = write_checkpoint(incoming / "copying")
    (copying / "tokenizer" / "vocab.json.tmp").write_bytes(b"x")
    (incoming / "no-config").mkdir()
    (incoming / "no-config" / "model.safetensors").write_bytes(b"x")
    write_checkpoint(incoming / ".staging")
    (incoming / "notes.txt").write_text("not a folder")
    for folder in incoming.iterdir():
        if folder.is_dir() and folder != fresh:
            set_age(folder, 120)

    scan = scan_folder(incoming, settle_seconds=60, cache={})
    assert [c.name for c in scan.checkpoints] == ["ready"]
    assert scan.checkpoints[0].base_model == str(ready)
    assert scan.checkpoints[0].identity == f"sha256:{expected_sha256(ready)}"
    assert list(scan.cache) == [str(ready)]
    why = "\n".join(scan.waiting)
    for name, reason in [("fresh", "changed 0s ago"), ("downloading", ".incomplete"),
                         ("copying", "vocab.json.tmp"), ("no-config", "no config.json")]:
        assert f"{name}: " in why and reason in why
    assert ".staging" not in why

    later = scan_folder(incoming, settle_seconds=60, cache={}, now=time.time() + 61)
    assert [c.name for c in later.checkpoints] == ["fresh", "ready"]


def test_an_unchanged_folder_is_not_read_again(tmp_path, monkeypatch):
    folder = write_checkpoint(tmp_path / "incoming" / "m")
    hashed = []
    real = watcher.folder_sha256
    monkeypatch.setattr(watcher, "folder_sha256", lambda f, files: hashed.append(f) or real(f, files))

    first = scan_folder(tmp_path / "incoming", 0, {})
    again = scan_folder(tmp_path / "incoming", 0, json.loads(json.dumps(first.cache)))  # as stored
    assert len(hashed) == 1 and again.checkpoints == first.checkpoints

    set_age(folder, 30)  # touched, same bytes: read again, same identity
    touched = scan_folder(tmp_path / "incoming", 0, again.cache)
    assert len(hashed) == 2 and touched.checkpoints[0].identity == first.checkpoints[0].identity

    (folder / "model.safetensors").write_bytes(b"\x02" * 100)
    changed = scan_folder(tmp_path / "incoming", 0, touched.cache)
    assert len(hashed) == 3 and changed.checkpoints[0].identity == f"sha256:{expected_sha256(folder)}"
    assert changed.checkpoints[0].identity != first.checkpoints[0].identity


def test_identity_is_the_hash_the_pipeline_records(tmp_path):
    """The watcher's identity equals the baseline's base_model.sha256, so runs and lineage agree."""
    from qad_pipeline.config import BaseModelParams
    from qad_pipeline.modeling import checkpoint_identity

    folder = write_checkpoint(tmp_path / "incoming" / "m")
    (folder / "a.txt").write_text("sorts between 'a' dirs and files")
    (folder / "a").mkdir()
    (folder / "a" / "b.bin").write_bytes(b"\x07")
    (folder / ".cache").mkdir()
    (folder / ".cache" / "meta").write_text("hidden files count too")
    [ckpt] = scan_folder(tmp_path / "incoming", 0, {}).checkpoints
    assert ckpt.fingerprint == checkpoint_identity(BaseModelParams(path=str(folder)))["sha256"]


def test_state_is_never_silently_reset_and_one_run_at_a_time(tmp_path):
    state_file = tmp_path / "seen.json"
    assert load_state(state_file) == {"seen": {}, "folders": {}}
    state_file.write_text('{"seen": {')
    with pytest.raises(WatcherError, match="cannot read the watcher state"):
        load_state(state_file)

    busy = r"another watch-base-checkpoints run \(pid \d+ .*\) holds"
    with state_lock(state_file), pytest.raises(WatcherError, match=busy), state_lock(state_file):
        pass
    with state_lock(state_file):  # released
        pass


def test_run_folder_names():
    assert slug("nvidia/Nemotron-H-8B-Base-8K") == "nvidia-nemotron-h-8b-base-8k"
    assert slug("My Model (v2)") == "my-model-v2"
    assert watcher.hub_checkpoint("org/M", SHA_A).run_name == "org-m-aaaaaaaaaaaa"


# --- the flow against a Prefect server ------------------------------------------------------------


@pytest.fixture(scope="module")
def prefect_flow_id():
    """A temporary Prefect server for this module, holding the stub flow the deployments start."""
    from prefect.client.orchestration import get_client
    from prefect.settings import temporary_settings
    from prefect.testing.utilities import prefect_test_harness

    # no heartbeat thread: joining it costs each flow call about a second
    with (
        prefect_test_harness(server_startup_timeout=120),
        temporary_settings({"flows.heartbeat_frequency": None}),
        get_client(sync_client=True) as client,
    ):
        yield client.create_flow_from_name(STUB_FLOW)


@pytest.fixture
def deployment(prefect_flow_id, request):
    """A fresh stub deployment per test ("flow/name", id), so each test counts only its own runs."""
    from prefect.client.orchestration import get_client
    from prefect.utilities.callables import parameter_schema

    name = request.node.name.removeprefix("test_")
    schema = parameter_schema(pipeline_parameters).model_dump_for_openapi()
    with get_client(sync_client=True) as client:
        deployment_id = client.create_deployment(
            prefect_flow_id, name=name, parameter_openapi_schema=schema, enforce_parameter_schema=True
        )
    return f"{STUB_FLOW}/{name}", deployment_id


def flow_runs(deployment_id) -> list:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterId
    from prefect.client.schemas.sorting import FlowRunSort

    with get_client(sync_client=True) as client:
        return client.read_flow_runs(
            deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=[deployment_id])),
            sort=FlowRunSort.EXPECTED_START_TIME_ASC,
        )


def watcher_in_a_new_process(**params) -> subprocess.CompletedProcess:
    from prefect.settings import PREFECT_API_URL

    code = ("import json, sys; from flows.watcher import watch_base_checkpoints as w; "
            "print(json.dumps(w(**json.loads(sys.argv[1]))))")
    env = dict(os.environ, PREFECT_API_URL=PREFECT_API_URL.value())
    return subprocess.run([sys.executable, "-c", code, json.dumps(params)], env=env, capture_output=True, text=True,
                          timeout=120, check=False)


def test_each_new_folder_checkpoint_starts_one_run(tmp_path, deployment):
    name, deployment_id = deployment
    incoming, runs_root, state_file = tmp_path / "incoming", tmp_path / "runs", tmp_path / "state" / "seen.json"
    incoming.mkdir()
    params = {"watch_dir": str(incoming), "deployment": name, "state_file": str(state_file),
              "runs_root": str(runs_root), "settle_seconds": 0}

    # (1) an empty folder starts nothing
    assert watch_base_checkpoints(**params) == {"seen": 0, "triggered": [], "failed": [], "waiting": []}
    assert flow_runs(deployment_id) == []

    # (2) a checkpoint starts one run, with its folder, no overrides and its own output root
    a = write_checkpoint(incoming / "Model-A")
    sha_a = expected_sha256(a)
    summary = watch_base_checkpoints(**params)
    [run] = flow_runs(deployment_id)
    assert run.state.is_scheduled() and run.parent_task_run_id is None  # not a subflow of the watcher
    assert run.name == f"model-a-{sha_a[:12]}"
    assert run.parameters == {"base_model": str(a), "overrides": [], "out_root": f"{runs_root}/model-a-{sha_a[:12]}"}
    record = json.loads(state_file.read_text())["seen"][f"sha256:{sha_a}"]
    assert record["flow_run_id"] == str(run.id) and record["flow_run_name"] == run.name
    assert record["base_model"] == str(a) and record["out_root"] == run.parameters["out_root"]
    assert record["triggered_at"] and record["deployment"] == name
    assert summary["seen"] == 1 and summary["triggered"] == [{"identity": f"sha256:{sha_a}", **record}]

    # (3) the same folder again starts nothing
    assert watch_base_checkpoints(**params)["triggered"] == []
    # (4) nor does a restarted watcher: a new process with only the state file
    restarted = watcher_in_a_new_process(**params)
    assert restarted.returncode == 0, restarted.stderr[-2000:]
    assert json.loads(restarted.stdout.strip().splitlines()[-1])["triggered"] == []
    assert len(flow_runs(deployment_id)) == 1

    # (5) two new checkpoints start two runs; a changed file makes a new checkpoint and one run
    b, c = write_checkpoint(incoming / "model-b"), write_checkpoint(incoming / "model-c", b"other weights")
    assert len(watch_base_checkpoints(**params)["triggered"]) == 2
    with (a / "model.safetensors").open("ab") as fh:
        fh.write(b"fine-tuned")
    [new_a] = watch_base_checkpoints(**params)["triggered"]
    assert new_a["base_model"] == str(a) and new_a["identity"] == f"sha256:{expected_sha256(a)}" != f"sha256:{sha_a}"

    runs = flow_runs(deployment_id)
    assert [r.parameters["base_model"] for r in runs] == [str(a), str(b), str(c), str(a)]
    out_roots = [r.parameters["out_root"] for r in runs]
    assert len(set(out_roots)) == 4 and all(Path(o).parent == runs_root for o in out_roots)
    seen = json.loads(state_file.read_text())["seen"]
    assert sorted(r["flow_run_id"] for r in seen.values()) == sorted(str(r.id) for r in runs)


def test_each_new_hub_revision_starts_one_run(tmp_path, deployment, monkeypatch):
    name, deployment_id = deployment
    newest = {"org/Model-A": SHA_A}
    monkeypatch.setattr(watcher, "latest_hub_revision", lambda model_id: newest[model_id])
    params = {"hub_model_ids": ["org/Model-A"], "deployment": name, "state_file": str(tmp_path / "seen.json"),
              "runs_root": "runs"}

    assert len(watch_base_checkpoints(**params)["triggered"]) == 1
    assert watch_base_checkpoints(**params)["triggered"] == []
    newest["org/Model-A"] = SHA_B
    assert len(watch_base_checkpoints(**params)["triggered"]) == 1

    assert [r.parameters for r in flow_runs(deployment_id)] == [
        {"base_model": "org/Model-A", "overrides": [f"base_model.revision={sha}"],
         "out_root": f"runs/org-model-a-{sha[:12]}"}
        for sha in (SHA_A, SHA_B)
    ]
    assert sorted(json.loads((tmp_path / "seen.json").read_text())["seen"]) == [
        f"org/Model-A@{SHA_A}", f"org/Model-A@{SHA_B}"]


def test_a_failed_trigger_fails_the_run_and_is_retried(tmp_path, deployment, monkeypatch):
    name, deployment_id = deployment
    incoming = write_checkpoint(tmp_path / "incoming" / "m").parent
    state_file = tmp_path / "seen.json"
    params = {"watch_dir": str(incoming), "state_file": str(state_file), "settle_seconds": 0}

    missing = f"{STUB_FLOW}/no-such-deployment"
    state = watch_base_checkpoints(**params, deployment=missing, return_state=True)
    assert state.is_failed()
    assert f"deployment '{missing}' not found" in state.message and str(incoming / "m") in state.message
    assert load_state(state_file)["seen"] == {}

    # the next tick, with a deployment that exists, starts it; a hub id that cannot be looked up
    # fails the run but does not stop the folder's trigger
    def lookup(model_id):
        raise OSError("hub unreachable")

    monkeypatch.setattr(watcher, "latest_hub_revision", lookup)
    with pytest.raises(WatcherError, match="org/gone: hub lookup failed: hub unreachable") as err:
        watch_base_checkpoints(**params, deployment=name, hub_model_ids=["org/gone"])
    assert len(err.value.summary["triggered"]) == 1 and len(flow_runs(deployment_id)) == 1
    assert list(load_state(state_file)["seen"]) == [err.value.summary["triggered"][0]["identity"]]


class Crash(BaseException):
    """The watcher process dying (killed, machine lost) at a chosen point."""


def crash_on_call(n: int, fn):
    calls = []

    def wrapped(*args, **kwargs):
        calls.append(1)
        if len(calls) == n:
            raise Crash(f"call {n}")
        return fn(*args, **kwargs)

    return wrapped


def test_a_crash_never_loses_or_repeats_a_trigger(tmp_path, deployment, monkeypatch):
    name, deployment_id = deployment
    incoming = tmp_path / "incoming"
    write_checkpoint(incoming / "a")
    state_file = tmp_path / "seen.json"
    params = {"watch_dir": str(incoming), "deployment": name, "state_file": str(state_file), "settle_seconds": 0}

    # killed after the run was created, before it was recorded: the next tick gets the same run back
    with monkeypatch.context() as patch:
        patch.setattr(watcher, "save_state", crash_on_call(1, watcher.save_state))
        with pytest.raises(Crash):
            watch_base_checkpoints(**params)
    assert not state_file.exists() and len(flow_runs(deployment_id)) == 1
    [record] = watch_base_checkpoints(**params)["triggered"]
    [run] = flow_runs(deployment_id)
    assert record["flow_run_id"] == str(run.id)

    # killed between two triggers: the first is on file, only the second is started next tick
    write_checkpoint(incoming / "b")
    write_checkpoint(incoming / "c", b"c weights")
    with monkeypatch.context() as patch:
        patch.setattr(watcher, "run_deployment", crash_on_call(2, watcher.run_deployment))
        with pytest.raises(Crash):
            watch_base_checkpoints(**params)
    assert len(load_state(state_file)["seen"]) == 2
    assert [t["base_model"] for t in watch_base_checkpoints(**params)["triggered"]] == [str(incoming / "c")]
    assert len(flow_runs(deployment_id)) == 3


def test_bad_parameters_are_refused(tmp_path, prefect_flow_id):
    assert "nothing to watch" in watch_base_checkpoints(return_state=True).message
    refused = watch_base_checkpoints(watch_dir=str(tmp_path), deployment="no-slash", return_state=True)
    assert refused.is_failed() and "deployment: String should match pattern" in refused.message
