"""The CPU NVFP4 kernels inside Model Optimizer: its entry points route to them, `mtq.quantize`
runs with every NVFP4 config on a CPU-only machine. The kernels' exactness: test_nvfp4_cpu.py;
their speed: benchmarks/nvfp4_cpu_kernel.py."""

from __future__ import annotations

import copy

import pytest
import torch

from qad_pipeline.nvfp4 import nvfp4_cpu

mtq = pytest.importorskip("modelopt.torch.quantization")


def _tiny_llama() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
        max_position_embeddings=64,
    )
    return LlamaForCausalLM(config).to(torch.bfloat16).eval()


@pytest.fixture(scope="module")
def installed() -> None:
    if torch.cuda.is_available():
        pytest.skip("the CPU emulation is only installed without CUDA")
    assert nvfp4_cpu.install_cpu_kernels() is True


def _forward_loop(ids: torch.Tensor):
    def loop(model: torch.nn.Module) -> None:
        with torch.no_grad():
            model(ids)

    return loop


def test_mtq_quantize_nvfp4_default_on_cpu(installed):
    base = _tiny_llama()
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        reference = base(ids).logits.float()
    model = mtq.quantize(copy.deepcopy(base), mtq.NVFP4_DEFAULT_CFG, _forward_loop(ids))
    with torch.no_grad():
        logits = model(ids).logits.float()
    assert torch.isfinite(logits).all()
    assert not torch.equal(logits, reference)  # fake quant is active
    assert (logits - reference).norm() / reference.norm() < 0.5
    linear = model.model.layers[0].mlp.down_proj
    assert linear.weight_quantizer.is_enabled and linear.input_quantizer.is_enabled
    expected = nvfp4_cpu.fp4_fake_quant_block(linear.weight, linear.weight_quantizer.amax)
    assert torch.equal(linear.weight_quantizer(linear.weight), expected)


def _kv_nvfp4_cfg() -> dict:
    from modelopt.torch.quantization.config import _load_quantizer_cfg_dict_list

    cfg = copy.deepcopy(mtq.NVFP4_DEFAULT_CFG)
    kv_entries = _load_quantizer_cfg_dict_list("configs/ptq/units/kv_nvfp4")
    cfg["quant_cfg"] = list(cfg["quant_cfg"]) + kv_entries
    return cfg


@pytest.mark.parametrize("config_name", ["W4A16_NVFP4_CFG", "NVFP4_KV"])
def test_mtq_quantize_other_nvfp4_configs_on_cpu(installed, config_name):
    cfg = _kv_nvfp4_cfg() if config_name == "NVFP4_KV" else getattr(mtq, config_name)
    base = _tiny_llama()
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        reference = base(ids).logits.float()
    model = mtq.quantize(copy.deepcopy(base), cfg, _forward_loop(ids))
    with torch.no_grad():
        logits = model(ids).logits.float()
    assert torch.isfinite(logits).all() and not torch.equal(logits, reference)
    if config_name == "NVFP4_KV":
        assert model.model.layers[0].self_attn.k_bmm_quantizer.is_enabled


def _load_static_config(name: str) -> dict:
    if name == "lsq_recipe":
        from modelopt.recipe import load_recipe

        recipe = load_recipe("general/qad/nvfp4_lsq-mse_init-fp8_kv")
        return recipe.quantize.model_dump(exclude_unset=True)
    return getattr(mtq, name)


@pytest.mark.parametrize(
    "config_name", ["NVFP4_W4A4_WEIGHT_MSE_FP8_SWEEP_CFG", "NVFP4_FOUR_OVER_SIX_CFG", "lsq_recipe"]
)
def test_mtq_quantize_static_nvfp4_on_cpu(installed, config_name):
    """MSE FP8-scale sweep, four-over-six and LSQ (QAD) use the static kernel and the FP4 cast."""
    torch.manual_seed(0)
    base = torch.nn.Sequential(torch.nn.Linear(64, 48, bias=False)).to(torch.bfloat16)
    x = torch.randn(8, 64, dtype=torch.bfloat16)
    reference = base(x).detach()
    model = mtq.quantize(copy.deepcopy(base), _load_static_config(config_name), _forward_loop(x))
    quantizer = model[0].weight_quantizer
    assert quantizer.is_nvfp4_static
    out = model(x)
    assert torch.isfinite(out).all() and not torch.equal(out.detach(), reference)
    out.float().square().mean().backward()  # STE backward, as in QAD
    assert model[0].weight.grad is not None and torch.isfinite(model[0].weight.grad).all()
