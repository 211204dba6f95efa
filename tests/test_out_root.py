"""Where a run writes by default (`layout.output_root`): never into the source tree's tracked
folders; `--out-root` first, then $QAD_OUT_ROOT, then a params file's own folder outside the tree."""

import shutil
import subprocess

import pytest
import yaml

from qad_pipeline.core.config import PROJECT_PARAMS, PROJECT_ROOT
from qad_pipeline.core.layout import OUT_ROOT_ENV, output_root

PROFILE = PROJECT_ROOT / "profiles" / "llama-3.1-8b_8xh100.yaml"


@pytest.fixture(autouse=True)
def no_env_root(monkeypatch):
    monkeypatch.delenv(OUT_ROOT_ENV, raising=False)


def ignored_by_git(path) -> bool:
    if not (PROJECT_ROOT / ".git").exists():
        pytest.skip("not a git checkout (the image): git's ignore rules cannot be asked")
    done = subprocess.run(["git", "check-ignore", "-q", str(path)], cwd=PROJECT_ROOT)
    return done.returncode == 0


def test_the_projects_own_params_files_run_under_runs_not_beside_them(monkeypatch):
    monkeypatch.chdir(PROJECT_ROOT)
    assert output_root(None, "params.yaml") == PROJECT_ROOT / "runs" / "params"
    assert output_root(None, PROFILE) == PROJECT_ROOT / "runs" / "llama-3.1-8b_8xh100"
    assert ignored_by_git(PROJECT_ROOT / "runs" / "params" / "artifacts" / "export" / "model.safetensors")
    dvc_ignored = [line.strip() for line in (PROJECT_ROOT / ".dvcignore").read_text().splitlines()]
    assert "/runs/" in dvc_ignored  # `dvc status` does not walk the runs' checkpoints
    monkeypatch.chdir(PROJECT_ROOT / "profiles")  # inside the tree: still the tree's ignored runs/
    assert output_root(None, PROFILE) == PROJECT_ROOT / "runs" / "llama-3.1-8b_8xh100"


def test_a_working_directory_outside_the_tree_gets_its_own_runs_folder(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)  # e.g. an installed copy run from a scratch folder
    assert output_root(None, PROJECT_PARAMS) == tmp_path.resolve() / "runs" / "params"


def test_a_params_file_of_your_own_keeps_its_folder(tmp_path, monkeypatch):
    own = tmp_path / "project"
    own.mkdir()
    shutil.copy(PROJECT_PARAMS, own / "params.yaml")
    monkeypatch.chdir(PROJECT_ROOT)
    assert output_root(None, own / "params.yaml") == own.resolve()


def test_qad_out_root_holds_each_run_by_its_params_stem_and_out_root_wins(tmp_path, monkeypatch):
    monkeypatch.setenv(OUT_ROOT_ENV, str(tmp_path / "runs"))
    assert output_root(None, PROFILE) == tmp_path.resolve() / "runs" / "llama-3.1-8b_8xh100"
    own = tmp_path / "own.yaml"
    own.write_text(PROJECT_PARAMS.read_text())
    assert output_root(None, own) == tmp_path.resolve() / "runs" / "own"
    assert output_root(tmp_path / "given", PROFILE) == tmp_path.resolve() / "given"


def test_dvc_repro_writes_where_dvc_yaml_declares_its_outputs():
    """dvc.yaml's outputs are relative to its folder, whatever a run's default out-root is."""
    stages = yaml.safe_load((PROJECT_ROOT / "dvc.yaml").read_text())["stages"]
    commands = {name: (stage.get("do") or stage)["cmd"] for name, stage in stages.items()}
    assert commands and all(cmd.split()[-2:] == ["--out-root", "."] for cmd in commands.values()), commands
