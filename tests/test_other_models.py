"""Any Hugging Face causal LM works as the base model: the recipes apply to what it has."""

import shutil

import pytest
import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from qad_pipeline.core.artifacts import read_json
from qad_pipeline.cli import Stage, run_stage
from qad_pipeline.core.config import load_params
from qad_pipeline.core.layout import Layout
from qad_pipeline.nvfp4.recipes import recipe_aliases
from tasks.baseline import run_baseline
from tasks.calibration import build_calibration
from tasks.ptq import run_ptq
from tests.conftest import TINY


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory, demo_model_path):
    """A tiny Llama (no Mamba, no MoE) with the demo tokenizer; its weights are random, which is
    enough to check that every recipe maps onto a different architecture."""
    folder = tmp_path_factory.mktemp("llama")
    torch.manual_seed(0)  # the same random weights whichever tests ran before
    config = LlamaConfig(vocab_size=4096, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    LlamaForCausalLM(config).save_pretrained(folder)
    AutoTokenizer.from_pretrained(demo_model_path).save_pretrained(folder)
    return folder


@pytest.mark.slow
def test_most_aggressive_recipe_on_a_llama(llama_dir, tmp_path, capsys):
    recipe = "nvfp4_4o6-mamba_w4a16-kv_nvfp4"
    params = load_params(overrides=TINY + [f"base_model.path={llama_dir}", "eval.tasks=[heldout_continuation]"])
    layout = Layout(tmp_path)
    build_calibration(params, AutoTokenizer.from_pretrained(llama_dir), layout.data)
    run_baseline(params, layout.data, layout.baseline_metrics, layout.reference)
    result = run_ptq(params, recipe, layout.data, layout.reference, layout.ptq(recipe))
    formats = result["layer_formats"]
    assert formats["lm_head.weight"] == "nvfp4"
    assert formats["model.layers.0.mlp.up_proj.weight"] == "nvfp4"
    assert formats["model.layers.0.self_attn.q_proj.weight"] == "bf16"  # attention stays BF16
    assert formats["model.embed_tokens.weight"] == "bf16"
    assert result["kv_cache"] == "nvfp4"
    # computed (the estimator is unbiased, so on this near-uniform random model it may fall just below 0)
    assert result["kl_divergence"] != 0 and abs(result["kl_divergence"]) < 1
    # every quantized weight's reconstruction error: NVFP4 on Gaussian weights loses ~10 % of the norm
    errors = result["weight_error"]
    assert set(errors["layers"]) >= {"lm_head", "model.layers.0.mlp.up_proj"}
    assert "model.layers.0.self_attn.q_proj" not in errors["layers"]  # BF16: nothing to report
    assert 0.02 < errors["median"] < 0.3
    worst = [w["error"] for w in errors["worst"]]
    assert len(worst) == 5 and worst == sorted(worst, reverse=True) and worst[0] == max(errors["layers"].values())
    assert result["settings"] == {"algorithm": "mse", "weight_scale": "four_over_six",
                                  "mamba_format": "none (no Mamba layers)", "kv_cache": "nvfp4"}
    assert (layout.ptq(recipe) / "items.json").is_file()

    # no Mamba layers: the two Mamba variants of four-over-six + FP8 KV are one model, run once
    assert recipe_aliases(params) == {"nvfp4_4o6-mamba_w4a16-kv_fp8": "nvfp4_4o6-mamba_fp8-kv_fp8"}
    # as `qad-pipeline stage ptq` runs it (the flow's and DVC's way): the stub, and a line saying so
    run_stage(Stage.ptq, params, layout, "nvfp4_4o6-mamba_w4a16-kv_fp8")
    assert "the same model as nvfp4_4o6-mamba_fp8-kv_fp8" in capsys.readouterr().out
    alias = read_json(layout.ptq("nvfp4_4o6-mamba_w4a16-kv_fp8") / "scores.json")
    assert alias["status"] == "alias" and alias["alias_of"] == "nvfp4_4o6-mamba_fp8-kv_fp8"
    assert sorted(p.name for p in layout.ptq("nvfp4_4o6-mamba_w4a16-kv_fp8").iterdir()) == ["scores.json"]
    shutil.rmtree(layout.ptq(recipe))
