"""CPU emulation of Model Optimizer's NVFP4 fake-quantization kernels.

Model Optimizer (``modelopt``) fake-quantizes NVFP4 with Triton kernels that only exist on a CUDA
machine: the dynamic path (``_dynamic_block_quantize_impl`` -> ``fp4_fake_quant_block``) asserts
``amax.is_cuda``, and the static path used by MSE / four-over-six calibration
(``StaticBlockwiseFP4FakeQuantFunction`` -> ``static_blockwise_fp4_fake_quant``) and the LSQ cast
(``FP4CastSTEFunction`` -> ``static_blockwise_fp4_cast``) raise without Triton. This module
re-implements exactly those kernels with vectorised torch ops and, through
:func:`install_cpu_kernels`, routes modelopt's calls to them when no CUDA device is present, so
``mtq.quantize`` with modelopt's own NVFP4 configs runs unchanged on CPU (slowly; for development
and CI).

The numerics are the reference arithmetic: the exact float32 division ``|x| / scale`` that
Model Optimizer's export packer (``NVFP4QTensor.quantize``) uses to write the checkpoint's E2M1
codes and FP8 block scales, i.e. what the inference engine dequantizes; every other step follows
what a GPU run computes:

* two-level scales: ``per_block_scale = fp8_e4m3(block_amax / 6 / global_scale) * global_scale``
  with ``global_scale = global_amax / (6 * 448)`` (``/ (6 * 256)`` for four-over-six, static only);
* E2M1 rounding to {0, 0.5, 1, 1.5, 2, 3, 4, 6} with ties to even (0.25 -> 0, 0.75 -> 1,
  1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4), magnitudes above 6 saturate;
* a tensor divided by a Python constant on CUDA is computed by PyTorch as a multiplication by the
  float32 reciprocal (``x * fl(1/c)``), which differs from CPU true division in the last bit for
  about a quarter of inputs; the emulation reproduces the CUDA form (the export of a GPU run
  receives that global scale from the quantizer);
* the dynamic kernel replaces every block scale below 1e-5 (absolute, after FP8 rounding) by 1.0,
  so a block of small values rounds to zero; the static kernel maps a zero scale (FP8 underflow)
  to an all-zero block and a NaN/inf scale to 1.0; modelopt's export path (``NVFP4QTensor``)
  instead clamps the FP8 block scale to at least 2**-9, so such blocks differ there;
* the static path FP8-rounds its block scales through modelopt's per-tensor E4M3 fake quant, whose
  ``448 / amax`` is a true division in the compiled CUDA extension but ``reciprocal * 448`` in the
  PyTorch fallback; ``e4m3_division`` selects which (default: the CUDA extension);
* everything is computed in float32 and rounded once to the output dtype (round to nearest even).

Known, value-neutral difference: an input of exactly -0.0 comes out as -0.0 here and +0.0 from
Triton (equal under ``torch.equal``). NaN inputs propagate NaN here (Triton saturates them).

What the GPU's fake quantization differs by: the Triton kernels compute ``|x| / scale`` (and the
dynamic kernel ``block_amax / (6 * global_scale)``) with Triton's float32 ``/``, the approximate
``div.full.f32`` (at most 2 ulp off). An element whose exact quotient lies within 2 ulp of an E2M1
decision boundary may come out one FP4 step away (the boundary's other neighbour), and a dynamic
block whose scale lies within 2 ulp of an FP8 rounding midpoint may take the neighbouring FP8
scale; in practice this touches bf16/fp16 inputs (about 1 element in 1,000-6,000 on the parity
cases), not float32 ones. These kernels keep the exact division, i.e. the checkpoint's arithmetic.
``qad_pipeline.nvfp4.nvfp4_parity`` models the GPU's division and classifies every such difference;
``scripts/gpu_nvfp4_parity.py`` runs that check against modelopt's kernels on a GPU machine.
"""

from __future__ import annotations

import inspect
import logging
import types
import warnings
from typing import Callable, Literal

import torch
import torch.nn.functional as F

