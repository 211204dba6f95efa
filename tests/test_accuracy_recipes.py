"""The error-compensating and headroom recipes beside the seed's five (issue 40): GPTQ, a
local-Hessian scale search and activation headroom, as recipe files through Model Optimizer's own
algorithms; what the plan prices for each (GPTQ's Hessians and their layerwise bound, the local
Hessians, the weight-scale algorithm headroom delegates to). Fast: configs only, no weights."""

import pytest

from qad_pipeline.core.config import PROJECT_ROOT, BaseModelParams, ConfigError, load_params
from qad_pipeline.nvfp4.recipes import check_recipe, load_quantize_config
from qad_pipeline.plan import capacity, costs, memory
from qad_pipeline.plan.memory_model import (GPTQ_UPDATE_COPIES, MSE_SWEEP_COPIES, model_shape, scale_search,
                                            scale_sweep, stage_phases, static_block_scales)

GPTQ, HESSIAN, HEADROOM = "nvfp4_gptq-mamba_fp8-kv_fp8", "nvfp4_lhessian-mamba_fp8-kv_fp8", "nvfp4_headroom-mamba_fp8-kv_fp8"
NEW = [GPTQ, HESSIAN, HEADROOM]
MSE = "nvfp4_mse-mamba_fp8-kv_fp8"
PROFILE_8B = PROJECT_ROOT / "profiles" / "llama-3.1-8b_8xh100.yaml"
QWEN_MOE = PROJECT_ROOT / "profiles" / "qwen3-30b-a3b_8xh100.yaml"


def recipe(name):
    return PROJECT_ROOT / "recipes" / f"{name}.yaml"


@pytest.mark.parametrize("name", NEW)
def test_each_new_recipe_is_the_mse_recipes_quantizers_with_its_own_algorithm(name):
    """Same formats layer by layer as the seed's MSE recipe (only how scales and weights are chosen
    differs), validated by Model Optimizer's schema, algorithm included."""
    check_recipe(recipe(name))
    ours, seed = load_quantize_config(recipe(name)).model_dump(), load_quantize_config(recipe(MSE)).model_dump()
    assert ours["quant_cfg"] == seed["quant_cfg"]
    method = {GPTQ: "gptq", HESSIAN: "local_hessian", HEADROOM: "nvfp4_act_headroom"}[name]
    assert ours["algorithm"]["method"] == method != seed["algorithm"]["method"]


def test_what_each_algorithm_sets_decides_its_planned_phases():
    assert all(static_block_scales(recipe(n)) for n in NEW)  # block scales stored per block, like MSE's
    assert scale_search(recipe(HESSIAN)) and scale_sweep(recipe(HESSIAN))
    assert scale_search(recipe(HEADROOM)) and scale_sweep(recipe(HEADROOM))  # its weights: MSE with the sweep
    assert not scale_search(recipe(GPTQ))  # max block scales, then the rounding against them


def test_gptq_holds_one_hessian_per_quantized_weight_and_layerwise_one_layers():
    """Llama-3.1-8B: every MLP weight and the LM head (attention stays BF16) has an in x in float32
    Hessian: 32 x (2 x 4096² + 14336²) + 4096² elements at once, or one layer's with ptq.layerwise."""
    params = load_params(PROFILE_8B, [f"ptq.recipes=[{GPTQ}]"])
    shape = model_shape(params.base_model)
    h, f, layers = 4096, 14336, 32
    assert shape.hessian_elems == layers * (2 * h * h + f * f) + h * h
    assert shape.layer_hessian_elems == 2 * h * h + f * f
    gptq = next(p for p in stage_phases(f"ptq/{GPTQ}", params, shape, "cuda") if p.name == "gptq")
    assert gptq.knob == "ptq.layerwise" and gptq.transient["gptq_hessians"] == shape.hessian_elems * 4
    assert gptq.transient["gptq_update"] == shape.largest_matrix * 4 * GPTQ_UPDATE_COPIES
    assert gptq.host["original_weights"] == shape.matrix_params * 2  # BF16, for the weight error
    layerwise = load_params(PROFILE_8B, [f"ptq.recipes=[{GPTQ}]", "ptq.layerwise=true"])
    one = next(p for p in stage_phases(f"ptq/{GPTQ}", layerwise, shape, "cuda") if p.name == "gptq")
    assert one.transient["gptq_hessians"] == shape.layer_hessian_elems * 4
    assert not [p for p in stage_phases(f"ptq/{MSE}", params, shape, "cuda") if p.name == "gptq"]


def test_local_hessian_adds_a_16x16_hessian_per_block_to_a_whole_weight_search():
    params = load_params(PROFILE_8B, [f"ptq.recipes=[{HESSIAN}, {MSE}]"])
    shape = model_shape(params.base_model)
    search = {n: next(p for p in stage_phases(f"ptq/{n}", params, shape, "cuda") if p.name == "mse_search").transient
              for n in (HESSIAN, MSE)}
    assert search[HESSIAN]["local_hessians"] == shape.quantized_inputs * 16 * 4 == (32 * (2 * 4096 + 14336) + 4096) * 64
    # its metric is searched over whole weights: ptq.mse_chunk_rows bounds the plain MSE search only
    assert search[HESSIAN]["mse_search"] == shape.largest_matrix * 4 * MSE_SWEEP_COPIES > search[MSE]["mse_search"]
    assert "local_hessians" not in search[MSE]


