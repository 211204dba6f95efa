"""The MSE scale search a chunk of rows at a time (`qad_pipeline.nvfp4.mse_chunks`): with the
repo's MSE (FP8 scale sweep) and four-over-six recipes, a 256x512 Linear searched 48 rows at a time
(six chunks, the last one short) gets bit for bit the amax and quantized weight of Model
Optimizer's whole-weight search."""

from __future__ import annotations

import copy

import pytest
import torch

from qad_pipeline.core.config import PROJECT_ROOT
from qad_pipeline.nvfp4.mse_chunks import ChunkedCalibrator, chunked_mse
from qad_pipeline.nvfp4.recipes import load_quantize_config

mtq = pytest.importorskip("modelopt.torch.quantization")


@pytest.fixture(scope="module")
def linear():
    torch.manual_seed(0)
    layer = torch.nn.Linear(512, 256, bias=False)
    with torch.no_grad():  # rows of different magnitudes and a few outliers: blocks pick different scales
        layer.weight.mul_(torch.randn(256, 1).abs() * 3)
        layer.weight.view(-1)[torch.randint(0, 256 * 512, (64,))] *= 20
    return torch.nn.Sequential(layer).to(torch.bfloat16)


@pytest.mark.parametrize("recipe", ["nvfp4_mse-mamba_fp8-kv_fp8", "nvfp4_4o6-mamba_fp8-kv_fp8"])
def test_the_chunked_search_gives_the_whole_weights_scales_bit_for_bit(linear, recipe):
    config = load_quantize_config(PROJECT_ROOT / "recipes" / f"{recipe}.yaml").model_dump()
    whole, chunked = copy.deepcopy(linear), copy.deepcopy(linear)
    mtq.quantize(whole, config, None)
    with chunked_mse(48):
        mtq.quantize(chunked, config, None)
    q_whole, q_chunked = whole[0].weight_quantizer, chunked[0].weight_quantizer
    assert isinstance(q_chunked._calibrator, ChunkedCalibrator) and q_chunked._calibrator.chunks == 6
    assert torch.equal(q_whole._amax, q_chunked._amax) and torch.equal(q_whole.global_amax, q_chunked.global_amax)
    assert torch.equal(q_whole(whole[0].weight), q_chunked(chunked[0].weight))
    # the search chose: some blocks' amax is not their max
    block_max = linear[0].weight.float().reshape(-1, 16).abs().amax(dim=1)
    assert not torch.equal(q_chunked._amax.view(-1), block_max)


def test_chunked_mse_restores_model_optimizers_factory_and_refuses_a_bad_size():
    from modelopt.torch.quantization import model_calib

    make = model_calib._make_weight_mse_calibrator
    with pytest.raises(RuntimeError, match="boom"), chunked_mse(8):
        assert model_calib._make_weight_mse_calibrator is not make
        raise RuntimeError("boom")
    assert model_calib._make_weight_mse_calibrator is make
    with pytest.raises(ValueError, match=r"ptq.mse_chunk_rows is 0; give a positive number of rows, or null"), \
            chunked_mse(0):
        pass
