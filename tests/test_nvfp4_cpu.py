"""CPU emulation of modelopt's NVFP4 kernels: exactness against modelopt's own CPU reference.

The reference is modelopt's export-path NVFP4 tensor (``NVFP4QTensor.quantize`` followed by
``.dequantize``), which runs on CPU. Comparisons are element for element (``torch.equal``).

Two facts shape the references below:

* On CUDA, PyTorch divides a tensor by a Python constant as a multiplication by the float32
  reciprocal, so the GPU's global scale is ``global_amax * fl(1/2688)``; ``NVFP4QTensor`` on CPU
  divides truly. The emulation follows the GPU, so the dynamic-path references pass that global
  scale to ``NVFP4QTensor`` explicitly, except in one test whose amax makes both forms exact.
* The static path computes its block scales through modelopt's per-tensor FP8 fake quant, not
  the way the export path does; the two agree exactly when ``global_amax`` is 6 * 2**k (tested
  end to end for both block-scale normalisations), and for other amax values the scales are
  checked against modelopt's CPU FP8 fake quant and the elements against ``NVFP4QTensor``.

Kernel behaviour without any CPU counterpart in modelopt (the dynamic kernel's 1e-5 scale floor,
zero / non-finite static scales) is checked against a plain per-block transcription of the Triton
kernels (``_triton_spec_*``).
"""

from __future__ import annotations

import logging
import math
from types import SimpleNamespace

import pytest
import torch

from qad_pipeline.nvfp4 import nvfp4_cpu
from tests.nvfp4_cases import BLOCK, KINDS, sample

mtq = pytest.importorskip("modelopt.torch.quantization")
from modelopt.torch.quantization import tensor_quant  # noqa: E402
from modelopt.torch.quantization.qtensor import NVFP4QTensor  # noqa: E402

INV_6 = torch.tensor(1.0 / 6.0, dtype=torch.float32)
INV_2688 = torch.tensor(1.0 / 2688.0, dtype=torch.float32)
DTYPES = [torch.float32, torch.bfloat16]
E2M1_VALUES = NVFP4QTensor.get_e2m1_values(torch.device("cpu"))


# --------------------------------------------------------------------------------------------
# inputs


def _with_global_amax(x: torch.Tensor, global_amax: float) -> torch.Tensor:
    """Rescale ``x`` so its largest magnitude is exactly ``global_amax`` (kept in x's dtype)."""
    xf = x.float()
    xf = xf / xf.abs().amax() * global_amax
    flat = xf.view(-1)
    flat[flat.abs().argmax()] = math.copysign(global_amax, flat[flat.abs().argmax()].item())
    return xf.to(x.dtype)


def _block_amax(x: torch.Tensor) -> torch.Tensor:
    return x.float().abs().reshape(*x.shape[:-1], -1, BLOCK).amax(-1)


# --------------------------------------------------------------------------------------------
# references


def _decode_e2m1(codes: torch.Tensor) -> torch.Tensor:
    return E2M1_VALUES[codes.long()]


def _ref_dynamic(x: torch.Tensor, global_scale: torch.Tensor | None) -> torch.Tensor:
    """NVFP4QTensor quantize -> dequantize with on-the-fly block scales (export path)."""
    qtensor, scale, scale_2 = NVFP4QTensor.quantize(x, BLOCK, weights_scaling_factor_2=global_scale)
    return _dequantize(qtensor, x.dtype, scale, scale_2)


def _dequantize(
    qtensor: NVFP4QTensor, dtype: torch.dtype, scale: torch.Tensor, scale_2: torch.Tensor
) -> torch.Tensor:
    return qtensor.dequantize(dtype, scale=scale, double_scale=scale_2, block_sizes={-1: BLOCK})


def _ref_static_export(
    x: torch.Tensor, block_amax: torch.Tensor, global_amax: torch.Tensor, fp8_max: float
) -> torch.Tensor:
    """NVFP4QTensor export of a static (per-block amax) quantizer, incl. four-over-six."""
    block_sizes = {-1: BLOCK, "type": "static", "scale_bits": (4, 3)}
    block_sizes["four_over_six"] = fp8_max == 256.0
    quantizer = SimpleNamespace(block_sizes=block_sizes, global_amax=global_amax, _amax=block_amax)
    scale, scale_2 = NVFP4QTensor.get_weights_scaling_factor_from_quantizer(quantizer, x)
    qtensor, _, _ = NVFP4QTensor.quantize(
        x, BLOCK, weights_scaling_factor=scale, weights_scaling_factor_2=scale_2
    )
    return _dequantize(qtensor, x.dtype, scale, scale_2)


