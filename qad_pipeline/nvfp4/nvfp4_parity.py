"""Why Model Optimizer's GPU NVFP4 fake quantization differs from the CPU kernels, element by element.

The reference arithmetic is the exact float32 division ``|x| / scale`` of Model Optimizer's export
packer (``NVFP4QTensor.quantize``, which writes the checkpoint's FP4 codes and FP8 block scales
that the inference engine dequantizes); the CPU kernels in :mod:`qad_pipeline.nvfp4.nvfp4_cpu` compute
the same. Model Optimizer's Triton fake-quant kernels divide with Triton's float32 ``/``, which
on NVIDIA GPUs compiles to the approximate ``div.full.f32`` (at most 2 ulp from the exact
quotient). A quotient within 2 ulp of an E2M1 decision boundary may therefore round to the
boundary's other neighbour on the GPU, and a dynamic block scale within 2 ulp of an FP8 rounding
midpoint may round to the neighbouring FP8 value (which changes the whole block).

This module has two parts:

* a pure-torch transcription of the Triton kernels (``fp4_fake_quant_kernel``,
  ``static_blockwise_fp4_fake_quant_kernel`` via ``nvfp4_scalar_quant``,
  ``static_blockwise_fp4_cast_kernel``) in which every ``/`` of the Triton source goes through a
  pluggable :data:`Division`, in the source's order. With :func:`exact_division` it equals the
  CPU kernels; with :func:`reciprocal_division` (``a * fl32(1 / b)``) it models the GPU on a CPU;
  on a GPU, ``scripts/gpu_nvfp4_parity.py`` plugs in the quotient of a one-line Triton kernel
  (``a / b``), i.e. the hardware's own division, which should reproduce modelopt's kernels bit
  for bit;
* :func:`classify`, which sorts every element where another output differs from the reference
  into explained (an E2M1 boundary flip, or a block whose FP8 scale sits on a rounding edge) and
  unexplained (anything else: a real bug).

Division by a power of two is taken as exact (no flip is explained there): ``div.full.f32`` and
the reciprocal model both divide exactly by 2**k, and on an H200 the float32 parity cases, whose
exact ties have power-of-two scales, showed no difference at all.

Triton's CPU interpreter (``TRITON_INTERPRET=1``) can run Model Optimizer's kernel source, but it
computes with numpy, whose float32 ``/`` is exact: it checks the transcription, not the GPU's
division (``tests/test_nvfp4_parity.py``, skipped where triton is not installed).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F

from qad_pipeline.nvfp4 import nvfp4_cpu

__all__ = [
    "E2M1_BOUNDARIES",
    "ULP_BOUND",
    "BlockScales",
    "Classification",
    "Division",
    "classify",
    "dynamic_block_scales",
    "e2m1_magnitude",
    "exact_division",
    "reciprocal_division",
    "static_block_scales",
    "to_blocks",
    "triton_cast",
    "triton_dynamic",
    "triton_static",
]

Division = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
"""``div(a, b)`` for float32 tensors of one shape: how a kernel computes ``a / b``."""

E2M1_BOUNDARIES = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
_E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # boundary i lies between values i, i+1
ULP_BOUND = 2  # PTX ISA: div.full.f32 is at most 2 ulp from the exact quotient
_MIN_DYNAMIC_SCALE = torch.tensor(1e-5, dtype=torch.float32)  # the dynamic kernel's scale floor
_TINY_GLOBAL_SCALE = torch.tensor(1e-12, dtype=torch.float32)  # stands in for a zero global scale
# Every finite non-negative FP8 E4M3 value, ascending (code 0x7F is NaN), and the midpoints
# between neighbours, at which FP8 rounding changes value (all exact in float32).
_FP8_VALUES = torch.arange(127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
_FP8_MIDPOINTS = (_FP8_VALUES[:-1] + _FP8_VALUES[1:]) / 2


def exact_division(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """IEEE float32 division: the export packer, the CPU kernels and Triton's interpreter."""
    return a / b


