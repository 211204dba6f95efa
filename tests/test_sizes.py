"""Bits-per-element accounting: exact arithmetic, and what a quantized model really holds."""

import pytest
import torch

import qad_pipeline  # noqa: F401  (CPU NVFP4 kernels)
from qad_pipeline.nvfp4.sizes import TensorFormat, quantizer_format, size_report, tensor_bits

NVFP4 = TensorFormat("nvfp4", 4, quantized=True, block_size=16)
FP8 = TensorFormat("fp8", 8, quantized=True)
BF16 = TensorFormat("bf16", 16)


def test_tensor_bits():
    # 16x32 = 512 elements: 4 bits each + 32 FP8 block scales + one FP32 tensor scale
    assert tensor_bits(NVFP4, (16, 32)) == 512 * 4 + 32 * 8 + 32
    assert tensor_bits(NVFP4, (16, 32)) / 512 == pytest.approx(4.5625)
    assert tensor_bits(FP8, (16, 32)) == 512 * 8 + 32
    assert tensor_bits(BF16, (16, 32)) == 512 * 16
    assert tensor_bits(NVFP4, (4096, 4096)) / 4096**2 == pytest.approx(4.5, abs=1e-5)


def test_size_report_of_a_w4a16_model():
    import modelopt.torch.quantization as mtq

    model = torch.nn.Sequential(torch.nn.Linear(64, 32, bias=False), torch.nn.LayerNorm(32)).to(torch.bfloat16)
    mtq.quantize(model, mtq.W4A16_NVFP4_CFG, lambda m: m(torch.randn(4, 64, dtype=torch.bfloat16)))
    report = size_report(model)
    assert report["layer_formats"] == {"0.weight": "nvfp4", "1.weight": "bf16", "1.bias": "bf16"}
    bits = 2048 * 4 + 128 * 8 + 32 + 64 * 16
    assert report["size_bytes"] == bits // 8
    assert report["effective_bpe"] == pytest.approx(bits / 2112)
    assert report["bf16_size_bytes"] == 2112 * 2


def test_unknown_quantized_format_is_an_error():
    class Q:
        is_enabled = True
        num_bits = 4
        block_sizes = None
        axis = None

    with pytest.raises(ValueError, match="no size accounting"):
        quantizer_format(Q(), torch.bfloat16)
