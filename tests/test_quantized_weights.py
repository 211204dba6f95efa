"""Weights fake-quantized once per evaluation (`qad_pipeline.nvfp4.weight_folding`): the same logits bit
for bit as the per-forward fake quantization, on the demo model (Mamba, attention with quantized
KV cache, fused MoE experts) with two real recipes and on a Llama; the model comes out as it went
in (weights and quantizer state, bit for bit), also after an error; a tied lm_head never writes its
quantized view into the embedding; `evaluate_model` evaluates with the weights folded."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from qad_pipeline.core.config import PROJECT_ROOT, load_params
from qad_pipeline.nvfp4.weight_folding import folded_weights
from tests.conftest import GOOD_RECIPES, TINY

mtq = pytest.importorskip("modelopt.torch.quantization")


def _quantized(model, recipe: str, ids: torch.Tensor, params):
    """`model` as the PTQ stage leaves it: quantized with the recipe, fused scales shared."""
    from tasks.ptq import quantize_model, share_fused_scales

    model = quantize_model(model, params.recipe_path(recipe), ids, len(ids))
    share_fused_scales(model)
    return model.eval()


def _build_llama(folder):
    spec = importlib.util.spec_from_file_location("bench_models", PROJECT_ROOT / "benchmarks" / "models.py")
    models = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(models)
    return models.build_llama(folder, layers=2, hidden=256, vocab=8192)


@pytest.fixture(scope="module")
def demo_models():
    from qad_pipeline.core.modeling import load_model

    params = load_params(overrides=TINY)
    torch.manual_seed(0)
    ids = torch.randint(3, 1000, (4, 32))
    return {recipe: _quantized(load_model(params.base_model, params.hardware), recipe, ids, params)
            for recipe in GOOD_RECIPES}, ids


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """The ~tiny Llama (2 layers, hidden 256, vocab 8192), BF16 and quantized with the max recipe."""
    from qad_pipeline.core.modeling import load_model

    params = load_params(overrides=[*TINY, f"base_model.path={_build_llama(tmp_path_factory.mktemp('llama'))}"])
    torch.manual_seed(0)
    ids = torch.randint(3, 8192, (4, 64))
    bf16 = load_model(params.base_model, params.hardware).eval()
    quantized = _quantized(load_model(params.base_model, params.hardware), GOOD_RECIPES[0], ids, params)
    return bf16, quantized, ids


def _state(model) -> dict:
    """Every tensor of the state dict (cloned) and every quantizer's properties."""
    from modelopt.torch.quantization.nn import TensorQuantizer

    state = {name: t.detach().clone() for name, t in model.state_dict().items()}
    state.update({f"{name}#properties": m.get_modelopt_state(properties_only=True)
                  for name, m in model.named_modules() if isinstance(m, TensorQuantizer)})
    return state


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).contiguous().view(torch.uint8) if t.dtype.is_floating_point else t


