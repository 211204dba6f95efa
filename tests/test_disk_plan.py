"""The plan's disk (`qad_pipeline.plan.disk_plan`): every place a run writes or downloads, each named."""

import shutil

import pytest
from typer.testing import CliRunner

from qad_pipeline.plan import capacity, costs, disk_plan, memory
from qad_pipeline.cli import app
from qad_pipeline.core.config import PROJECT_PARAMS, PROJECT_ROOT, load_params
from qad_pipeline.core.layout import OUT_ROOT_ENV
from qad_pipeline.plan.memory_model import model_shape

PROFILE = PROJECT_ROOT / "profiles" / "llama-3.1-8b_8xh100.yaml"


@pytest.fixture(autouse=True)
def clean_env(monkeypatch, tmp_path):
    for name in (OUT_ROOT_ENV, "QAD_DVC_REMOTE", "MLFLOW_TRACKING_URI"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("QAD_VLLM_ENV", str(tmp_path / "no-vllm"))  # not created yet
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))  # an empty Hugging Face cache


def terms(plan: disk_plan.DiskPlan) -> dict[str, int]:
    return {t.name: t.bytes for t in plan.terms}


def planned(params_file, overrides=(), root=None):
    params = load_params(params_file, list(overrides))
    estimates = memory.plan(params, capacity.target_capacity("8xH100-80GB"))
    return params, estimates, disk_plan.run_disk(estimates, params, root, params_file, list(overrides))


def test_the_8b_profile_counts_the_hub_weights_the_vllm_env_and_mlflows_export_copy(tmp_path):
    params, estimates, plan = planned(PROFILE, root=tmp_path / "run")
    got, shape = terms(plan), model_shape(params.base_model)
    export = next(e.disk_bytes for e in estimates if e.stage == "export")
    assert got["stages"] == sum(e.disk_bytes for e in estimates)  # the teacher is live: no cache
    assert got["teacher cache"] == 0 and got["DVC cache"] == 0  # no DVC project, no remote
    assert got["Hugging Face cache"] == shape.params * 2 and 15e9 < got["Hugging Face cache"] < 17e9
    assert got["vLLM environment"] == disk_plan.VLLM_ENV_BYTES  # eval.backend vllm, the env absent
    assert export < got["MLflow artifacts"] < export + 10 * 2**20
    assert plan.total == sum(got.values())
    # once done, only QAD's resume checkpoints are gone: its float32 weights and AdamW state, twice
    assert plan.total - plan.kept == costs.disk_bytes("qad", params, shape) - costs.kept_bytes("qad", params, shape)
    assert plan.total - plan.kept == 2 * shape.params * 12


def test_a_cached_teacher_is_named_and_a_local_model_downloads_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("QAD_VLLM_ENV", str(tmp_path))
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "python").write_text("")  # the env exists
    _, estimates, plan = planned(PROJECT_PARAMS, ["qad.teacher=cached"], tmp_path / "run")
    got = terms(plan)
    assert got["teacher cache"] == next(e.disk_bytes for e in estimates if e.stage == "teacher_cache") > 0
    assert got["Hugging Face cache"] == 0 and got["vLLM environment"] == 0


def test_the_dvc_cache_copies_the_outputs_when_the_run_is_recorded_or_pushed(tmp_path, monkeypatch):
    project = tmp_path / "project"
    (project / ".dvc").mkdir(parents=True)
    shutil.copy(PROJECT_PARAMS, project / "params.yaml")
    for folder in ("recipes", "demo", "data", "eval_tasks"):  # what its relative paths name
        (project / folder).symlink_to(PROJECT_ROOT / folder)
    (project / "dvc.yaml").write_text("stages: {}\n")
    params, estimates, plan = planned(project / "params.yaml", root=project)
    outputs = sum(costs.kept_bytes(e.stage, params, model_shape(params.base_model)) for e in estimates)
    assert terms(plan)["DVC cache"] == outputs > 0 and terms(plan)["DVC remote"] == 0
    _, _, changed = planned(project / "params.yaml", ["qad.steps=3"], project)  # not what dvc.yaml describes
    assert terms(changed)["DVC cache"] == 0
    monkeypatch.setenv("QAD_DVC_REMOTE", str(tmp_path / "remote"))  # a run folder with a local remote
    _, _, pushed = planned(PROJECT_PARAMS, root=tmp_path / "run")
    assert terms(pushed)["DVC cache"] == terms(pushed)["DVC remote"] == outputs


def test_the_plan_prints_its_out_root_and_every_term(tmp_path, monkeypatch):
    monkeypatch.chdir(PROJECT_ROOT)
    text = CliRunner().invoke(app, ["plan", "--params", str(PROFILE)]).output
    lines = text.splitlines()
    assert f"out-root: {PROJECT_ROOT / 'runs' / 'llama-3.1-8b_8xh100'}" in lines
    disk = next(line for line in lines if line.startswith("disk: "))
    for name in ("stages", "MLflow artifacts", "Hugging Face cache", "vLLM environment"):
        assert f" {name} " in disk, disk
    given = CliRunner().invoke(app, ["plan", "--params", str(PROFILE), "--out-root", str(tmp_path)]).output
    assert f"out-root: {tmp_path.resolve()}" in given.splitlines()
