"""Learned NVFP4 block scales (qad.learn_scales: lsq, qad_pipeline/nvfp4/learned_scales.py): they start
from the PTQ student's own scales, AdamW moves them, and the fold gives the export exactly what the
last forward used. A family of the architecture matrix trains, exports and serves them
(tests/families.py: Qwen3 and Qwen3-MoE)."""

import copy

import pytest
import torch

import modelopt.torch.quantization as mtq
from qad_pipeline.nvfp4 import learned_scales, nvfp4_cpu
from qad_pipeline.nvfp4.learned_scales import LSQ_FLOOR

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU kernels are installed only without CUDA")

RECIPES = {"max (dynamic block scales)": mtq.NVFP4_DEFAULT_CFG, "MSE (static)": mtq.NVFP4_W4A4_WEIGHT_MSE_FP8_SWEEP_CFG}


def student(config, scale_rows=()):
    """A two-linear model quantized by `config`; rows of `scale_rows` shrunk (row, factor) first."""
    assert nvfp4_cpu.install_cpu_kernels() is True
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 48, bias=False), torch.nn.Linear(48, 32, bias=False))
    with torch.no_grad():
        for row, factor in scale_rows:
            model[0].weight[row, :16] *= factor
    x = torch.randn(8, 64)
    return mtq.quantize(model, copy.deepcopy(config), lambda m: m(x)), x


def fake_quantized(model) -> dict[str, torch.Tensor]:
    with torch.no_grad():
        return {name: quantizer(weight).clone() for name, weight, quantizer in learned_scales.weight_quantizers(model)}


@pytest.mark.parametrize("recipe", list(RECIPES))
def test_learning_starts_from_the_students_scales(recipe):
    """The same FP4 value and FP8 scale for every weight, made static and then learnable: the static
    kernel, the dynamic one and LSQ's forward multiply the FP8 scale by the global one in different
    float32 orders (LSQ divides by global / 6 first), so a weight may move by a float32 ulp or two of its
    value (measured: 1,145 of 1,536 weights of a layer whose global amax is 0.1443), never by an FP4 step
    (at least 1/6 of the block's scale)."""
    model, _ = student(RECIPES[recipe])
    before = fake_quantized(model)
    for _, weight, quantizer in learned_scales.weight_quantizers(model):
        learned_scales.make_static(weight, quantizer)
    for name, weight in fake_quantized(model).items():
        torch.testing.assert_close(weight, before[name], rtol=2**-22, atol=0)
    assert learned_scales.enable(model, "lsq") == 2
    for name, weight in fake_quantized(model).items():
        torch.testing.assert_close(weight, before[name], rtol=2**-21, atol=0)
    assert len(learned_scales.quantizers_learning(model)) == 2


def test_a_block_below_the_lsq_floor_is_the_one_that_moves():
    """LSQ's smallest block amax is global amax x 2^-9 (FP8 code 0.21875 where the static kernel goes
    to 2^-9): a block under it is quantized on that floor from the start."""
    model, _ = student(RECIPES["MSE (static)"], scale_rows=[(0, 1e-4), (1, 1e-2)])
    before = fake_quantized(model)
    learned_scales.enable(model, "lsq")
    after = fake_quantized(model)
    name = next(iter(before))
    moved = (before[name] != after[name]).reshape(-1, 16).any(dim=-1).nonzero().flatten().tolist()
    quantizer = next(q for _, _, q in learned_scales.weight_quantizers(model))
    small = (quantizer.amax_post.reshape(-1) < quantizer.global_amax * LSQ_FLOOR).nonzero().flatten().tolist()
    assert moved == small == [0]  # row 0's first block (x1e-4); row 1's (x1e-2) sits above the floor


def test_adamw_trains_the_scales_and_the_fold_keeps_what_the_forward_used():
    model, x = student(RECIPES["max (dynamic block scales)"])
    learned_scales.enable(model, "lsq")
    scales = [p for n, p in model.named_parameters() if n.endswith("_amax_post")]
    assert len(scales) == 2 and all(p.requires_grad for p in scales)
    initial = [p.detach().clone() for p in scales]
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(x).square().mean().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in scales)
    optimizer.step()
    assert all(not torch.equal(p.detach(), q) for p, q in zip(scales, initial))
    with torch.no_grad():  # out of the forward's range: above the global amax, zero, negative, tiny
        scales[0][:4] = torch.tensor([[1e3], [0.0], [-1.0], [1e-12]])
    last = fake_quantized(model)
    assert learned_scales.fold(model) == 2
    assert learned_scales.quantizers_learning(model) == [] and not [n for n, _ in model.named_parameters() if "amax" in n]
    assert all(torch.equal(w, last[n]) for n, w in fake_quantized(model).items())
    quantizer = model[0].weight_quantizer
    assert quantizer.amax.dtype == torch.float32 and quantizer.amax.reshape(-1)[0] == quantizer.global_amax


def test_an_unknown_mode_is_refused():
    model, _ = student(RECIPES["MSE (static)"])
    with pytest.raises(ValueError, match="qad.learn_scales is 'dual'; valid: none, lsq"):
        learned_scales.enable(model, "dual")
    assert learned_scales.enable(model, "none") == 0


def test_the_plan_counts_the_learned_scales_training_state(demo_model_path):
    """One float32 amax per block of 16 weights, with its gradient and AdamW's two moments."""
    from qad_pipeline.core.config import load_params
    from qad_pipeline.plan import capacity, memory
    from qad_pipeline.plan.model_shape import model_shape

    def qad(*overrides):
        params = load_params(overrides=[f"base_model.path={demo_model_path}", "qad.batch_size=2", "qad.num_gpus=1",
                                        "hardware.device=cpu", *overrides])
        return memory.estimate("qad", params, capacity.Capacity("cpu", 1 << 50)), params

    (plain, params), (learning, _) = qad(), qad("qad.learn_scales=lsq")
    blocks = model_shape(params.base_model).matrix_params // 16
    assert learning.terms["learned_scales"] == blocks * 4 * 3 and "learned_scales" not in plain.terms
    assert learning.host_bytes - plain.host_bytes == blocks * 4 * 3
