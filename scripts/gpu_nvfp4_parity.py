"""Run on a CUDA machine from the repo root: python scripts/gpu_nvfp4_parity.py

Compares modelopt's CUDA/Triton NVFP4 fake-quant kernels (on the GPU) with the CPU kernels in
``qad_pipeline.nvfp4.nvfp4_cpu`` (on ``.cpu()`` copies of the same inputs), element for element, and
explains every difference with ``qad_pipeline.nvfp4.nvfp4_parity.classify``:

* dynamic path: ``tensorrt::dynamic_block_quantize_op`` (Triton ``fp4_fake_quant_block``) vs
  ``nvfp4_cpu.fp4_fake_quant_block``;
* static path (MSE, four-over-six, LSQ init): ``tensor_quant.static_blockwise_fp4_fake_quant``
  vs ``nvfp4_cpu.static_blockwise_fp4_fake_quant``, block-scale normalisation 448 and 256, with
  and without FP8 block scales, and the block scales alone (``compute_fp4_scales``, compared
  exactly: PyTorch computes them outside Triton);
* FP4 cast (LSQ): ``tensor_quant.fp4_cast_ste`` vs ``nvfp4_cpu.static_blockwise_fp4_cast``
  (no division: compared exactly).

The CPU kernels divide exactly, as the export packer does; the Triton kernels divide with the
approximate ``div.full.f32``. A mismatch is explained when the exact quotient lies within 2 ulp
of an E2M1 decision boundary and the outputs are that boundary's neighbours, or when a dynamic
block's FP8 scale sits within 2 ulp of an FP8 rounding midpoint; anything else is unexplained.
The division hypothesis itself is checked too: ``nvfp4_parity``'s transcription of the Triton
kernels, run on the GPU with the quotients of a one-line Triton kernel (``a / b``), should equal
modelopt's kernels bit for bit ("model" column: differing elements, expected 0).

Inputs: ``tests/nvfp4_cases.py``. ``--cpu-model`` runs everything on the CPU with the reciprocal
model of the GPU's division (``a * fl32(1/b)``) standing in for modelopt's kernels. Exit code 0:
every mismatch explained; 1: an unexplained element (or a shape/dtype/NaN disagreement);
2: cannot run (no CUDA / no Triton kernels).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from qad_pipeline.nvfp4 import nvfp4_cpu  # noqa: E402
from qad_pipeline.nvfp4 import nvfp4_parity as parity  # noqa: E402
from tests.nvfp4_cases import (  # noqa: E402
    BLOCK,
    PARITY_SIZE,
    cast_cases,
    dtype_name,
    dynamic_cases,
    static_cases,
)


@dataclass
class Kernels:
    """The kernels under test as the comparison calls them (inputs already on ``device``)."""

    device: str
    dynamic: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    static: Callable[..., torch.Tensor]
    block_scales: Callable[..., torch.Tensor]
    cast: Callable[[torch.Tensor], torch.Tensor]
    e4m3_division: nvfp4_cpu.E4M3ScaleDivision
    division: parity.Division | None  # the device's own a / b, for the model; None: no model
    description: str


def triton_division() -> parity.Division:
    """The quotient of Triton's float32 ``/`` (``div.full.f32`` on NVIDIA GPUs), elementwise."""
    import triton
    import triton.language as tl

    @triton.jit
    def divide_kernel(a_ptr, b_ptr, out_ptr, n, TILE: tl.constexpr):
        offs = tl.program_id(0) * TILE + tl.arange(0, TILE)
        mask = offs < n
        a = tl.load(a_ptr + offs, mask=mask, other=1.0)
        b = tl.load(b_ptr + offs, mask=mask, other=1.0)
        tl.store(out_ptr + offs, a / b, mask=mask)

    def divide(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        a = a.float().contiguous()
        b = b.float().expand_as(a).contiguous()
        out = torch.empty_like(a)
        if a.numel():
            divide_kernel[(triton.cdiv(a.numel(), 1024),)](a, b, out, a.numel(), TILE=1024)
        return out

    return divide


def modelopt_gpu_kernels() -> Kernels:
    """modelopt's CUDA kernels; raises RuntimeError when they are not usable here."""
    if not torch.cuda.is_available():
        raise RuntimeError("no CUDA device")
    from modelopt.torch.quantization import tensor_quant
    from modelopt.torch.quantization.extensions import get_cuda_ext_fp8

    kernels = tensor_quant.triton_kernel
    if not kernels.IS_AVAILABLE:
        raise RuntimeError("modelopt's Triton kernels are not available (is triton installed?)")
    dynamic_backend = (
        "triton fp4_fake_quant_block"
        if hasattr(kernels, "fp4_fake_quant_block") and not tensor_quant.DISABLE_TRITON_KERNEL
        else "CUDA extension fused_amax_convert (compute capability < 8.9; NOT what is emulated)"
    )
    fp8_ext = get_cuda_ext_fp8(raise_if_failed=False)

    def dynamic(x: torch.Tensor, global_amax: torch.Tensor) -> torch.Tensor:
        return tensor_quant.dynamic_block_quantize_op(x, BLOCK, global_amax, 4, 2, 8, 4)

    def static(x, amax, global_amax, quantize_scales, fp8_max, out_dtype):
        return tensor_quant.static_blockwise_fp4_fake_quant(
            x, amax, global_amax, quantize_scales, fp8_max, out_dtype, False
        )

    return Kernels(
        device="cuda",
        dynamic=dynamic,
        static=static,
        block_scales=kernels.compute_fp4_scales,
        cast=tensor_quant.fp4_cast_ste,
        e4m3_division="cuda_ext" if fp8_ext is not None else "eager",
        division=triton_division(),
        description=(
            f"{torch.cuda.get_device_name()}, torch {torch.__version__}, dynamic path: "
            f"{dynamic_backend}, FP8 scale fake quant: "
            f"{'CUDA extension' if fp8_ext is not None else 'PyTorch fallback'}"
        ),
    )


def cpu_model_kernels() -> Kernels:
    """The Triton transcription with the reciprocal division, on the CPU, as the kernels under test."""
    div = parity.reciprocal_division

    def static(x, amax, global_amax, quantize_scales, fp8_max, out_dtype):
        scale = nvfp4_cpu.compute_fp4_scales(amax, global_amax, quantize_scales, fp8_max)
        return parity.triton_static(x, scale, div, out_dtype)

    return Kernels(
        device="cpu",
        dynamic=lambda x, global_amax: parity.triton_dynamic(x, global_amax, div),
        static=static,
        block_scales=nvfp4_cpu.compute_fp4_scales,
        cast=parity.triton_cast,
        e4m3_division="cuda_ext",
        division=div,
        description="CPU: Triton transcription with a * fl32(1/b) standing in for modelopt's kernels",
    )


# --------------------------------------------------------------------------------------------
# comparison


@dataclass
class CaseResult:
    name: str
    verdict: parity.Classification
    max_abs_diff: float
    model_diffs: int | None  # hardware-division model vs the kernels under test; None: not run


def _differing(a: torch.Tensor, b: torch.Tensor) -> int:
    """Elements that differ (NaN equals NaN); every element when shape or dtype differ."""
    a, b = a.detach().cpu(), b.detach().cpu()
    if a.shape != b.shape or a.dtype != b.dtype:
        return max(a.numel(), b.numel())
    a, b = a.float(), b.float()
    return int((~((a == b) | (a.isnan() & b.isnan()))).sum())


def _max_abs_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.shape != b.shape:
        return float("inf")
    diff = (a.detach().cpu().float() - b.float()).abs().nan_to_num(0.0)
    return float(diff.max()) if diff.numel() else 0.0


def _exact(reference: torch.Tensor, other: torch.Tensor) -> parity.Classification:
    """No division involved: every mismatch is unexplained."""
    bad = _differing(reference, other)
    verdict = parity.Classification(numel=reference.numel(), mismatches=bad, unexplained=bad)
    if bad:
        verdict.examples.append(f"{bad} elements differ (no division here: exact comparison)")
    return verdict


def _case(name, x, reference, out, scales, model) -> CaseResult:
    """Classify ``out`` against ``reference``; ``model`` is the hardware-division model's output."""
    out = out.detach().cpu()
    verdict = parity.classify(x, reference, out, scales) if scales else _exact(reference, out)
    model_diffs = None if model is None else _differing(model, out)
    return CaseResult(name, verdict, _max_abs_diff(out, reference), model_diffs)


def run(kernels: Kernels, size: tuple[int, int] = PARITY_SIZE) -> list[CaseResult]:
    """Every case; the CPU kernels always run on ``.cpu()`` copies."""
    dev, div, division = kernels.device, kernels.division, kernels.e4m3_division
    results = []
    for name, x, amax in dynamic_cases(size):
        amax = x.float().abs().amax() if amax is None else amax
        out = kernels.dynamic(x.to(dev), amax.to(dev))
        reference = nvfp4_cpu.fp4_fake_quant_block(x, amax)
        scales = parity.dynamic_block_scales(parity.to_blocks(x).float(), amax)
        model = None if div is None else parity.triton_dynamic(x.to(dev), amax.to(dev), div)
        results.append(_case(f"dynamic/{name}", x, reference, out, scales, model))
    for name, x, amax, global_amax in static_cases(size):
        xd, amax_d, global_d = x.to(dev), amax.to(dev), global_amax.to(dev)
        variants = [(True, fp8_max) for fp8_max in (448.0, 256.0)] + [(False, 448.0)]
        for quantized, fp8_max in variants:
            scale = nvfp4_cpu.compute_fp4_scales(
                amax, global_amax, quantized, fp8_max, e4m3_division=division
            )
            scale_dev = kernels.block_scales(amax_d, global_d, quantized, fp8_max)
            label = f"static/{name}/fp8max{int(fp8_max)}" if quantized else f"static/{name}"
            out_dtypes = dict.fromkeys((x.dtype, torch.float32)) if quantized else (x.dtype,)
            for out_dtype in out_dtypes:
                out = kernels.static(xd, amax_d, global_d, quantized, fp8_max, out_dtype)
                reference = nvfp4_cpu.static_blockwise_fp4_fake_quant(
                    x, amax, global_amax, quantized, fp8_max, out_dtype, e4m3_division=division
                )
                model = None if div is None else parity.triton_static(xd, scale_dev, div, out_dtype)
                suffix = f"/out_{dtype_name(out_dtype)}" if quantized else "/unquantized_scales"
                scales = parity.static_block_scales(scale)
                results.append(_case(label + suffix, x, reference, out, scales, model))
            if quantized:
                results.append(_case(f"block_scales/{name}/fp8max{int(fp8_max)}", amax, scale,
                                     scale_dev, None, None))
    for name, x in cast_cases(size):
        out = kernels.cast(x.to(dev))
        model = None if div is None else parity.triton_cast(x.to(dev))
        reference = nvfp4_cpu.static_blockwise_fp4_cast(x)
        results.append(_case(f"cast/{name}", x, reference, out, None, model))
    return results


def report(results: list[CaseResult]) -> int:
    """One line per case (unexplained examples below it) and a summary; return the exit code."""
    width = max(len(r.name) for r in results)
    for r in results:
        v = r.verdict
        status = "UNEXPLAINED" if v.unexplained else ("explained" if v.mismatches else "equal")
        model = "-" if r.model_diffs is None else str(r.model_diffs)
        flag = "  MODEL DIFFERS" if r.model_diffs else ""
        print(
            f"{r.name:<{width}}  n={v.numel:>7}  mismatches={v.mismatches:>5}  "
            f"explained={v.explained_rate:>7.2%} (e2m1 {v.e2m1_boundary}, fp8 block {v.fp8_block})"
            f"  unexplained={v.unexplained}  max_abs_diff={r.max_abs_diff:.3e}  model={model}"
            f"  {status}{flag}"
        )
        for example in v.examples:
            print(f"{'':<{width}}    {example}")
    mismatching = [r.verdict for r in results if r.verdict.mismatches]
    total = sum(v.mismatches for v in mismatching)
    unexplained = sum(v.unexplained for v in mismatching)
    modelled = [r.model_diffs for r in results if r.model_diffs is not None]
    model_total = sum(modelled)
    if modelled:
        print(
            f"\nhardware-division model vs the kernels: {model_total} differing elements in "
            f"{sum(d > 0 for d in modelled)} of {len(modelled)} modelled; "
            + ("the division hypothesis holds" if model_total == 0 else "HYPOTHESIS NOT CONFIRMED")
        )
    print(
        f"{len(results)} cases, {len(mismatching)} with mismatches, {total} mismatching elements, "
        f"{sum(v.e2m1_boundary for v in mismatching)} E2M1-boundary + "
        f"{sum(v.fp8_block for v in mismatching)} FP8-block explained, {unexplained} unexplained"
        + ("" if not modelled else f"; model differences {model_total}")
    )
    return 1 if unexplained else 0


def main() -> int:
    """Entry point: 0 every mismatch explained, 1 unexplained ones, 2 cannot run here."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu-model", action="store_true",
                        help="the reciprocal-division model on the CPU instead of modelopt's kernels")
    parser.add_argument("--size", type=int, nargs=2, default=PARITY_SIZE, metavar=("ROWS", "COLS"),
                        help="rows and columns of the test tensors (at least 16 x 64)")
    args = parser.parse_args()
    try:
        kernels = cpu_model_kernels() if args.cpu_model else modelopt_gpu_kernels()
    except (RuntimeError, ImportError) as err:
        print(f"cannot run the parity check: {err}", file=sys.stderr)
        return 2
    print(kernels.description, f"| CPU kernels e4m3_division={kernels.e4m3_division}\n")
    with torch.no_grad():
        return report(run(kernels, tuple(args.size)))


if __name__ == "__main__":
    sys.exit(main())