__all__ = [
    "DYNAMIC_BLOCK_SIZE",
    "E2M1_MAX",
    "E4M3_MAX",
    "E4M3_MAX_FOUR_OVER_SIX",
    "E4M3ScaleDivision",
    "compute_fp4_scales",
    "e2m1_round",
    "fake_e4m3_with_amax",
    "fp4_fake_quant_block",
    "install_cpu_kernels",
    "is_installed",
    "nvfp4_global_scale",
    "static_blockwise_fp4_cast",
    "static_blockwise_fp4_fake_quant",
]

logger = logging.getLogger(__name__)

E2M1_MAX = 6.0  # largest FP4 (E2M1) magnitude
E4M3_MAX = 448.0  # largest FP8 (E4M3) magnitude; default block-scale normalisation
E4M3_MAX_FOUR_OVER_SIX = 256.0  # block-scale normalisation of NVFP4 four-over-six
DYNAMIC_BLOCK_SIZE = 16  # the dynamic Triton path always uses 16-element blocks

# Float32 constants exactly as the Triton kernels see them.
_MIN_DYNAMIC_SCALE = torch.tensor(1e-5, dtype=torch.float32)  # smaller block scales become 1.0
_TINY_GLOBAL_SCALE = torch.tensor(1e-12, dtype=torch.float32)  # stand-in for a zero global scale
_ZERO_AMAX_EPS = 1.0 / (1 << 24)  # FP8 fake quant treats an amax at or below this as zero
_FP32_EXPONENT_BITS = 0x7F800000

_SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

E4M3ScaleDivision = Literal["cuda_ext", "eager"]


def _check_dtype(dtype: torch.dtype) -> None:
    """Reject dtypes the Triton kernels cannot write (they raise the same ValueError)."""
    if dtype not in _SUPPORTED_DTYPES:
        raise ValueError(f"Unsupported dtype for fp4 fake quantization: {dtype}")


def _div_by_constant(t: torch.Tensor, divisor: float) -> torch.Tensor:
    """``t / divisor`` the way PyTorch computes it on CUDA: ``t * float32(1 / divisor)``."""
    return t * torch.tensor(1.0 / divisor, dtype=torch.float32, device=t.device)


def _fp8_e4m3_round(t: torch.Tensor) -> torch.Tensor:
    """Round float32 values in [-448, 448] to FP8 E4M3 (nearest even) and back to float32."""
    return t.to(torch.float8_e4m3fn).to(torch.float32)


def e2m1_round(values: torch.Tensor) -> torch.Tensor:
    """Round float32 values to the nearest E2M1 value, ties to even, saturating at +-6.

    The E2M1 grid {0, 0.5, 1, 1.5, 2, 3, 4, 6} has spacing 0.5 below 2, 1 in [2, 4) and 2 from 4
    on, i.e. half the power of two at or below ``clamp(|v|, 1, 7.5)``; that power of two is read
    off the float32 exponent bits. Dividing by the (power-of-two, hence exact) spacing turns the
    rounding into ``torch.round`` (ties to even). NaN stays NaN.
    """
    magnitude = values.abs().clamp_(1.0, 7.5)
    step = (magnitude.view(torch.int32) & _FP32_EXPONENT_BITS).view(torch.float32).mul_(0.5)
    return values.div(step).round_().mul_(step).clamp_(-E2M1_MAX, E2M1_MAX)