def _ref_with_scales(x: torch.Tensor, block_scale: torch.Tensor) -> torch.Tensor:
    """NVFP4QTensor quantize -> dequantize with given (positive) float32 block scales."""
    one = torch.tensor(1.0)
    qtensor, _, _ = NVFP4QTensor.quantize(
        x, BLOCK, weights_scaling_factor=block_scale, weights_scaling_factor_2=one
    )
    return _dequantize(qtensor, x.dtype, block_scale, one)


def _triton_spec_round(v: float) -> float:
    """E2M1 magnitude rounding exactly as the Triton kernels' comparison chain states it."""
    # (boundary, value below it, whether the boundary itself rounds down): ties to even
    chain = [
        (0.25, 0.0, True),
        (0.75, 0.5, False),
        (1.25, 1.0, True),
        (1.75, 1.5, False),
        (2.5, 2.0, True),
        (3.5, 3.0, False),
        (5.0, 4.0, True),
    ]
    for bound, value, inclusive in chain:
        if v < bound or (inclusive and v == bound):
            return value
    return 6.0


def _f32(v: float | torch.Tensor) -> torch.Tensor:
    return torch.as_tensor(v, dtype=torch.float32)


def _triton_spec_block(block: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """One block: |x| / scale, rounded, times scale, sign of x (float32 scalar arithmetic)."""
    out = []
    for x in block:
        magnitude = _f32(_triton_spec_round((x.abs() / scale).item())) * scale
        out.append(magnitude if x >= 0 else -magnitude)
    return torch.stack(out)


def _triton_spec_dynamic(x: torch.Tensor, global_amax: float) -> torch.Tensor:
    """fp4_fake_quant_block, one block at a time (float32 scalars), for small inputs."""
    global_scale = _f32(global_amax) * INV_2688
    global_scale = global_scale if global_scale > 0 else _f32(1e-12)
    out = torch.empty(x.shape, dtype=torch.float32)
    for r in range(x.shape[0]):
        for c in range(0, x.shape[1], BLOCK):
            block = x[r, c : c + BLOCK].float()
            in_units = torch.clamp(block.abs().max() / (6.0 * global_scale), max=448.0)
            scale = in_units.to(torch.float8_e4m3fn).float() * global_scale
            scale = scale if scale >= _f32(1e-5) else _f32(1.0)
            out[r, c : c + BLOCK] = _triton_spec_block(block, scale)
    return out.to(x.dtype)


def _triton_spec_static(x: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """static_blockwise_fp4_fake_quant_kernel given the block scales, one block at a time."""
    out = torch.empty(x.shape, dtype=torch.float32)
    for b, scale in enumerate(scales.reshape(-1)):
        block = x.reshape(-1, BLOCK)[b].float()
        if scale == 0:
            out.reshape(-1, BLOCK)[b] = 0.0
            continue
        safe = scale if torch.isfinite(scale) else _f32(1.0)
        out.reshape(-1, BLOCK)[b] = _triton_spec_block(block, safe)
    return out.to(x.dtype)


# --------------------------------------------------------------------------------------------
# installation (an unpatched modelopt is simulated with monkeypatch)

needs_no_cuda = pytest.mark.skipif(
    torch.cuda.is_available(), reason="the CPU emulation is only installed without CUDA"
)


def test_install_never_patches_when_cuda_is_reported(monkeypatch, caplog):
    real_kernels = getattr(tensor_quant.triton_kernel, "_real", tensor_quant.triton_kernel)
    # Present modelopt as unpatched, then claim a GPU: nothing may change.
    monkeypatch.setattr(tensor_quant, "triton_kernel", real_kernels)
    monkeypatch.setattr(nvfp4_cpu, "_state", {})
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    op_before = tensor_quant.dynamic_block_quantize_op
    with caplog.at_level(logging.WARNING, logger=nvfp4_cpu.__name__):
        assert nvfp4_cpu.install_cpu_kernels() is False
    assert tensor_quant.triton_kernel is real_kernels
    assert tensor_quant.dynamic_block_quantize_op is op_before
    assert nvfp4_cpu._state == {}
    assert not nvfp4_cpu.is_installed()
    assert caplog.records == []


@needs_no_cuda
def test_install_is_idempotent_and_warns_once(monkeypatch, caplog):
    assert nvfp4_cpu.install_cpu_kernels() is True  # normally done by `import qad_pipeline`
    real_kernels = tensor_quant.triton_kernel._real
    monkeypatch.setattr(tensor_quant, "triton_kernel", real_kernels)  # as if never installed
    monkeypatch.setattr(nvfp4_cpu, "_state", {})
    with caplog.at_level(logging.WARNING, logger=nvfp4_cpu.__name__):
        assert nvfp4_cpu.install_cpu_kernels() is True
        assert nvfp4_cpu.install_cpu_kernels() is True
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "emulated on CPU" in warnings[0].getMessage()
    assert nvfp4_cpu.is_installed() and tensor_quant.triton_kernel._real is real_kernels


# --------------------------------------------------------------------------------------------
# E2M1 rounding


def test_e2m1_rounding_matches_nvfp4qtensor_including_ties():
    grid = torch.arange(-640, 641, dtype=torch.float32) / 64.0  # every tie, both signs, past 6
    nudged = torch.cat([grid, torch.nextafter(grid, grid + 1), torch.nextafter(grid, grid - 1)])
    values = torch.cat([nudged, torch.randn(50_000) * 3, torch.tensor([1e-30, 7.0, 1e6, math.inf])])
    expected = _decode_e2m1(NVFP4QTensor._cast_fp4(values.clone()))  # codes carry the sign
    assert torch.equal(nvfp4_cpu.e2m1_round(values), expected)


@pytest.mark.parametrize("dtype", DTYPES)
def test_fp4_cast_matches_nvfp4qtensor(dtype):
    x = (torch.randn(64, 128, generator=torch.Generator().manual_seed(3)) * 4).to(dtype)
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.5])
    x[0, :16] = torch.cat([ties, -ties])
    codes = NVFP4QTensor._cast_fp4(x.float().clone())  # works in place
    expected = _decode_e2m1(codes).to(dtype)
    assert torch.equal(nvfp4_cpu.static_blockwise_fp4_cast(x), expected)
    assert nvfp4_cpu.static_blockwise_fp4_cast(x, torch.float32).dtype == torch.float32