def reciprocal_division(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a * fl32(1 / b)``: a CPU model of ``div.full.f32`` (reciprocal, then multiply).

    The hardware's reciprocal (``MUFU.RCP``) is not always the correctly rounded one, so this
    model can miss a few of the GPU's flips (and add a few); :func:`classify` bounds both.
    """
    return a * torch.reciprocal(b)


# --------------------------------------------------------------------------------------------
# the Triton kernels, transcribed (every `/` through `div`)


def e2m1_magnitude(abs_scaled: torch.Tensor) -> torch.Tensor:
    """``fp4_round_magnitude``: the kernels' comparison chain (ties to even), float32."""
    v = abs_scaled
    out = torch.full_like(v, 6.0)
    out = torch.where(v <= 5.0, 4.0, out)
    out = torch.where(v < 3.5, 3.0, out)
    out = torch.where(v <= 2.5, 2.0, out)
    out = torch.where(v < 1.75, 1.5, out)
    out = torch.where(v <= 1.25, 1.0, out)
    out = torch.where(v < 0.75, 0.5, out)
    return torch.where(v <= 0.25, 0.0, out)


def to_blocks(t: torch.Tensor, block_size: int = nvfp4_cpu.DYNAMIC_BLOCK_SIZE) -> torch.Tensor:
    """``t`` as [blocks, block_size] along its last dim, a short last block zero-padded (dtype kept).

    This is the dynamic kernel's layout, and the static kernel's too when its blocks are
    ``block_size`` consecutive elements (every parity case).
    """
    rows = t.reshape(-1, t.shape[-1]) if t.dim() else t.reshape(1, 1)
    pad = -rows.shape[-1] % block_size
    return F.pad(rows, (0, pad)).reshape(-1, block_size) if pad else rows.reshape(-1, block_size)


def _from_blocks(blocks: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`to_blocks` (drops the padding)."""
    cols = like.shape[-1]
    return blocks.reshape(like.numel() // cols, -1)[:, :cols].reshape(like.shape)


@dataclass(frozen=True)
class BlockScales:
    """The scale of each block, float32, and for FP8-rounded dynamic scales how they were made.

    ``scale = fp8_e4m3(fp8_units) * unit`` (then the 1e-5 floor) when ``fp8_units`` is given;
    static scales are computed by PyTorch outside the kernel and carry no FP8 detail.
    """

    scale: torch.Tensor  # [blocks]: what the kernel divides by and multiplies back
    fp8_units: torch.Tensor | None = None  # [blocks]: the quotient before FP8 rounding
    unit: torch.Tensor | None = None  # scalar: the global scale


def dynamic_block_scales(
    blocks: torch.Tensor, global_amax: torch.Tensor, div: Division = exact_division
) -> BlockScales:
    """``fp8_quantize_scale`` and the 1e-5 floor of ``fp4_fake_quant_kernel`` for [blocks, 16].

    The global scale ``global_amax / 2688`` is PyTorch on the host (CUDA: ``* fl32(1/2688)``);
    ``block_amax / (6.0 * global_scale)`` is the kernel's first Triton division.
    """
    global_scale = nvfp4_cpu.nvfp4_global_scale(global_amax.reshape(-1)[0]).to(blocks.device)
    global_scale = torch.where(global_scale > 0, global_scale, _TINY_GLOBAL_SCALE.to(blocks.device))
    block_max = blocks.float().abs().amax(-1)
    units = div(block_max, (6.0 * global_scale).expand_as(block_max))
    fp8 = units.clamp(max=nvfp4_cpu.E4M3_MAX).to(torch.float8_e4m3fn).float()
    return BlockScales(_floor(fp8 * global_scale), units, global_scale)


def _floor(scale: torch.Tensor) -> torch.Tensor:
    """The dynamic kernel's ``where(scale >= 1e-5, scale, 1.0)``."""
    return torch.where(scale >= _MIN_DYNAMIC_SCALE.to(scale.device), scale, 1.0)


def static_block_scales(scale: torch.Tensor) -> BlockScales:
    """``nvfp4_scalar_quant``'s safe scale: a zero, NaN or infinite host scale counts as 1."""
    scale = scale.reshape(-1).float()
    return BlockScales(torch.where((scale == 0) | ~torch.isfinite(scale), 1.0, scale))


def _quantize_blocks(blocks: torch.Tensor, scale: torch.Tensor, div: Division) -> torch.Tensor:
    """``|x| / scale``, rounded to E2M1, times scale, sign of x (``x >= 0``): float32 blocks."""
    s = scale.reshape(-1, 1).expand_as(blocks)
    magnitude = e2m1_magnitude(div(blocks.abs(), s)) * s
    return torch.where(blocks >= 0, magnitude, -magnitude)


def triton_dynamic(x: torch.Tensor, global_amax: torch.Tensor, div: Division) -> torch.Tensor:
    """``fp4_fake_quant_block`` (Hopper block-pointer kernel), 16-element blocks, x's dtype."""
    blocks = to_blocks(x).float()
    scales = dynamic_block_scales(blocks, global_amax, div)
    return _from_blocks(_quantize_blocks(blocks, scales.scale, div), x).to(x.dtype)


def triton_static(
    x: torch.Tensor, scale: torch.Tensor, div: Division, out_dtype: torch.dtype | None = None
) -> torch.Tensor:
    """``static_blockwise_fp4_fake_quant_kernel`` given the host's block scales (one per block)."""
    raw = scale.reshape(-1).float()
    blocks = x.reshape(raw.numel(), -1).float()
    out = _quantize_blocks(blocks, static_block_scales(raw).scale, div)
    out = torch.where((raw == 0).reshape(-1, 1), 0.0, out)
    return out.to(out_dtype or x.dtype).view(x.shape)


def triton_cast(x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``static_blockwise_fp4_cast_kernel``: no division, no scale."""
    xf = x.float()
    magnitude = e2m1_magnitude(xf.abs())
    return torch.where(xf >= 0, magnitude, -magnitude).to(out_dtype or x.dtype)


# --------------------------------------------------------------------------------------------
# the classifier


@dataclass
class Classification:
    """Where another output differs from the reference, and why."""

    numel: int
    mismatches: int = 0
    e2m1_boundary: int = 0  # exact quotient within the bound of an E2M1 boundary: neighbours swap
    fp8_block: int = 0  # the block's FP8 scale sits on a rounding edge: the other scale was used
    unexplained: int = 0
    examples: list[str] = field(default_factory=list)  # a few unexplained elements

    @property
    def explained(self) -> int:
        return self.e2m1_boundary + self.fp8_block

    @property
    def explained_rate(self) -> float:
        """Explained share of the mismatches (1.0 when there are none)."""
        return self.explained / self.mismatches if self.mismatches else 1.0


def _ulp(v: torch.Tensor) -> torch.Tensor:
    """Float32 spacing just above ``|v|``."""
    a = v.abs()
    return torch.nextafter(a, torch.full_like(a, float("inf"))) - a


def _near(value: torch.Tensor, edge: torch.Tensor, divisor: torch.Tensor, ulps: int) -> torch.Tensor:
    """Whether an exact quotient ``value`` lies within ``ulps`` float32 ulps of ``edge``.

    Never for a power-of-two ``divisor``: that division is exact on the GPU too, so an exact tie
    stays a tie and is rounded by the kernels' rule, never flipped.
    """
    mantissa, _ = torch.frexp(divisor)
    return (mantissa.abs() != 0.5) & ((value - edge).abs() <= ulps * _ulp(edge))


def _flip_candidates(
    x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, ulps: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per element: the exact-division output and the boundary's other neighbour (or the same).

    ``x`` and ``scale`` are float32 of one shape; outputs are signed, cast to ``dtype`` and back.
    """
    quotient = x.abs() / scale
    bounds = torch.tensor(E2M1_BOUNDARIES)
    nearest = (quotient.unsqueeze(-1) - bounds).abs().argmin(-1)
    boundary = bounds[nearest]
    near = _near(quotient, boundary, scale, ulps)
    values = torch.tensor(_E2M1_VALUES)
    exact = e2m1_magnitude(quotient)
    below, above = values[nearest], values[nearest + 1]
    flipped = torch.where(near, torch.where(exact == below, above, below), exact)

    def signed(magnitude: torch.Tensor) -> torch.Tensor:
        out = magnitude * scale
        return torch.where(x >= 0, out, -out).to(dtype).float()

    return signed(exact), signed(flipped)


def _fp8_neighbour(units: torch.Tensor, divisor: torch.Tensor, ulps: int) -> torch.Tensor:
    """The FP8 value across the nearest rounding midpoint, NaN where ``units`` is not on an edge."""
    mids = _FP8_MIDPOINTS.to(units.device)
    j = (units.unsqueeze(-1) - mids).abs().argmin(-1)
    on_edge = _near(units, mids[j], divisor.expand_as(units), ulps)
    rounded = units.clamp(max=nvfp4_cpu.E4M3_MAX).to(torch.float8_e4m3fn).float()
    lower, upper = _FP8_VALUES.to(units.device)[j], _FP8_VALUES.to(units.device)[j + 1]
    other = torch.where(rounded == lower, upper, lower)
    return torch.where(on_edge, other, float("nan"))


def classify(
    x: torch.Tensor,
    reference: torch.Tensor,
    other: torch.Tensor,
    scales: BlockScales,
    ulps: int = ULP_BOUND,
    max_examples: int = 3,
) -> Classification:
    """Classify every element where ``other`` differs from ``reference`` (NaN equals NaN).

    ``x`` is the kernel's input, ``reference`` the CPU kernels' output (exact division) and
    ``scales`` the reference's block scales, blocks as :func:`to_blocks` lays them out. An element
    is explained when ``|x| / scale`` lies within ``ulps`` float32 ulps of an E2M1 decision
    boundary and ``other`` is that boundary's other neighbour (never for a power-of-two scale,
    which every division divides by exactly).
    With ``scales.fp8_units``, a block whose pre-rounding scale lies within ``ulps`` of an FP8
    rounding midpoint, and whose every mismatch matches the neighbouring FP8 scale (up to such
    flips), is explained as a block. Everything else is unexplained, including a shape, dtype or
    NaN disagreement.
    """
    result = Classification(numel=reference.numel())
    if other.shape != reference.shape or other.dtype != reference.dtype:
        result.mismatches = result.unexplained = reference.numel()
        result.examples.append(
            f"shape/dtype {tuple(other.shape)} {other.dtype} vs "
            f"{tuple(reference.shape)} {reference.dtype}"
        )
        return result
    xb, rb, ob = (to_blocks(t.detach().cpu()).float() for t in (x, reference, other))
    differ = ~((rb == ob) | (rb.isnan() & ob.isnan()))
    result.mismatches = int(differ.sum())
    if not result.mismatches:
        return result
    scale = scales.scale.detach().cpu().float().reshape(-1)
    explained = torch.zeros_like(differ)

    if scales.fp8_units is not None and scales.unit is not None:
        blocks = differ.any(-1).nonzero().reshape(-1)
        units = scales.fp8_units.detach().cpu().float().reshape(-1)[blocks]
        unit = scales.unit.detach().cpu().float()
        neighbour = _fp8_neighbour(units, 6.0 * unit, ulps)  # units = block amax / (6 * unit)
        on_edge = ~neighbour.isnan()
        blocks = blocks[on_edge]
        alt = _floor(neighbour[on_edge] * unit)
        if blocks.numel():
            x_alt = xb[blocks]
            exact, flipped = _flip_candidates(x_alt, alt.reshape(-1, 1).expand_as(x_alt),
                                              reference.dtype, ulps)
            o = ob[blocks]
            fits = ((o == exact) | (o == flipped) | ~differ[blocks]).all(-1)
            explained[blocks[fits]] = differ[blocks[fits]]
            result.fp8_block = int(differ[blocks[fits]].sum())

    left = differ & ~explained
    idx = left.nonzero(as_tuple=True)
    if idx[0].numel():
        xs, os = xb[idx], ob[idx]
        _, flipped = _flip_candidates(xs, scale[idx[0]], reference.dtype, ulps)
        ok = os == flipped
        result.e2m1_boundary = int(ok.sum())
        bad = (~ok).nonzero().reshape(-1)
        result.unexplained = int(bad.numel())
        for k in bad[:max_examples].tolist():
            b, i = idx[0][k].item(), idx[1][k].item()
            s = scale[b].item()
            result.examples.append(
                f"block {b} [{i}] x={xs[k].item():.9g} ref={rb[b, i].item():.9g} "
                f"other={os[k].item():.9g} scale={s:.9g} |x|/scale={abs(xs[k].item()) / s:.9g}"
            )
    return result
