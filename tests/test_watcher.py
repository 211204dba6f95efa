"""The watch-base-checkpoints flow: which checkpoints start a pipeline run, how many times, and
with which parameters (the folder rules without a server: tests/test_watcher_folders.py; the
sources' checks and parameters: tests/test_watch_sources.py).

The flow runs against a temporary Prefect server (one for the module) and starts a stub
deployment that needs no worker, with the real pipeline flow's parameter schema: the runs it
creates stay Scheduled, and the tests count them and read their parameters back from the server.
No test contacts the Hugging Face hub.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from flows import watcher
from flows.watcher import WatcherError, load_state, watch_base_checkpoints
from qad_pipeline.core.config import PROJECT_PARAMS, PROJECT_ROOT, load_params
from tests.test_watch_sources import write_profile
from tests.test_watcher_folders import expected_sha256, write_checkpoint

STUB_FLOW = "qad-pipeline-stub"
SHA_A, SHA_B = "a" * 40, "b" * 40
PARAMS = str(PROJECT_PARAMS)  # the params file of a source that names none: params.yaml, made absolute


def path_override(folder) -> str:
    return f"base_model.path={json.dumps(str(folder))}"


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


def make_deployment(flow_id, name: str, parameters: dict | None = None) -> tuple[str, object]:
    """A stub deployment ("flow/name", id) enforcing the pipeline flow's own parameter schema."""
    from prefect.client.orchestration import get_client
    from prefect.utilities.callables import parameter_schema

    from flows.pipeline import qad_pipeline as pipeline_flow

    schema = parameter_schema(pipeline_flow.fn).model_dump_for_openapi()
    with get_client(sync_client=True) as client:
        deployment_id = client.create_deployment(
            flow_id, name=name, parameters=parameters or {}, parameter_openapi_schema=schema,
            enforce_parameter_schema=True,
        )
    return f"{STUB_FLOW}/{name}", deployment_id


@pytest.fixture
def deployment(prefect_flow_id, request):
    """A fresh stub deployment per test ("flow/name", id), so each test counts only its own runs."""
    return make_deployment(prefect_flow_id, request.node.name.removeprefix("test_"))


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

    # (2) a checkpoint starts one run, with params.yaml, its folder as the only override and its own output root
    a = write_checkpoint(incoming / "Model-A")
    sha_a = expected_sha256(a)
    summary = watch_base_checkpoints(**params)
    [run] = flow_runs(deployment_id)
    assert run.state.is_scheduled() and run.parent_task_run_id is None  # not a subflow of the watcher
    assert run.name == f"model-a-{sha_a[:12]}"
    assert run.parameters == {"params_file": PARAMS, "overrides": [path_override(a)], "base_model": None,
                              "out_root": f"{runs_root}/model-a-{sha_a[:12]}"}
    record = json.loads(state_file.read_text())["seen"][f"sha256:{sha_a}"]
    assert record["flow_run_id"] == str(run.id) and record["flow_run_name"] == run.name
    assert record["base_model"] == str(a) and record["out_root"] == run.parameters["out_root"]
    assert record["params_file"] == PARAMS
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
    assert [r.parameters["overrides"] for r in runs] == [[path_override(f)] for f in (a, b, c, a)]
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
        {"params_file": PARAMS, "overrides": ['base_model.path="org/Model-A"', f'base_model.revision="{sha}"'],
         "base_model": None, "out_root": f"runs/org-model-a-{sha[:12]}"}
        for sha in (SHA_A, SHA_B)
    ]
    assert sorted(json.loads((tmp_path / "seen.json").read_text())["seen"]) == [
        f"org/Model-A@{SHA_A}", f"org/Model-A@{SHA_B}"]