# --------------------------------------------------------------------------------------------
# dynamic path (fp4_fake_quant_block)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", KINDS)
def test_dynamic_matches_nvfp4qtensor(kind, dtype):
    x = sample(kind, (64, 256), dtype, seed=KINDS.index(kind))
    global_amax = x.float().abs().amax()
    expected = _ref_dynamic(x, global_amax * INV_2688)
    assert torch.equal(nvfp4_cpu.fp4_fake_quant_block(x, global_amax), expected)


@pytest.mark.parametrize("dtype", DTYPES)
def test_dynamic_matches_nvfp4qtensor_default_global_scale(dtype):
    # 5.25 = 2688 / 2**9: the CUDA (reciprocal) and CPU (true division) global scales coincide,
    # so NVFP4QTensor's own global scale can be used unmodified.
    x = _with_global_amax(sample("outliers", (32, 128), dtype, seed=11), 5.25)
    expected = _ref_dynamic(x, None)
    assert torch.equal(nvfp4_cpu.fp4_fake_quant_block(x, x.float().abs().amax()), expected)


def test_dynamic_global_scale_is_the_cuda_reciprocal_form():
    # For this amax, g / 2688 (CPU true division) and g * fl(1/2688) (CUDA) differ in the last
    # bit; the emulation must follow CUDA.
    global_amax = torch.tensor(1.0090899467468262)
    assert global_amax / 2688.0 != global_amax * INV_2688
    x = sample("normal", (32, 128), torch.float32, seed=12) * 0.2
    out = nvfp4_cpu.fp4_fake_quant_block(x, global_amax)
    assert torch.equal(out, _ref_dynamic(x, global_amax * INV_2688))
    assert not torch.equal(out, _ref_dynamic(x, global_amax / 2688.0))


