"""Recipes written per role resolve on each family's own modules (qad_pipeline/nvfp4/roles.py)."""

from pathlib import Path

import pytest
import torch
import transformers as T

from qad_pipeline.core.config import PROJECT_ROOT, ConfigError
from qad_pipeline.nvfp4.recipes import check_recipe, quantize_config
from qad_pipeline.nvfp4.roles import expand_roles, module_roles, role_patterns

SMALL = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
             num_key_value_heads=1)
RECIPES = PROJECT_ROOT / "recipes"


def on_meta(model_class, config):
    with torch.device("meta"):
        return model_class(config)


def test_roles_follow_the_modules_not_the_names(demo_model_path):
    phi3 = role_patterns(module_roles(on_meta(T.Phi3ForCausalLM, T.Phi3Config(pad_token_id=0, **SMALL))))
    assert phi3["attention"] == ["model.layers.*.self_attn.o_proj", "model.layers.*.self_attn.qkv_proj"]
    assert phi3["mlp"] == ["model.layers.*.mlp.gate_up_proj", "model.layers.*.mlp.down_proj"]
    moe = role_patterns(module_roles(on_meta(T.Qwen3MoeForCausalLM, T.Qwen3MoeConfig(
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, **SMALL))))
    assert moe["router"] == ["model.layers.*.mlp.gate"] and moe["experts"] == ["model.layers.*.mlp.experts"]
    assert moe["mlp"] == [] and moe["lm_head"] == ["lm_head"]
    neox = role_patterns(module_roles(on_meta(T.GPTNeoXForCausalLM, T.GPTNeoXConfig(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2))))
    assert neox["attention"] == ["gpt_neox.layers.*.attention.query_key_value", "gpt_neox.layers.*.attention.dense"]
    demo = role_patterns(module_roles(T.AutoModelForCausalLM.from_config(T.AutoConfig.from_pretrained(demo_model_path))))
    assert demo["mamba"] == ["model.layers.*.mixer.in_proj", "model.layers.*.mixer.out_proj"]  # not its conv1d
    assert demo["experts"] == ["model.layers.*.mixer.experts"] and demo["router"] == ["model.layers.*.mixer.gate"]


def formats(model, recipe: str) -> dict[str, str]:
    """module -> W4A4 / W4A16 / W8A8 / BF16 under the recipe, quantizers inserted on the meta device."""
    from modelopt.torch.opt.conversion import apply_mode

    apply_mode(model, mode=[("quantize", quantize_config(model, RECIPES / f"{recipe}.yaml"))])
    out = {}
    for name, module in model.named_modules():
        w, i = getattr(module, "weight_quantizer", None), getattr(module, "input_quantizer", None)
        if w is None:
            continue
        bits = lambda q: q.num_bits if q.is_enabled else None  # noqa: E731
        out[name] = {((2, 1), (2, 1)): "W4A4", ((2, 1), None): "W4A16", ((4, 3), (4, 3)): "W8A8"}.get(
            (bits(w), bits(i)), "BF16" if bits(w) is None else f"{bits(w)}/{bits(i)}")
    return out


def test_a_family_whose_names_the_recipes_never_saw():
    """GPT-NeoX names its attention `attention.query_key_value` and `attention.dense`: no pattern of
    Model Optimizer's units matches them (the recipes as they were quantized both W4A4), the roles do."""
    model = on_meta(T.GPTNeoXForCausalLM, T.GPTNeoXConfig(vocab_size=512, hidden_size=64, intermediate_size=128,
                                                          num_hidden_layers=2, num_attention_heads=2))
    got = formats(model, "nvfp4_max-mamba_fp8-kv_fp8")
    assert got["gpt_neox.layers.0.attention.query_key_value"] == "BF16"
    assert got["gpt_neox.layers.1.attention.dense"] == "BF16"
    assert got["gpt_neox.layers.0.mlp.dense_h_to_4h"] == "W4A4"
    assert got["lm_head"] == "W4A16"


def test_tied_output_projection_stays_bf16():
    model = on_meta(T.Qwen3ForCausalLM, T.Qwen3Config(tie_word_embeddings=True, **SMALL))
    got = formats(model, "nvfp4_4o6-mamba_w4a16-kv_nvfp4")
    assert got["lm_head"] == "BF16" and got["model.layers.0.mlp.up_proj"] == "W4A4"
    assert got["model.layers.0.self_attn.k_proj"] == "BF16"


def test_a_model_without_the_role_drops_its_rules_and_unknown_roles_are_refused(tmp_path):
    model = on_meta(T.LlamaForCausalLM, T.LlamaConfig(**SMALL))
    rules = [{"quantizer_name": "<mamba>*", "enable": False}, {"quantizer_name": "*lm_head*", "enable": False}]
    assert expand_roles(rules, model) == rules[1:]
    with pytest.raises(ValueError, match="<moe> is not a role; roles are attention, mlp"):
        expand_roles([{"quantizer_name": "<moe>*", "enable": False}], model)
    bad = tmp_path / "bad.yaml"
    bad.write_text(Path(RECIPES / "nvfp4_max-mamba_fp8-kv_fp8.yaml").read_text().replace("'<router>*'", "'<routers>*'"))
    with pytest.raises(ConfigError, match=r"bad.yaml: <routers> in a quantizer_name is not a role"):
        check_recipe(bad)


def test_an_expert_calibration_never_routes_to_still_gets_its_weight_scales(demo_model_path):
    """The demo's MoE with expert 3's router bias at -1e4: no calibration token reaches it, and
    Model Optimizer still calibrates its weights (per expert, from the weights themselves)."""
    import modelopt.torch.quantization as mtq

    model = T.AutoModelForCausalLM.from_pretrained(demo_model_path, dtype=torch.float32)
    routed: set[int] = set()
    for name, module in model.named_modules():
        if hasattr(module, "e_score_correction_bias"):
            module.e_score_correction_bias.data[3] = -1e4
        if name.endswith("mixer.experts"):
            module.register_forward_pre_hook(lambda m, args: routed.update(args[1].flatten().tolist()))
    ids = torch.randint(5, 4000, (4, 64), generator=torch.Generator().manual_seed(0))
    config = quantize_config(model, RECIPES / "nvfp4_max-mamba_fp8-kv_fp8.yaml")
    mtq.quantize(model, config, lambda m: m(input_ids=ids))
    assert routed == {0, 1, 2}
    experts = [m for n, m in model.named_modules() if n.endswith("mixer.experts")]
    for module in experts:
        for kind in ("up_proj", "down_proj"):
            amax = getattr(module, f"{kind}_weight_quantizers")[3].amax
            assert amax is not None and bool(torch.isfinite(amax).all()) and float(amax.min()) > 0
