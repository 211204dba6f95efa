"""The export's checks (formats, size, lint, reload) pass on a real export and fail on deliberately broken ones."""

import pytest
import torch

from qad_pipeline.core.artifacts import read_json
from qad_pipeline.core.calibration_data import load_ppl_windows
from qad_pipeline.core.config import ConfigError, load_params
from qad_pipeline.checks.export_checks import check_formats, check_reload, check_size, read_tensors, reload_reference
from qad_pipeline.checks.export_lint import lint, student_input_scales
from qad_pipeline.core.modeling import load_model
from qad_pipeline.nvfp4.sizes import size_report
from tasks.export import check_target


@pytest.fixture(scope="module")
def exported(pipeline_run):
    _, layout, overrides, _ = pipeline_run
    params = load_params(overrides=overrides)
    student = load_model(params.base_model, params.hardware, folder=layout.qad / "model", dtype=torch.bfloat16)
    batch = torch.from_numpy(load_ppl_windows(layout.data)[:2])
    return {
        "layout": layout,
        "tensors": read_tensors(layout.export),
        "config": read_json(layout.export / "hf_quant_config.json"),
        "expected": size_report(student),
        **dict(zip(("reference", "noise", "quantization_kl"), reload_reference(student, batch))),
        "input_scales": student_input_scales(student),
        "batch": batch,
    }


def nvfp4_layer(tensors):
    return next(n.removesuffix(".weight") for n, t in tensors.items() if n.endswith("mixer.in_proj.weight")
                and t.dtype == torch.uint8)


@pytest.mark.slow
def test_real_export_passes_all_checks(exported):
    e = exported
    assert check_formats(e["expected"]["layer_formats"], e["tensors"], e["config"])["passed"]
    assert check_size(e["expected"]["effective_bpe"], e["tensors"])["passed"]
    assert check_reload(e["layout"].export, e["tensors"], e["reference"], e["batch"], e["noise"], e["quantization_kl"])["passed"]
    assert lint(e["tensors"], e["input_scales"]) == {"passed": True, "problems": [], "problem_count": 0}
    assert e["input_scales"]  # the demo quantizes NVFP4 activations: their scales are checked
    assert e["expected"]["layer_formats"]["lm_head.weight"] == "nvfp4"


@pytest.mark.slow
def test_formats_check_catches_nvfp4_silently_stored_as_bf16(exported):
    e = exported
    tensors = dict(e["tensors"])
    tensors["lm_head.weight"] = torch.zeros(4096, 192, dtype=torch.bfloat16)  # untied lm_head left in BF16
    for suffix in ("weight_scale", "weight_scale_2"):
        tensors.pop(f"lm_head.{suffix}")
    result = check_formats(e["expected"]["layer_formats"], tensors, e["config"])
    assert not result["passed"]
    assert any("lm_head" in p and "expected nvfp4, exported as bf16" in p for p in result["problems"])


@pytest.mark.slow
def test_formats_check_catches_config_naming_layers_that_do_not_exist(exported):
    e = exported
    config = {"quantization": {"quantized_layers": {"model.layers.0.mixer.in_proj.\x00backbone.pt_name_sentinel":
                                                    {"quant_algo": "W4A16_NVFP4"}}}}
    result = check_formats(e["expected"]["layer_formats"], e["tensors"], config)
    assert not result["passed"] and "does not hold" in result["problems"][0]


@pytest.mark.slow
def test_size_check_catches_a_checkpoint_bigger_than_the_recipe(exported):
    e = exported
    tensors = dict(e["tensors"])
    layer = nvfp4_layer(tensors)
    tensors[f"{layer}.weight_scale"] = tensors[f"{layer}.weight_scale"].float().repeat(1, 40)  # scales in FP32
    result = check_size(e["expected"]["effective_bpe"], tensors)
    assert not result["passed"] and result["relative_difference"] > 0.01


@pytest.mark.slow
def test_reload_check_catches_wrong_scales(exported):
    e = exported
    tensors = dict(e["tensors"])
    layer = nvfp4_layer(tensors)
    tensors[f"{layer}.weight_scale_2"] = tensors[f"{layer}.weight_scale_2"] * 4
    assert not check_reload(e["layout"].export, tensors, e["reference"], e["batch"], e["noise"], e["quantization_kl"])["passed"]


@pytest.mark.slow
def test_lint_names_an_expert_with_zero_scales_and_a_nan_input_scale(exported):
    """The NVFP4 failures users report: an MoE expert calibration never routed to, exported with zero
    scales (NaN in vLLM), and an input scale that is not finite; each is one line naming the tensor."""
    e = exported
    tensors = dict(e["tensors"])
    expert = next(n for n in tensors if ".experts." in n and n.endswith(".weight_scale"))
    tensors[expert] = torch.zeros_like(tensors[expert])
    inputs = next(n for n in tensors if n.endswith(".input_scale"))
    tensors[inputs] = torch.full_like(tensors[inputs], float("nan"))
    result = lint(tensors, e["input_scales"])
    assert not result["passed"]
    assert any(p.startswith(f"{expert}: ") and "not finite and > 0" in p for p in result["problems"])
    assert any(p.startswith(f"{inputs}: ") for p in result["problems"])


@pytest.mark.slow
def test_lint_names_an_input_scale_other_than_the_calibrated_one(exported):
    e = exported
    module, scale = next(iter(e["input_scales"].items()))  # NemotronH: model.* in memory, backbone.* exported
    name = f"backbone.{module.removeprefix('model.')}.input_scale"
    assert name in e["tensors"]
    tensors = {**e["tensors"], name: torch.tensor(scale * 2, dtype=torch.float32)}
    result = lint(tensors, e["input_scales"])
    assert not result["passed"] and result["problems"] == [
        f"{name}: {scale * 2:.6g}, the student's calibrated scale is {scale:.6g}"]


@pytest.mark.slow
def test_export_target_holding_another_checkpoint_is_refused(exported, tmp_path):
    check_target(exported["layout"].export, read_json(exported["layout"].export / "export_manifest.json")["source"])
    with pytest.raises(ConfigError, match="holds a different checkpoint"):
        check_target(exported["layout"].export, "another-source")
    (tmp_path / "stranger.bin").write_bytes(b"x")
    with pytest.raises(ConfigError, match="not a qad-pipeline export"):
        check_target(tmp_path, "any")