def test_dynamic_three_dims_and_short_last_block():
    x = sample("normal", (6, 100), torch.bfloat16, seed=5).reshape(2, 3, 100)
    global_amax = x.float().abs().amax()
    padded = torch.nn.functional.pad(x.reshape(6, 100), (0, 12))  # zero padding, as the kernel
    expected = _ref_dynamic(padded, global_amax * INV_2688)[:, :100].reshape(2, 3, 100)
    assert torch.equal(nvfp4_cpu.fp4_fake_quant_block(x, global_amax), expected)


def test_dynamic_scale_floor_and_underflow_follow_triton():
    # No CPU counterpart in modelopt: NVFP4QTensor clamps block scales to >= 2**-9 instead of
    # flushing, so these blocks are checked against the per-block transcription of the kernel.
    x = sample("normal", (4, 64), torch.float32, seed=7)
    x[0, :16] *= 1e-6  # scale far below 1e-5 -> scale 1.0 -> block rounds to zero
    x[0, 16:32] *= 3e-5  # scale near the 1e-5 floor
    x[3, :16] *= 1e-8  # FP8 scale underflows to zero
    for global_amax in (float(x.abs().amax()), 1e-3, 0.0):
        expected = _triton_spec_dynamic(x, global_amax)
        assert torch.equal(nvfp4_cpu.fp4_fake_quant_block(x, torch.tensor(global_amax)), expected)
    assert torch.equal(nvfp4_cpu.fp4_fake_quant_block(x, x.abs().amax())[0, :16], torch.zeros(16))


def test_dynamic_rejects_unsupported_dtype():
    with pytest.raises(ValueError):
        nvfp4_cpu.fp4_fake_quant_block(torch.randn(4, 16, dtype=torch.float64), torch.tensor(1.0))


# --------------------------------------------------------------------------------------------
# static path (static_blockwise_fp4_fake_quant, MSE / four-over-six)


@pytest.mark.parametrize("fp8_max", [448.0, 256.0])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", KINDS)
def test_static_matches_nvfp4qtensor_export(kind, dtype, fp8_max):
    x = _with_global_amax(sample(kind, (64, 256), dtype, seed=20 + KINDS.index(kind)), 6.0)
    block_amax = _block_amax(x)
    global_amax = torch.tensor(6.0)
    expected = _ref_static_export(x, block_amax, global_amax, fp8_max)
    for division in ("cuda_ext", "eager"):
        out = nvfp4_cpu.static_blockwise_fp4_fake_quant(
            x.reshape(-1, BLOCK),
            block_amax.reshape(-1),
            global_amax,
            True,
            fp8_max,
            e4m3_division=division,
        )
        assert torch.equal(out.reshape(x.shape), expected)


@pytest.mark.parametrize("fp8_max", [448.0, 256.0])
def test_static_block_scales_match_modelopt_fp8_fake_quant(fp8_max):
    gen = torch.Generator().manual_seed(1)
    block_amax = torch.rand(4096, generator=gen) * torch.exp(3 * torch.randn(4096, generator=gen))
    # 1.00909: 448 / amax differs in the last bit between the two E4M3 fake-quant forms.
    global_amaxes = [torch.tensor(1.0090899467468262), block_amax.max(), torch.tensor(0.0)]
    global_amaxes.append(block_amax.max() * 1.37)
    eager, cuda_ext = (
        nvfp4_cpu.compute_fp4_scales(block_amax, global_amaxes[0], True, fp8_max, e4m3_division=d)
        for d in ("eager", "cuda_ext")
    )
    assert not torch.equal(eager, cuda_ext)
    for global_amax in global_amaxes:
        scale_amax = (global_amax * (448.0 / fp8_max)) * INV_6
        # modelopt's CPU FP8 fake quant (the "eager" form of 448 / amax) ...
        expected = tensor_quant.scaled_e4m3_impl(block_amax * INV_6, scale_amax)
        got = nvfp4_cpu.compute_fp4_scales(
            block_amax, global_amax, True, fp8_max, e4m3_division="eager"
        )
        assert torch.equal(got, expected)
        # ... and the CUDA extension's form, transcribed with float32 true divisions.
        safe = scale_amax if scale_amax > 2**-24 else _f32(1.0)
        to_fp8 = _f32(448.0) / safe
        codes = (block_amax * INV_6 * to_fp8).clamp(-448, 448).to(torch.float8_e4m3fn)
        expected = codes.float() * (_f32(1.0) / to_fp8)
        got = nvfp4_cpu.compute_fp4_scales(block_amax, global_amax, True, fp8_max)
        assert torch.equal(got, expected)
    assert torch.equal(nvfp4_cpu.compute_fp4_scales(block_amax, None, False), block_amax * INV_6)


