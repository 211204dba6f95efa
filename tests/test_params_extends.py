"""`extends:` in a params file (qad_pipeline/core/params_files.py): the profiles state only what differs
from params.yaml, and load as the full copies they replaced did."""

import os
import typing
from pathlib import Path

import pytest
import yaml
from pydantic import BaseModel
from typer.testing import CliRunner

from qad_pipeline.cli import app
from qad_pipeline.core.config import PROJECT_PARAMS, PROJECT_ROOT, ConfigError, Params, load_params, resolve
from qad_pipeline.core.params_files import PATH_KEYS, inheritance_line, read_params_file
from qad_pipeline.platform.versioning import why_not_recorded, write_dvc_yaml

PROFILES = PROJECT_ROOT / "profiles"
LLAMA, QWEN = PROFILES / "llama-3.1-8b_8xh100.yaml", PROFILES / "qwen3-30b-a3b_8xb200.yaml"
# What the full profiles (before `extends`) restated from params.yaml, or left to the model's
# defaults (the last line): each profile still gets every one of these values.
INHERITED = {
    "base_model.revision": None, "base_model.trust_remote_code": False, "base_model.dtype": "bfloat16",
    "hardware.device": "auto", "hardware.max_memory": None, "hardware.host_memory_gb": None,
    "hardware.pool_gpus": None, "calibration.split": "train", "calibration.seed": 0, "ptq.recipe_dir": "../recipes",
    "ptq.max_parallel": "auto", "ptq.gpus_per_recipe": "auto", "eval.task_dir": "../eval_tasks", "eval.num_cloze": 300,
    "eval.num_continuation": 200, "eval.limit": None, "eval.kl_top_k": 32, "eval.kl_tail_samples": 32,
    "race.enabled": False, "race.fractions": [0.25, 0.5, 1.0], "race.confidence": 0.95, "race.seed": 0,
    "selection.band": (0.95, 0.99), "selection.ptq_final_min": 0.99, "selection.sweep": "none",
    "sweep.recipe": "autoquant_4o6-fp8-kv_fp8", "sweep.knee_epsilon": 0.01, "qad.schedule": "cosine",
    "qad.weight_decay": 0.0, "qad.batch_size": 8, "qad.temperature": 1.0, "qad.seed": 0, "qad.sharding": "fsdp",
    "qad.num_nodes": 1, "qad.offload": False, "qad.rdzv_endpoint": None, "qad.teacher": "live",
    "qad.teacher_top_k": 32, "qad.teacher_tail_samples": 32, "export.serving_check": "auto", "export.source": "auto",
    "calibration.revision": None, "ptq.layerwise": "auto", "qad.chunked_loss": True, "qad.compile": False,
    "versioning.remote": None,
}


def value(params: Params, dotted: str):
    section, key = dotted.split(".")
    return getattr(getattr(params, section), key)


# device_map: both inherit params.yaml's auto (the Llama profile's full copy said single: one GPU per recipe,
# which auto settles to for a 16 GB model)
@pytest.mark.parametrize("profile, device_map, policy", [(LLAMA, "auto", "qad"), (QWEN, "auto", "ptq_final")])
def test_a_profile_gets_what_its_full_copy_stated(profile, device_map, policy):
    params = load_params(profile)
    assert {key: value(params, key) for key in INHERITED} == INHERITED
    assert (params.hardware.device_map, params.selection.policy) == (device_map, policy)
    stated = read_params_file(profile).stated  # and what it states itself
    assert all(value(params, f"{s}.{k}") == (tuple(v) if k == "band" else v)
               for s, keys in stated.items() for k, v in keys.items() if k != "task_settings")
    assert params.eval.task_settings["gsm8k"].filter == "strict-match"
    # inherited paths name params.yaml's files
    assert resolve(params.ptq.recipe_dir, PROFILES).resolve() == PROJECT_ROOT / "recipes"
    assert params.recipe_path("nvfp4_max-mamba_fp8-kv_fp8", PROFILES).is_file()
    assert resolve(params.eval.task_dir, PROFILES).resolve() == PROJECT_ROOT / "eval_tasks"