def _fp4_quant_dequant(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Fake-quantize float32 ``x`` to E2M1 with a broadcastable positive finite ``scale``."""
    return e2m1_round(x / scale).mul_(scale)


def fake_e4m3_with_amax(
    x: torch.Tensor, amax: torch.Tensor, division: E4M3ScaleDivision = "cuda_ext"
) -> torch.Tensor:
    """Per-tensor FP8 E4M3 fake quantization of float32 ``x`` with a scalar ``amax``.

    ``x * (448 / amax)`` is saturated to [-448, 448], rounded to E4M3 and multiplied by
    ``1 / (448 / amax)``; an amax at or below 2**-24 counts as 1. ``division`` picks how
    ``448 / amax`` is computed, which decides the last bit of the result: ``"cuda_ext"`` is a
    true division (modelopt's compiled CUDA extension, used on GPU machines that can build it),
    ``"eager"`` is ``reciprocal(amax) * 448`` (modelopt's pure-PyTorch fallback).
    """
    amax = amax.to(torch.float32)
    safe_amax = torch.where(amax <= _ZERO_AMAX_EPS, torch.ones_like(amax), amax)
    if division == "cuda_ext":
        to_fp8 = torch.full_like(safe_amax, E4M3_MAX) / safe_amax
    elif division == "eager":
        to_fp8 = safe_amax.reciprocal() * E4M3_MAX
    else:
        raise ValueError(f"division must be 'cuda_ext' or 'eager', got {division!r}")
    from_fp8 = to_fp8.reciprocal()
    return _fp8_e4m3_round((x * to_fp8).clamp_(-E4M3_MAX, E4M3_MAX)) * from_fp8


def compute_fp4_scales(
    amax: torch.Tensor,
    global_amax: torch.Tensor | None = None,
    quantize_block_scales: bool = True,
    fp8_max_for_normalization: float = E4M3_MAX,
    *,
    e4m3_division: E4M3ScaleDivision = "cuda_ext",
) -> torch.Tensor:
    """Per-block dequantization scales of the static NVFP4 path, float32, shaped like ``amax``.

    ``scale = amax / 6``; with ``quantize_block_scales`` it is FP8-fake-quantized against
    ``global_amax * (448 / fp8_max_for_normalization) / 6`` (``global_amax`` defaults to the
    largest ``amax``), i.e. expressed in units of ``global_amax / (6 * fp8_max_for_normalization)``
    and rounded to E4M3.
    """
    amax = amax.to(torch.float32)
    scale = _div_by_constant(amax, E2M1_MAX)
    if not quantize_block_scales:
        return scale
    if global_amax is None:
        global_amax = amax.abs().amax()
    normalisation = E4M3_MAX / fp8_max_for_normalization
    scale_amax = _div_by_constant(global_amax.to(torch.float32) * normalisation, E2M1_MAX)
    return fake_e4m3_with_amax(scale, scale_amax.to(scale.device), e4m3_division)


def static_blockwise_fp4_fake_quant(
    x: torch.Tensor,
    amax: torch.Tensor,
    global_amax: torch.Tensor | None = None,
    quantize_block_scales: bool = True,
    fp8_max_for_normalization: float = E4M3_MAX,
    out_dtype: torch.dtype | None = None,
    *,
    e4m3_division: E4M3ScaleDivision = "cuda_ext",
) -> torch.Tensor:
    """Static NVFP4 fake quantization with precomputed per-block ``amax`` (CPU Triton stand-in).

    Consecutive ``x.numel() // amax.numel()`` elements of the flattened ``x`` share one amax.
    A block whose scale is zero comes out all zero; a NaN or infinite scale counts as 1.
    """
    num_blocks = amax.numel()
    if num_blocks == 0 or x.numel() % num_blocks != 0:
        raise ValueError(
            f"x.numel() ({x.numel()}) is not divisible by amax.numel() ({num_blocks}); "
            "they must satisfy x.numel() == NUM_FP4_BLOCKS * BLOCK_SIZE."
        )
    out_dtype = x.dtype if out_dtype is None else out_dtype
    _check_dtype(out_dtype)
    scale = compute_fp4_scales(
        amax,
        global_amax,
        quantize_block_scales,
        fp8_max_for_normalization,
        e4m3_division=e4m3_division,
    ).reshape(num_blocks, 1)
    blocks = x.reshape(num_blocks, x.numel() // num_blocks).to(torch.float32)
    zero_scale = scale == 0
    safe_scale = torch.where(zero_scale | ~torch.isfinite(scale), torch.ones_like(scale), scale)
    out = _fp4_quant_dequant(blocks, safe_scale)
    if bool(zero_scale.any()):
        out.masked_fill_(zero_scale, 0.0)
    return out.to(out_dtype).view(x.shape)


def static_blockwise_fp4_cast(
    x: torch.Tensor, out_dtype: torch.dtype | None = None
) -> torch.Tensor:
    """Round already-scaled values to the nearest E2M1 value, sign kept (no scaling)."""
    out_dtype = x.dtype if out_dtype is None else out_dtype
    _check_dtype(out_dtype)
    return e2m1_round(x.to(torch.float32)).to(out_dtype)


def nvfp4_global_scale(global_amax: torch.Tensor) -> torch.Tensor:
    """Second-level (per-tensor) scale of the dynamic path: ``global_amax / (6 * 448)``, float32."""
    return _div_by_constant(global_amax.to(torch.float32), E2M1_MAX * E4M3_MAX)


def fp4_fake_quant_block(
    x: torch.Tensor,
    global_amax: torch.Tensor,
    block_size: int = DYNAMIC_BLOCK_SIZE,
    tile_rows: int = 16,
    tile_cols: int = 64,
    num_warps: int | None = None,
    num_stages: int | None = None,
) -> torch.Tensor:
    """Dynamic NVFP4 fake quantization along the last dim (CPU Triton stand-in).

    Blocks are ``block_size`` consecutive elements of each row; a short last block is padded with
    zeros. Each block's scale is its amax / 6 in units of :func:`nvfp4_global_scale`, saturated at
    448 and rounded to E4M3; a resulting scale below 1e-5 is replaced by 1.0. The tile and launch
    arguments exist for signature compatibility and are ignored.
    """
    del tile_rows, tile_cols, num_warps, num_stages
    _check_dtype(x.dtype)
    if x.numel() == 0:
        return x.clone()
    shape = x.shape
    rows = x.reshape(-1, shape[-1]).to(torch.float32)
    pad = -shape[-1] % block_size
    if pad:
        rows = F.pad(rows, (0, pad))
    blocks = rows.reshape(rows.shape[0], -1, block_size)

    # The kernel reads one global amax (the first element); modelopt passes a scalar.
    global_scale = nvfp4_global_scale(global_amax.reshape(-1)[0]).to(x.device)
    global_scale = torch.where(global_scale > 0, global_scale, _TINY_GLOBAL_SCALE.to(x.device))
    block_amax = blocks.abs().amax(dim=-1, keepdim=True)
    in_fp8_units = (block_amax / (global_scale * E2M1_MAX)).clamp_(max=E4M3_MAX)
    scale = _fp8_e4m3_round(in_fp8_units) * global_scale
    scale = torch.where(scale >= _MIN_DYNAMIC_SCALE.to(x.device), scale, torch.ones_like(scale))

    out = _fp4_quant_dequant(blocks, scale).reshape(rows.shape)
    if pad:
        out = out[:, : shape[-1]]
    return out.to(x.dtype).reshape(shape)


def _is_nvfp4_format(
    num_bits: int, exponent_bits: int, scale_num_bits: int, scale_exponent_bits: int
) -> bool:
    """Whether the dynamic-block op arguments describe NVFP4 (E2M1 data, E4M3 block scales)."""
    return (num_bits, exponent_bits, scale_num_bits, scale_exponent_bits) == (4, 2, 8, 4)


def _make_dynamic_block_impl(original: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """CPU kernel of ``tensorrt::dynamic_block_quantize_op``: NVFP4 here, else ``original``."""

    def dynamic_block_quantize_cpu(
        inputs: torch.Tensor,
        block_size: int,
        amax: torch.Tensor,
        num_bits: int,
        exponent_bits: int,
        scale_num_bits: int,
        scale_exponent_bits: int,
    ) -> torch.Tensor:
        formats = (num_bits, exponent_bits, scale_num_bits, scale_exponent_bits)
        if amax is None or not _is_nvfp4_format(*formats):
            return original(inputs, block_size, amax, *formats)
        global_amax = amax if amax.numel() == 1 else amax.amax()
        # modelopt's GPU dispatch calls the Triton kernel without block_size, so the dynamic
        # NVFP4 path always quantizes 16-element blocks; mirror the call exactly.
        return fp4_fake_quant_block(inputs, global_amax)

    return dynamic_block_quantize_cpu


class _CpuKernelModule(types.ModuleType):
    """Stand-in for ``modelopt.torch.kernels.quantization.gemm`` inside ``tensor_quant`` only.

    Reports the kernels as available and serves the CPU implementations; every other attribute
    is looked up on the real module.
    """

    def __init__(self, real: types.ModuleType) -> None:
        super().__init__(f"{real.__name__}[cpu-emulation]", "CPU emulation of modelopt's kernels")
        self._real = real
        self.IS_AVAILABLE = True
        self.fp4_fake_quant_block = fp4_fake_quant_block
        self.static_blockwise_fp4_fake_quant = static_blockwise_fp4_fake_quant
        self.static_blockwise_fp4_cast = static_blockwise_fp4_cast
        self.compute_fp4_scales = compute_fp4_scales

    def __getattr__(self, name: str):
        return getattr(self._real, name)


_state: dict[str, object] = {}  # holds the torch.library registration while installed


def is_installed() -> bool:
    """Whether :func:`install_cpu_kernels` has patched modelopt in this process."""
    from modelopt.torch.quantization import tensor_quant

    return isinstance(tensor_quant.triton_kernel, _CpuKernelModule)


def _route_dynamic_block_op(tensor_quant: types.ModuleType) -> None:
    """Make the dynamic-block op run NVFP4 on CPU tensors through :func:`fp4_fake_quant_block`."""
    cpu_impl = _make_dynamic_block_impl(tensor_quant._dynamic_block_quantize_impl)
    if tensor_quant.dynamic_block_quantize_op is tensor_quant._dynamic_block_quantize_impl:
        # modelopt could not register its torch.library op; it calls the plain function.
        tensor_quant.dynamic_block_quantize_op = cpu_impl
        return
    library = torch.library.Library("tensorrt", "IMPL")
    # modelopt registered its own CPU kernel; torch versions whose `impl` refuses to replace a
    # kernel by default (allow_override=False, e.g. 2.11 on GPU machines) need it said explicitly
    override = {"allow_override": True} if "allow_override" in inspect.signature(library.impl).parameters else {}
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message=r"(?s).*Overriding a previously registered kernel"
        )
        library.impl("dynamic_block_quantize_op", cpu_impl, "CPU", **override)
    _state["library"] = library


def install_cpu_kernels(force: bool = False) -> bool:
    """Route modelopt's NVFP4 fake-quant kernels to the CPU emulation when CUDA is absent.

    Returns False, touching nothing, when ``torch.cuda.is_available()`` and not ``force``;
    otherwise patches (once; later calls are no-ops) and returns True. ``force`` is for a model
    that runs on the CPU of a machine with a GPU (``hardware.device: cpu``): the patched kernels
    compute with torch ops on whatever device their inputs are on. Patched: the ``triton_kernel`` module reference in
    ``modelopt.torch.quantization.tensor_quant`` (static fake quant, FP4 cast, dynamic block
    kernel) and the CPU kernel of the ``tensorrt::dynamic_block_quantize_op`` torch.library op
    (NVFP4 only; other formats fall through to modelopt's own implementation).
    """
    if torch.cuda.is_available() and not force:
        return False
    from modelopt.torch.quantization import tensor_quant

    if is_installed():
        return True
    _route_dynamic_block_op(tensor_quant)
    tensor_quant.triton_kernel = _CpuKernelModule(tensor_quant.triton_kernel)
    logger.warning(
        "%s: modelopt NVFP4 fake quantization runs emulated on CPU (qad_pipeline.nvfp4.nvfp4_cpu) - slow, "
        "meant for development, CI and CPU-only workers.",
        "hardware.device is cpu" if torch.cuda.is_available() else "No CUDA device",
    )
    return True
