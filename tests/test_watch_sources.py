"""The watcher's sources (`flows/watch_sources.py`): how a run's parameters are made from its
source, and the one-line refusal of a bad source. No Prefect server: tests/test_watcher.py starts
the flow against one and reads the runs it creates."""

from pathlib import Path

import pytest
import yaml

from flows.watch_sources import WatchedSource, check_sources, legacy_sources, run_parameters
from qad_pipeline.core.config import PROJECT_PARAMS, PROJECT_ROOT, ConfigError, load_params


def write_profile(path: Path, **changes) -> Path:
    """params.yaml with `changes` ({"qad.steps": 7}), its recipes found from anywhere."""
    data = yaml.safe_load(PROJECT_PARAMS.read_text())
    for key, value in {"ptq.recipe_dir": str(PROJECT_ROOT / "recipes"), **changes}.items():
        section, name = key.split(".")
        assert name in data[section], key
        data[section][name] = value
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def test_a_run_gets_its_source_params_file_and_overrides_with_the_checkpoint_merged_in(tmp_path, monkeypatch):
    profile = write_profile(tmp_path / "profiles" / "p.yaml", **{"qad.steps": 9})
    monkeypatch.chdir(tmp_path)
    source = WatchedSource(hub_id="org/M", params_file="profiles/p.yaml", overrides=["qad.steps=12", "eval.limit=4"])
    parameters = run_parameters(source, "org/M", "c" * 40, ["eval.limit=2", "qad.lr=0.001"], "runs/m")
    assert parameters == {
        "params_file": str(profile),  # absolute, resolved here
        "overrides": ["eval.limit=2", "qad.lr=0.001", "qad.steps=12", "eval.limit=4",
                      'base_model.path="org/M"', f'base_model.revision="{"c" * 40}"'],
        "base_model": None, "out_root": "runs/m"}
    params = load_params(Path(parameters["params_file"]), parameters["overrides"])
    # the source's overrides win over the deployment's, the watcher's over both
    assert (params.eval.limit, params.qad.lr, params.qad.steps) == (4, 0.001, 12)
    assert (params.base_model.path, params.base_model.revision) == ("org/M", "c" * 40)

    # a folder: no revision; any folder name stays a string
    odd = str(tmp_path / "my model #2: v1")
    folder = run_parameters(WatchedSource(watch_dir="x"), odd, None, [], "runs/f")
    assert folder["params_file"] == str(tmp_path / "params.yaml") and len(folder["overrides"]) == 1
    assert load_params(PROJECT_PARAMS, folder["overrides"]).base_model.path == odd

    # a source that sets the pools its runs use: they replace the deployment's; unset, the deployment's stay
    pooled = run_parameters(WatchedSource(watch_dir="x", stage_deployment="gpu-stage/gpu-4"), odd, None, [], "runs/f")
    assert pooled == {**folder, "stage_deployment": "gpu-stage/gpu-4"}

    assert legacy_sources("checkpoints", ["a/b"]) == [WatchedSource(watch_dir="checkpoints"),
                                                      WatchedSource(hub_id="a/b", params_file="params.yaml")]


def test_a_bad_source_is_refused_in_one_line_naming_it(tmp_path):
    profile = write_profile(tmp_path / "p.yaml", **{"qad.steps": 5})
    (tmp_path / "incoming").mkdir()
    good = WatchedSource(watch_dir=str(tmp_path / "incoming"), params_file=str(profile))
    check_sources([good, WatchedSource(hub_id="org/M", params_file=str(profile), overrides=["qad.steps=8"])])

    for bad, says in [
        (dict(params_file=str(profile), overrides=["qad.steps=0"]),
         f"source hub_id org/M: {profile}: qad.steps = 0: Input should be greater than 0"),
        (dict(overrides=["qad.stepz=3"]), "source hub_id org/M: unknown key 'qad.stepz': qad has"),
        (dict(overrides=["qad.steps"]),
         "source hub_id org/M: override 'qad.steps' is not of the form section.key=value"),
        (dict(params_file=str(tmp_path / "none.yaml")),
         f"source hub_id org/M: params file '{tmp_path / 'none.yaml'}' does not exist"),
        (dict(overrides=["ptq.recipes=[nvfp4_nope]"]), "source hub_id org/M: unknown recipe 'nvfp4_nope'"),
        (dict(overrides=["base_model.path=other/model"]),
         "source hub_id org/M: override 'base_model.path=other/model' sets base_model.path, which the watcher sets"),
        (dict(overrides=["base_model.revision=main"]),
         "source hub_id org/M: override 'base_model.revision=main' sets base_model.revision, which the watcher sets"),
    ]:
        with pytest.raises(ConfigError) as err:
            check_sources([good, WatchedSource(hub_id="org/M", **bad)])
        assert str(err.value).startswith(says) and "\n" not in str(err.value), (says, str(err.value))

    missing = WatchedSource(watch_dir=str(tmp_path / "missing"))
    with pytest.raises(ConfigError, match=f"^source watch_dir {tmp_path / 'missing'}: watch_dir .* is not a folder$"):
        check_sources([good, missing])
    with pytest.raises(ConfigError, match="^source watch_dir .*incoming: given twice"):
        check_sources([good, WatchedSource(watch_dir=str(tmp_path / "." / "incoming"))])
    for neither_or_both in [{}, {"watch_dir": "x", "hub_id": "a/b"}]:
        with pytest.raises(ValueError, match="a source watches exactly one of watch_dir and hub_id"):
            WatchedSource(**neither_or_both)


def test_prefect_yaml_sources_fit_the_watcher_deployment_schema():
    """The cron deployment's sources are valid flow parameters; a misspelt key is refused by the
    deployment's schema, before a run exists."""
    from prefect.utilities.callables import parameter_schema
    from prefect.utilities.schema_tools.validation import ValidationError, validate

    from flows.watcher import watch_base_checkpoints

    [cron] = [d for d in yaml.safe_load((PROJECT_ROOT / "prefect.yaml").read_text())["deployments"]
              if d["entrypoint"] == "flows.watcher:watch_base_checkpoints"]
    schema = parameter_schema(watch_base_checkpoints.fn).model_dump_for_openapi()
    validate(cron["parameters"], schema, raise_on_error=True)
    assert all(isinstance(s, WatchedSource) for s in watch_base_checkpoints.validate_parameters(
        cron["parameters"])["sources"])
    with pytest.raises(ValidationError, match="'param_file' was unexpected"):
        validate({"sources": [{"watch_dir": "checkpoints", "param_file": "p.yaml"}]}, schema, raise_on_error=True)