@pytest.mark.parametrize("profile", [LLAMA, QWEN])
def test_a_profile_extends_params_yaml_and_states_only_what_differs(profile):
    file = read_params_file(profile)
    assert file.parent.path.resolve() == PROJECT_PARAMS
    stated = [f"{section}.{key}" for section, keys in file.stated.items() for key in keys]
    assert file.changed() == stated, "a profile restates a key with params.yaml's value"


def test_the_plan_names_what_a_profile_extends(monkeypatch):
    monkeypatch.chdir(PROJECT_ROOT)
    assert inheritance_line(Path("profiles/llama-3.1-8b_8xh100.yaml")) == (
        "params: profiles/llama-3.1-8b_8xh100.yaml (extends params.yaml; 28 keys differ)")
    assert inheritance_line(Path("params.yaml")) is None
    out = CliRunner().invoke(app, ["plan", "--params", "profiles/qwen3-30b-a3b_8xb200.yaml"]).output
    assert out.splitlines()[0] == "params: profiles/qwen3-30b-a3b_8xb200.yaml (extends params.yaml; 29 keys differ)"


def write(path: Path, data: dict) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


@pytest.fixture
def project(tmp_path):
    """tmp/params.yaml (the project's, with its own recipes/ and a local calibration folder) and
    tmp/a/b/child.yaml that extends it."""
    data = yaml.safe_load(PROJECT_PARAMS.read_text())
    data["ptq"]["recipe_dir"] = "my_recipes"  # does not exist yet: a folder key is a path anyway
    data["calibration"]["source"] = "docs"  # exists: local
    data["qad"]["source"] = "org/text"  # a hub id
    data["base_model"]["path"] = str(PROJECT_ROOT / "demo" / "model")  # absolute
    data["eval"]["task_settings"] = {"heldout_cloze": {"limit": 5, "num_fewshot": 1}}
    (tmp_path / "docs").mkdir()
    write(tmp_path / "params.yaml", data)
    return tmp_path


def test_inherited_paths_still_name_the_parents_files_and_mappings_merge(project):
    child = write(project / "a" / "b" / "child.yaml", {
        "extends": "../../params.yaml", "qad": {"steps": 3},
        "eval": {"tasks": ["heldout_cloze"], "task_settings": {"heldout_cloze": {"limit": 7}}}})
    params = load_params(child)
    folder = child.parent
    assert params.ptq.recipe_dir == os.path.join("..", "..", "my_recipes")
    assert resolve(params.ptq.recipe_dir, folder).resolve() == project / "my_recipes"
    assert resolve(params.calibration.source, folder).resolve() == project / "docs"
    assert params.qad.source == "org/text"  # a hub id is no path
    assert params.base_model.path == str(PROJECT_ROOT / "demo" / "model")
    assert params.eval.task_dir == os.path.join("..", "..", "eval_tasks")
    assert params.qad.steps == 3 and params.eval.tasks == ["heldout_cloze"]  # scalars and lists replace
    assert (params.eval.task_settings["heldout_cloze"].limit, params.eval.task_settings["heldout_cloze"].num_fewshot
            ) == (7, 1)  # mappings merge key by key
    # a chain: each level's paths relative to the file that states them
    grandchild = write(project / "c" / "g.yaml", {"extends": "../a/b/child.yaml", "ptq": {"calib_batch_size": 2}})
    chained = load_params(grandchild)
    assert resolve(chained.ptq.recipe_dir, grandchild.parent).resolve() == project / "my_recipes"
    assert (chained.qad.steps, chained.ptq.calib_batch_size) == (3, 2)
    assert inheritance_line(grandchild) == (f"params: {grandchild} (extends {child}, which extends "
                                            f"{project / 'params.yaml'}; 1 key differs)")