def _same(a, b) -> bool:
    """Bitwise equality of nested states (tensors: dtype, shape and every bit)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype
                and a.shape == b.shape and torch.equal(_bits(a), _bits(b)))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def _weight_quantizers(model):
    from tasks.ptq import quantized_weights

    return [(name, weight, quantizer) for name, weight, quantizer in quantized_weights(model)]


def _check_fold(model, ids) -> dict:
    """Logits unfolded, folded, and after the context: equal bit for bit; inside the context every
    quantized weight holds its fake-quantized value and its quantizer is off; afterwards the state is
    the one before. Returns the fold report, the pairs and how many weights the fold changed."""
    pairs = _weight_quantizers(model)
    originals = {name: weight.detach().clone() for name, weight, _ in pairs}
    expected = {name: quantizer(weight).detach().clone() for name, weight, quantizer in pairs}
    before = _state(model)
    with torch.no_grad():
        unfolded = model(input_ids=ids).logits
        with folded_weights(model) as report:
            for name, weight, quantizer in pairs:
                assert not quantizer.is_enabled, name
                assert torch.equal(weight, expected[name]), name
            folded = model(input_ids=ids).logits
        after = model(input_ids=ids).logits
    assert torch.equal(folded, unfolded)
    assert torch.equal(after, unfolded)
    assert _same(_state(model), before)
    changed = sum(not torch.equal(expected[name], originals[name]) for name in originals)
    return {"report": report, "pairs": pairs, "changed": changed}


@pytest.mark.parametrize("recipe", GOOD_RECIPES)
def test_demo_model_folded_logits_are_bitwise_the_fake_quantized_ones(demo_models, recipe):
    models, ids = demo_models
    model = models[recipe]
    found = _check_fold(model, ids)
    report = found["report"]
    assert report.folded == len(found["pairs"]) and not report.left
    names = [name for name, _, _ in found["pairs"]]
    # the MoE experts (fused 3-D weights, one quantizer per expert), Mamba projections and lm_head
    assert any("experts[" in n for n in names) and any("mixer.in_proj" in n for n in names) and "lm_head" in names
    assert found["changed"] > 0  # the fold replaced weights by other values
    assert model.model.layers[2].mixer.k_bmm_quantizer.is_enabled  # the KV cache stays quantized per forward


def test_llama_folded_logits_are_bitwise_the_fake_quantized_ones(llama):
    _, model, ids = llama  # (the forward's speed is the GPU check's `forward` stage, not a test's)
    found = _check_fold(model, ids)
    assert found["report"].folded == 7 and found["changed"] > 0  # 2 x gate/up/down + lm_head


def _small_llama(tied: bool = False, lm_head: bool = False):
    """A 1-layer Llama, NVFP4-quantized (Model Optimizer's default config; `lm_head`: its weight too)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=256, tie_word_embeddings=tied)
    model = LlamaForCausalLM(config).to(torch.bfloat16).eval()
    ids = torch.randint(0, 256, (2, 16))
    extra = [{"quantizer_name": "*lm_head*weight_quantizer", "enable": True}] if lm_head else []
    cfg = {"quant_cfg": [*mtq.NVFP4_DEFAULT_CFG["quant_cfg"], *extra], "algorithm": "max"}
    return mtq.quantize(model, cfg, lambda m: m(input_ids=ids)), ids


def test_model_comes_out_as_it_went_in_after_an_error():
    model, _ = _small_llama()
    before = _state(model)
    with pytest.raises(RuntimeError, match="in the middle"), folded_weights(model) as report:
        assert report.folded == 7
        assert not torch.equal(model.model.layers[0].mlp.up_proj.weight, before["model.layers.0.mlp.up_proj.weight"])
        raise RuntimeError("in the middle of an evaluation")
    assert _same(_state(model), before)


def test_a_tied_lm_head_is_left_quantizing_per_forward_and_the_embedding_untouched():
    model, ids = _small_llama(tied=True, lm_head=True)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert model.lm_head.weight_quantizer.is_enabled
    embedding = model.model.embed_tokens.weight.detach().clone()
    with torch.no_grad():
        unfolded = model(input_ids=ids).logits
        with folded_weights(model) as report:
            assert torch.equal(model.model.embed_tokens.weight, embedding)
            assert model.lm_head.weight_quantizer.is_enabled
            folded = model(input_ids=ids).logits
    assert report.left == {"lm_head[0]": "tied to another parameter"}
    assert report.folded == 7  # q, k, v, o, gate, up, down
    assert torch.equal(folded, unfolded)


def test_an_unquantized_model_is_left_alone(llama):
    bf16, _, _ = llama
    before = _state(bf16)
    with folded_weights(bf16) as report:
        assert report.folded == 0 and not report.left
    assert _same(_state(bf16), before)


def test_evaluate_model_runs_with_the_weights_folded(llama, monkeypatch):
    from qad_pipeline.scoring import evaluation

    _, model, _ = llama
    quantizers = [q for _, _, q in _weight_quantizers(model)]
    seen = []

    def passes(m, *args):  # evaluate_model's passes over the model (perplexity, KL, lm-eval)
        seen.extend(q.is_enabled for q in quantizers)
        return {"tasks": {}}

    monkeypatch.setattr(evaluation, "_evaluate", passes)
    assert evaluation.evaluate_model(model, None, None, PROJECT_ROOT) == {"tasks": {}}
    assert len(seen) == 7 and not any(seen)
    assert all(q.is_enabled for q in quantizers)
