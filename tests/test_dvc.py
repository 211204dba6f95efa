"""`dvc repro` runs the same DAG, for real, in a temporary git repository with the project's files.

One `qad-pipeline run` (the Prefect flow) is shared by the tests of this module: `dvc repro` right
after it has nothing to do; then they change one thing at a time and `dvc repro` runs what it must.
"""

import json
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from tests.devstack import make_dvc_project, set_params, sh, tool_env
from tests.conftest import GOOD_RECIPES, TINY

pytestmark = pytest.mark.slow

# the BPE sweep's branch with one budget: its search, the point, the curve; in dvc.yaml only when
# params.yaml asks for the sweep (selection.sweep), which the project's does not at first
SWEEP_STAGES = {"sweep_search", "sweep@5.0", "bpe_sweep"}
ALL_STAGES = {"calibration", "baseline", *(f"ptq@{r}" for r in GOOD_RECIPES), "selection", "qad", "final_eval",
              "export"}


def repro(repo: Path, *args: str) -> tuple[set[str], str]:
    """Run `dvc repro`; the set of stages it ran and its output."""
    done = sh(repo, "dvc", "repro", *args)
    return set(re.findall(r"Running stage '([^']+)'", done.stdout)), done.stdout


def commit(repo: Path, message: str) -> None:
    sh(repo, "git", "add", "-A")
    sh(repo, "git", "commit", "-q", "-m", message)


@pytest.fixture(scope="module")
def project(tmp_path_factory, demo_model_path):
    """A git + DVC project with the tiny settings, the base model tracked with `dvc add`, after one
    `qad-pipeline run` there (the Prefect flow). Returns (repo, the run's summary, remote)."""
    from prefect.testing.utilities import prefect_test_harness

    from flows.pipeline import qad_pipeline

    remote = tmp_path_factory.mktemp("dvc-remote")
    # the serving check has its own tests (test_serving.py, and the flow's export): here it only costs time
    repo = make_dvc_project(tmp_path_factory.mktemp("dvc-project"),
                            [*TINY, f"ptq.recipes=[{', '.join(GOOD_RECIPES)}]", "export.serving_check=skip",
                             "sweep.budgets=[5.0]"], remote)
    with prefect_test_harness(server_startup_timeout=120):
        summary = qad_pipeline(params_file=str(repo / "params.yaml"))
    commit(repo, "first run")
    return repo, summary, remote


def test_a_run_then_repro_has_nothing_to_do(project):
    repo, summary, _ = project
    assert summary["dvc"].startswith("recorded in DVC"), summary["dvc"]
    assert "Data and pipelines are up to date" in sh(repo, "dvc", "status").stdout
    assert not (repo / ".dvc/tmp/rwlock").exists() or "artifacts" not in (repo / ".dvc/tmp/rwlock").read_text()
    lock = yaml.safe_load((repo / "dvc.lock").read_text())["stages"]
    assert set(lock) == ALL_STAGES
    # each stage records exactly its params: QAD's keys are in qad's entry and in no PTQ entry
    assert "qad" in lock["qad"]["params"]["params.yaml"]
    assert all("qad" not in lock[f"ptq@{r}"]["params"]["params.yaml"] for r in GOOD_RECIPES)

    again, out = repro(repo)
    assert again == set(), out
    assert len(re.findall(r"Stage .* didn.t change, skipping", out)) == len(ALL_STAGES)


def test_qad_parameter_reruns_qad_and_what_follows(project):
    repo = project[0]
    set_params(repo, ["qad.steps=3"])
    ran, _ = repro(repo)
    assert ran == {"qad", "final_eval", "export"}
    assert json.loads((repo / "artifacts/qad/loss.json").read_text())["steps"] == 3

    params_diff = json.loads(sh(repo, "dvc", "params", "diff", "--json").stdout)
    assert params_diff["params.yaml"]["qad.steps"]["old"] == 4 and params_diff["params.yaml"]["qad.steps"]["new"] == 3
    metrics_diff = json.loads(sh(repo, "dvc", "metrics", "diff", "--json").stdout)
    assert "metrics/qad.json" in metrics_diff
    plots = json.loads(sh(repo, "dvc", "plots", "diff", "HEAD", "--json").stdout)["data"]
    loss_revs = {row["rev"] for row in plots["metrics/qad_loss.json"][0]["content"]["data"]["values"]}
    assert loss_revs == {"HEAD", "workspace"}  # the loss curves of both versions, side by side
    commit(repo, "qad.steps=3")


def test_one_recipe_file_reruns_that_recipe_only(project):
    repo = project[0]
    changed, untouched = GOOD_RECIPES
    recipe = repo / "recipes" / f"{changed}.yaml"
    recipe.write_text(recipe.read_text() + "\n# changed: one recipe file\n")
    ran, _ = repro(repo)
    assert f"ptq@{changed}" in ran and "selection" in ran
    assert not ran & {f"ptq@{untouched}", "calibration", "baseline", *SWEEP_STAGES}
    commit(repo, "one recipe changed")


def test_new_base_checkpoint_version_is_a_dvc_change(project):
    repo = project[0]
    (repo / "models/base/README.md").write_text("a new version of the base checkpoint\n")
    sh(repo, "dvc", "add", "-q", "models/base")
    assert "models/base.dvc" in sh(repo, "git", "status", "--porcelain").stdout
    dry, _ = repro(repo, "--dry")
    # every stage that reads the base model is out of date (selection only reads results)
    assert dry == ALL_STAGES - {"selection"}
    sh(repo, "git", "checkout", "-q", "models/base.dvc")
    sh(repo, "dvc", "checkout", "-q", "--force", "models/base.dvc")
    assert not (repo / "models/base/README.md").exists()
    assert "Data and pipelines are up to date" in sh(repo, "dvc", "status").stdout