def test_overrides_apply_to_inherited_keys(project):
    child = write(project / "p" / "child.yaml", {"extends": "../params.yaml"})
    assert load_params(child, ["qad.compile=true", "eval.limit=4"]).qad.compile is True
    with pytest.raises(ConfigError, match="unknown key 'extends'"):
        load_params(child, ["extends=other.yaml"])
    # a bad value from --set names the file given, not the parent that states the key
    with pytest.raises(ConfigError, match=rf"^{child}: qad\.steps = -1"):
        load_params(child, ["qad.steps=-1"])


def test_bad_extends_is_one_line_naming_the_file(project):
    child = project / "p" / "child.yaml"
    cases = [
        ({"extends": "../nowhere.yaml"}, rf"{child}: extends '../nowhere.yaml', but there is no file"),
        ({"extends": 3}, rf"{child}: extends = 3: give the params file it extends"),
        ({"extends": "child.yaml"}, r"extends 'child.yaml', which extends .* again \(a cycle\)"),
        ({"extends": "../params.yaml", "qad": {"stepz": 3}}, rf"^{child}: unknown key 'qad.stepz'"),
    ]
    for data, message in cases:
        write(child, data)
        with pytest.raises(ConfigError, match=message):
            load_params(child)
    other = write(project / "p" / "other.yaml", {"extends": "child.yaml"})
    write(child, {"extends": "other.yaml"})
    with pytest.raises(ConfigError, match=r"\(a cycle\)"):
        load_params(child)
    # an unknown key a parent states is that file's error
    write(other, {"extends": "../params.yaml", "eval": {"limt": 3}})
    write(child, {"extends": "other.yaml"})
    with pytest.raises(ConfigError, match=rf"^{other} \(extended by {child}\): unknown key 'eval.limt'"):
        load_params(child)


def test_dvc_never_reads_a_file_that_extends(project):
    child = write(project / "params.yaml.d" / "params.yaml", {"extends": "../params.yaml"})
    with pytest.raises(ConfigError, match="does not follow extends"):
        write_dvc_yaml(child, check=True)
    (child.parent / ".dvc").mkdir()
    (child.parent / "dvc.yaml").write_text("stages: {}\n")
    assert "DVC does not follow" in why_not_recorded(child.parent, child, [])


def leaf_strings(model: type[BaseModel], prefix: str = "") -> list[str]:
    """Every key of the model (nested models too) whose value is or holds a string."""
    found = []
    for name, field in model.model_fields.items():
        args, kinds = [field.annotation], set()
        while args:
            arg = args.pop()
            kinds.add(arg)
            args += typing.get_args(arg)
        for kind in kinds:
            if isinstance(kind, type) and issubclass(kind, BaseModel):
                found += leaf_strings(kind, f"{prefix}{name}.")
        if str in kinds:
            found.append(f"{prefix}{name}")
    return found


NOT_PATHS = {  # string-valued keys that are no relative paths, and why
    "base_model.revision": "a hub revision", "hardware.max_memory": "sizes", "hardware.target": "a node's GPUs",
    "calibration.dataset_config": "a hub name", "calibration.split": "a hub name", "calibration.text_field": "a column",
    "calibration.revision": "a hub revision", "ptq.recipes": "names in recipe_dir", "eval.tasks": "task names",
    "eval.task_settings": "task names", "eval.task_settings.gen_kwargs": "generation settings",
    "eval.task_settings.metric": "a metric", "eval.task_settings.filter": "a filter", "sweep.recipe": "a name",
    "qad.rdzv_endpoint": "host:port", "export.source": "auto | qad | ptq/<recipe>",
    "versioning.remote.url": "s3:// or an absolute folder", "versioning.remote.endpoint_url": "a URL",
    "versioning.remote.region": "a region",
}


def test_every_string_key_is_a_listed_path_or_known_not_to_be_one():
    found = leaf_strings(Params)
    assert not set(PATH_KEYS) & set(NOT_PATHS)
    assert sorted(found) == sorted([*PATH_KEYS, *NOT_PATHS]), (
        "a new string-valued key: a relative path in a params file goes in params_files.PATH_KEYS (rewritten when "
        "inherited), anything else in NOT_PATHS here")