def test_a_gptq_that_does_not_fit_whole_is_told_to_go_layer_by_layer():
    """Llama-3.1-70B: 80 layers' Hessians (~285 GiB) do not fit an H100 at once; one layer's do, and
    the refusal names the switch."""
    h100 = capacity.target_capacity("8xH100-80GB")
    big = ["base_model.path=meta-llama/Llama-3.1-70B", "hardware.device_map=auto", f"ptq.recipes=[{GPTQ}]"]
    shape = model_shape(BaseModelParams(path="meta-llama/Llama-3.1-70B"))
    assert shape.hessian_elems == 80 * (2 * 8192**2 + 28672**2) + 8192**2
    with pytest.raises(ConfigError, match=rf"ptq/{GPTQ}: needs ~\d+\.\d GiB per GPU, ~72.0 GiB is usable; "
                                          r"set ptq.layerwise=true$"):
        memory.check_fits([e for e in memory.plan(load_params(PROFILE_8B, big), h100) if e.stage.startswith("ptq/")])
    memory.check_fits([e for e in memory.plan(load_params(PROFILE_8B, [*big, "ptq.layerwise=true"]), h100)
                       if e.stage.startswith("ptq/")])


def test_fused_experts_hold_no_gptq_hessian_but_count_for_the_local_hessian_search():
    """Model Optimizer's GPTQ rounds 2-D linear weights only: Qwen3-30B-A3B's fused experts (and the
    attention it keeps BF16) leave the LM head alone with a Hessian; the local-Hessian search hooks
    the experts' inputs too."""
    shape = model_shape(BaseModelParams(path="Qwen/Qwen3-30B-A3B"))
    assert shape.hessian_elems == 2048**2
    assert shape.quantized_inputs == 48 * 128 * (2048 + 768) + 2048


def test_gptq_is_priced_beyond_its_calibration_and_the_other_recipes_as_before():
    params = load_params(PROFILE_8B, [f"ptq.recipes=[{GPTQ}, {HESSIAN}, {MSE}]"])
    shape, flops = model_shape(params.base_model), 989e12
    seconds = {n: costs.seconds(f"ptq/{n}", params, shape, flops, "H100") for n in (GPTQ, HESSIAN, MSE)}
    assert seconds[HESSIAN] == seconds[MSE]  # scale searches are not priced (costs' docstring says so)
    extra = seconds[GPTQ] - seconds[MSE]
    calib = params.calibration.num_samples * params.calibration.seq_len
    hessian_pass = (2 * shape.active_matrix_params + 2 * shape.hessian_elems) * calib / (flops * costs.EVAL_MFU)
    update = shape.gptq_update_flops / (flops * costs.GPTQ_UPDATE_MFU) + shape.quantized_inputs * costs.GPTQ_COLUMN_S
    assert extra == pytest.approx(hessian_pass + update) and extra > 0


def test_outside_the_decoder_layers_layerwise_calibration_uses_what_runs_on_weights_alone():
    """No forward reaches the LM head in Model Optimizer's layerwise mode: GPTQ's Hessian and the
    local-Hessian metric cannot be computed there, so it gets GPTQ's first step (max) or the MSE
    search the local Hessian weights; other algorithms are unchanged."""
    from qad_pipeline.nvfp4.layerwise import weight_only

    assert weight_only({"method": "gptq", "perc_damp": 0.01}) == {"method": "max"}
    assert weight_only({"method": "local_hessian", "fp8_scale_sweep": True, "block_size": 16}) == {
        "method": "mse", "fp8_scale_sweep": True}
    headroom = {"method": "nvfp4_act_headroom", "weight_scale_algorithm": {"method": "mse"}}
    assert weight_only(headroom) == headroom and weight_only({"method": "max"}) == {"method": "max"}


def test_only_gptq_rewrites_the_weights_so_only_it_keeps_the_originals_for_the_weight_error():
    from qad_pipeline.nvfp4.recipes import mutates_weights

    found = {p.stem for p in (PROJECT_ROOT / "recipes").glob("*.yaml") if mutates_weights(p)}
    assert found == {GPTQ}


def test_the_export_compares_a_gptq_source_with_the_base_model_and_every_other_with_its_student():
    """Where the recipe rewrote the weights, the student with its quantizers off is the quantized model
    itself (every gate's cap 0): the export's checks take the base model's logits instead."""
    from qad_pipeline.checks.export_verify import rewrites_weights
    from qad_pipeline.core.config import load_params

    params = load_params()
    assert rewrites_weights(params, f"ptq/{GPTQ}")
    assert not rewrites_weights(params, "ptq/nvfp4_max-mamba_fp8-kv_fp8") and not rewrites_weights(params, "qad")
    with pytest.raises(ConfigError, match="its recipe file .*no_such_recipe.yaml is gone"):
        rewrites_weights(params, "ptq/no_such_recipe")