def test_repro_refused_while_a_run_writes_the_outputs(project):
    repo = project[0]
    manifest = (repo / "artifacts/calibration/manifest.json").read_bytes()
    holder = subprocess.Popen(
        [sys.executable, "-c",
         "import sys, time\n"
         "from qad_pipeline.platform.runlock import dvc_write_lock, run_lock\n"
         f"with run_lock({str(repo)!r}, 'run'), dvc_write_lock({str(repo)!r}, 'qad-pipeline run (Prefect flow run x)'):\n"
         "    print('held', flush=True); time.sleep(60)\n"],
        stdout=subprocess.PIPE, text=True, env=tool_env())
    try:
        assert holder.stdout.readline().strip() == "held"
        done = sh(repo, "dvc", "repro", "-f", "calibration", check=False)
        assert done.returncode != 0
        assert "is busy" in done.stderr and "qad-pipeline run (Prefect flow run x)" in done.stderr
        # a stage started by hand is refused by the run's own lock, naming the run
        stage = sh(repo, "qad-pipeline", "stage", "selection", check=False)
        assert stage.returncode == 2 and "being written by another qad-pipeline run" in stage.stderr
    finally:
        holder.kill()
        holder.wait()
    assert (repo / "artifacts/calibration/manifest.json").read_bytes() == manifest  # nothing deleted or mixed
    assert "Data and pipelines are up to date" in sh(repo, "dvc", "status").stdout


def test_push_pull_and_a_missing_remote(project):
    repo, _, remote = project
    sh(repo, "dvc", "push", "-q")
    assert any(p.is_file() for p in Path(remote).rglob("*"))
    shutil.rmtree(repo / "artifacts" / "export")
    shutil.rmtree(repo / ".dvc" / "cache")
    sh(repo, "dvc", "pull", "-q")
    assert (repo / "artifacts/export/hf_quant_config.json").is_file()
    assert "Data and pipelines are up to date" in sh(repo, "dvc", "status").stdout

    sh(repo, "dvc", "remote", "add", "gone", "/proc/no-such-remote")
    done = sh(repo, "dvc", "push", "-r", "gone", check=False)
    assert done.returncode != 0 and "/proc/no-such-remote" in done.stderr
    assert "Data and pipelines are up to date" in sh(repo, "dvc", "status").stdout  # nothing lost locally
    sh(repo, "dvc", "remote", "remove", "gone")


def test_a_run_in_the_project_pushes_its_stages_to_the_configured_remote(project, tmp_path):
    from qad_pipeline.platform.dvc_remote import after_run
    from qad_pipeline.core.remote_config import RemoteParams

    repo = project[0]
    ran = [(name.split("@")[0], name.partition("@")[2] or None) for name in sorted(ALL_STAGES)]
    committed_config = (repo / ".dvc/config").read_text()
    kept = RemoteParams(url=str(tmp_path / "kept"), push=False)
    done, line = after_run(repo, repo / "params.yaml", [f"versioning.remote={{url: {kept.url}, push: false}}"], ran, kept)
    assert done and line.startswith("recorded in DVC") and "not pushed (versioning.remote.push is false)" in line
    assert not (tmp_path / "kept").exists()
    remote = RemoteParams(url=str(tmp_path / "runs-remote"))
    done, line = after_run(repo, repo / "params.yaml", [], ran, remote)
    assert done and f"pushed to DVC remote {remote.url}" in line, line
    assert sum(p.is_file() for p in (tmp_path / "runs-remote").rglob("*")) > 10
    assert remote.url in (repo / ".dvc/config.local").read_text()
    assert (repo / ".dvc/config").read_text() == committed_config  # the project's committed config is untouched
    assert "Data and pipelines are up to date" in sh(repo, "dvc", "status").stdout


def test_stale_lock_of_a_killed_run_is_reported_and_recovered(project):
    repo = project[0]
    (repo / ".qad-pipeline.lock").write_text(json.dumps(
        {"token": "dead", "pid": 999999, "host": "vm", "started": time.time() - 60,
         "command": "qad-pipeline run", "finished": False}))
    done = sh(repo, "qad-pipeline", "stage", "selection")
    assert "was killed before it finished" in done.stderr
    assert json.loads((repo / ".qad-pipeline.lock").read_text())["finished"] is True


def test_a_run_that_overrides_params_is_not_recorded(project):
    from qad_pipeline.platform import versioning

    repo = project[0]
    assert versioning.why_not_recorded(repo, repo / "params.yaml", [f"ptq.recipes=[{', '.join(GOOD_RECIPES)}]"]) is None
    reason = versioning.why_not_recorded(repo, repo / "params.yaml", ["qad.steps=9"])
    assert reason.startswith("the run overrode params.yaml (qad.steps=9)")


def test_the_sweep_runs_under_dvc_when_the_params_ask_for_it(project):
    repo = project[0]
    set_params(repo, ["selection.sweep=knee"])
    sh(repo, "qad-pipeline", "dvc-yaml", "--params", "params.yaml")
    assert {"sweep_search", "sweep", "bpe_sweep"} <= set(yaml.safe_load((repo / "dvc.yaml").read_text())["stages"])
    ran, _ = repro(repo, "bpe_sweep")
    assert ran == SWEEP_STAGES  # the curve and what it needs; calibration, baseline and the recipes are current
    sweep = json.loads((repo / "metrics/bpe_sweep.json").read_text())
    assert [p["budget"] for p in sweep["points"]] == [5.0] and sweep["knee"]["name"].endswith("@5.0")
    assert len(sweep["fixed"]) == len(GOOD_RECIPES) and (repo / "artifacts/bpe_sweep/pareto.png").is_file()