@pytest.mark.parametrize("fp8_max", [448.0, 256.0])
@pytest.mark.parametrize("dtype", DTYPES)
def test_static_elements_match_nvfp4qtensor_for_any_global_amax(dtype, fp8_max):
    x = sample("outliers", (64, 256), dtype, seed=31)
    block_amax = _block_amax(x) * 0.9  # as after an MSE search: some elements clip at 6
    global_amax = x.float().abs().amax() * 1.01
    scale = nvfp4_cpu.compute_fp4_scales(block_amax, global_amax, True, fp8_max)
    expected = _ref_with_scales(x, torch.where(scale > 0, scale, torch.ones_like(scale)))
    out = nvfp4_cpu.static_blockwise_fp4_fake_quant(x, block_amax, global_amax, True, fp8_max)
    assert torch.equal(out, expected)
    out_f32 = nvfp4_cpu.static_blockwise_fp4_fake_quant(
        x, block_amax, global_amax, True, fp8_max, torch.float32
    )
    assert torch.equal(out_f32.to(dtype), out)


def test_static_zero_and_non_finite_scales_follow_triton():
    x = sample("normal", (4, 64), torch.float32, seed=9)
    block_amax = _block_amax(x).reshape(-1).clone()
    block_amax[1] = 1e-9  # FP8 scale underflows to zero -> all-zero block
    block_amax[2] = 0.0
    block_amax[3] = math.inf
    block_amax[4] = math.nan
    global_amax = torch.tensor(8.0)
    scales = nvfp4_cpu.compute_fp4_scales(block_amax, global_amax, quantize_block_scales=False)
    out = nvfp4_cpu.static_blockwise_fp4_fake_quant(
        x, block_amax, global_amax, quantize_block_scales=False
    )
    assert torch.equal(out, _triton_spec_static(x, scales))
    scales = nvfp4_cpu.compute_fp4_scales(block_amax[:3], global_amax)
    head = x.reshape(-1)[: 3 * BLOCK]
    out = nvfp4_cpu.static_blockwise_fp4_fake_quant(head, block_amax[:3], global_amax)
    assert scales[1] == 0 and torch.equal(out, _triton_spec_static(head, scales))


# --------------------------------------------------------------------------------------------
# through modelopt


def test_modelopt_entry_points_route_to_cpu_kernels(installed):
    x = sample("outliers", (32, 128), torch.bfloat16, seed=4)
    amax = x.float().abs().amax()
    out = tensor_quant.dynamic_block_quant(x, BLOCK, amax, None, (2, 1), (4, 3))
    assert torch.equal(out, _ref_dynamic(x, amax * INV_2688))
    block_amax = _block_amax(x).reshape(-1)
    blocks = x.reshape(-1, BLOCK)
    out = tensor_quant.static_blockwise_fp4_fake_quant(
        blocks, block_amax, amax, True, 256.0, x.dtype, False
    )
    expected = nvfp4_cpu.static_blockwise_fp4_fake_quant(blocks, block_amax, amax, True, 256.0)
    assert torch.equal(out, expected)
    y = torch.randn(8, 16, requires_grad=True)
    tensor_quant.fp4_cast_ste(y * 4).sum().backward()
    assert y.grad is not None
    # Formats other than NVFP4 still reach modelopt's own implementation.
    with pytest.raises(NotImplementedError):
        tensor_quant.dynamic_block_quantize_op(x, BLOCK, amax, 4, 0, 8, 4)


@pytest.fixture(scope="module")
def installed() -> None:
    if torch.cuda.is_available():
        pytest.skip("the CPU emulation is only installed without CUDA")
    assert nvfp4_cpu.install_cpu_kernels() is True
