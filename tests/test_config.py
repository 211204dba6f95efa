"""params.yaml loading, overrides and the bad-input messages."""

import pytest

from qad_pipeline.core.config import PROJECT_PARAMS, ConfigError, load_params
from qad_pipeline.plan.preflight import check_recipes


def test_defaults_load_and_name_five_recipes_with_files():
    params = load_params()
    assert len(params.ptq.recipes) == 5
    check_recipes(params)


def test_override_is_typed():
    params = load_params(overrides=["calibration.num_samples=7", "selection.band=[0.9, 0.98]"])
    assert params.calibration.num_samples == 7
    assert params.selection.band == (0.9, 0.98)


@pytest.mark.parametrize(
    "override, message",
    [
        ("calibration.num_sample=3", "unknown key 'calibration.num_sample'"),
        ("calibrate.seq_len=3", "unknown key 'calibrate.seq_len'"),
        ("calibration.seq_len=-1", "calibration.seq_len = -1"),
        ("selection.policy=best", "selection.policy = 'best'"),
        ("noequals", "not of the form section.key=value"),
    ],
)
def test_bad_override_names_the_key(override, message):
    with pytest.raises(ConfigError, match=message.replace(".", r"\.").replace("[", r"\[")):
        load_params(overrides=[override])


def test_misspelt_key_in_params_file(tmp_path):
    bad = tmp_path / "params.yaml"
    text = PROJECT_PARAMS.read_text().replace("num_samples:", "num_sampels:")
    bad.write_text(text)
    with pytest.raises(ConfigError, match="unknown key 'calibration.num_sampels'"):
        load_params(bad)


def test_unknown_recipe_lists_available():
    params = load_params(overrides={"ptq.recipes": ["nvfp4_max-mamba_fp8-kv_fp8", "nvfp4_typo"]})
    with pytest.raises(ConfigError, match=r"unknown recipe 'nvfp4_typo'.*available: \["):
        check_recipes(params)


def test_every_code_default_is_params_yaml_value():
    """params.yaml is the home of every default: where a pydantic field has one too, they agree,
    and params.yaml spells out every key."""
    import yaml
    from pydantic_core import PydanticUndefined

    from qad_pipeline.core.config import Params

    written = yaml.safe_load(PROJECT_PARAMS.read_text())
    for section, info in Params.model_fields.items():
        model = info.annotation
        assert set(written[section]) == set(model.model_fields), section
        for key, field in model.model_fields.items():
            if field.default is not PydanticUndefined:
                assert written[section][key] == field.default, f"{section}.{key}"