def test_each_source_runs_with_its_own_profile_and_overrides(tmp_path, prefect_flow_id, monkeypatch):
    """Two folders and a hub id, each with its profile and overrides, watched by one deployment whose
    own default overrides are kept: every run's params are its source's, with the checkpoint merged in."""
    recipes = sorted(p.stem for p in (PROJECT_ROOT / "recipes").glob("nvfp4_*.yaml"))
    small = write_profile(tmp_path / "profiles" / "small.yaml", **{"qad.steps": 7, "ptq.recipes": recipes[:1]})
    large = write_profile(tmp_path / "elsewhere" / "large.yaml", **{"qad.steps": 11, "ptq.recipes": recipes[1:3]})
    a = write_checkpoint(tmp_path / "incoming-small" / "model-a")
    b = write_checkpoint(tmp_path / "incoming-large" / "model-b", b"other weights")
    monkeypatch.setattr(watcher, "latest_hub_revision", lambda model_id: {"org/Model-H": SHA_A}[model_id])
    defaults = {"overrides": ["eval.limit=3"], "stage_deployment": "gpu-stage/gpu"}
    name, deployment_id = make_deployment(prefect_flow_id, "profiles", defaults)
    monkeypatch.chdir(tmp_path)  # relative watch_dir and params_file: resolved here, in the watcher's directory
    sources = [
        {"watch_dir": "incoming-small", "params_file": "profiles/small.yaml", "overrides": ["calibration.seed=1"]},
        {"watch_dir": "incoming-large", "params_file": str(large)},
        {"hub_id": "org/Model-H", "params_file": "elsewhere/large.yaml", "overrides": ["qad.lr=0.0001"]},
    ]
    summary = watch_base_checkpoints(sources=sources, deployment=name, state_file="seen.json", settle_seconds=0)

    runs = {r.name: r for r in flow_runs(deployment_id)}
    expected = {  # run name: (params file, overrides after the deployment's, steps, recipes, revision)
        f"model-a-{expected_sha256(a)[:12]}": (small, ["calibration.seed=1", path_override(a)], 7, recipes[:1], None),
        f"model-b-{expected_sha256(b)[:12]}": (large, [path_override(b)], 11, recipes[1:3], None),
        f"org-model-h-{SHA_A[:12]}": (large, ["qad.lr=0.0001", 'base_model.path="org/Model-H"',
                                          f'base_model.revision="{SHA_A}"'], 11, recipes[1:3], SHA_A),
    }
    assert sorted(runs) == sorted(expected) and len(summary["triggered"]) == 3
    for run_name, (params_file, overrides, steps, run_recipes, revision) in expected.items():
        parameters = runs[run_name].parameters
        assert parameters == {"params_file": str(params_file), "overrides": ["eval.limit=3", *overrides],
                              "base_model": None, "out_root": f"runs/{run_name}", "stage_deployment": "gpu-stage/gpu"}
        params = load_params(Path(parameters["params_file"]), parameters["overrides"])  # as the run will
        assert (params.qad.steps, params.ptq.recipes, params.eval.limit) == (steps, run_recipes, 3)
        assert params.base_model.revision == revision
        assert params.base_model.path == {"model-a": str(a), "model-b": str(b)}.get(run_name[:7], "org/Model-H")
    assert {r["flow_run_name"]: r["params_file"] for r in load_state(tmp_path / "seen.json")["seen"].values()} == {
        run_name: str(params_file) for run_name, (params_file, *_) in expected.items()}


def test_a_bad_source_fails_the_tick_and_starts_nothing(tmp_path, prefect_flow_id, monkeypatch):
    looked_up = []  # the sources are checked before any hub id is looked up
    monkeypatch.setattr(watcher, "latest_hub_revision", lambda model_id: looked_up.append(model_id) or SHA_A)
    good = {"watch_dir": str(write_checkpoint(tmp_path / "incoming" / "m").parent)}
    name, deployment_id = make_deployment(prefect_flow_id, "bad-source")
    params = {"deployment": name, "state_file": str(tmp_path / "seen.json"), "settle_seconds": 0}
    profile = write_profile(tmp_path / "p.yaml", **{"qad.steps": 5})

    # one bad source (every kind of bad value: tests/test_watch_sources.py) and nothing starts
    bad = {"hub_id": "org/M", "params_file": str(profile), "overrides": ["qad.steps=0"]}
    state = watch_base_checkpoints(sources=[good, bad], **params, return_state=True)
    assert state.is_failed() and state.message.endswith(
        f"ConfigError: source hub_id org/M: {profile}: qad.steps = 0: Input should be greater than 0")
    # the deployment's own default overrides are checked with each run's before any starts
    other, other_id = make_deployment(prefect_flow_id, "bad-default", {"overrides": ["eval.limitt=3"]})
    state = watch_base_checkpoints(sources=[good], **{**params, "deployment": other}, return_state=True)
    assert state.is_failed() and f"source watch_dir {good['watch_dir']}: unknown key 'eval.limitt'" in state.message
    assert state.message.endswith(f"(with {other}'s default overrides ['eval.limitt=3'])")
    assert flow_runs(deployment_id) == [] and flow_runs(other_id) == []
    assert load_state(tmp_path / "seen.json")["seen"] == {} and looked_up == []


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
    both = watch_base_checkpoints(sources=[{"watch_dir": str(tmp_path), "hub_id": "org/M"}], return_state=True)
    assert both.is_failed() and "a source watches exactly one of watch_dir and hub_id" in both.message
    typo = watch_base_checkpoints(sources=[{"watch_dir": str(tmp_path), "param_file": "x.yaml"}], return_state=True)
    assert typo.is_failed() and "param_file" in typo.message and "Extra inputs are not permitted" in typo.message
    refused = watch_base_checkpoints(watch_dir=str(tmp_path), deployment="no-slash", return_state=True)
    assert refused.is_failed() and "deployment: String should match pattern" in refused.message
