"""Run on a CUDA machine from the repo root: python scripts/gpu_nvfp4_parity.py

Compares modelopt's CUDA/Triton NVFP4 fake-quant kernels (on the GPU) with the CPU emulation in
``qad_pipeline.nvfp4_cpu`` (on ``.cpu()`` copies of the same inputs), element for element:

* dynamic path: ``tensorrt::dynamic_block_quantize_op`` (Triton ``fp4_fake_quant_block``) vs
  ``nvfp4_cpu.fp4_fake_quant_block``;
* static path (MSE, four-over-six, LSQ init): ``tensor_quant.static_blockwise_fp4_fake_quant``
  vs ``nvfp4_cpu.static_blockwise_fp4_fake_quant``, block-scale normalisation 448 and 256, with
  and without FP8 block scales, and the block scales alone (``compute_fp4_scales``);
* FP4 cast (LSQ): ``tensor_quant.fp4_cast_ste`` vs ``nvfp4_cpu.static_blockwise_fp4_cast``.

Inputs: random normal, outliers, all negative, heavy-tailed, sparse, each with all-zero and constant
blocks; float32 / bfloat16 / float16; exact E2M1 ties; blocks whose scale falls under the dynamic
kernel's 1e-5 floor or underflows FP8; a short last block and a 3-D tensor. Per case it prints the
number of mismatching elements and the largest absolute difference, with a few examples. Exit code
0: all equal; 1: some mismatch; 2: cannot run (no CUDA / no Triton kernels).

Expected residue, if any: the Triton kernels divide with the approximate ``div.full.f32``, so
an element within 2 ulp of an E2M1 decision boundary (e.g. the constructed ties) or a block scale
within 2 ulp of an FP8 rounding midpoint may round differently; everything else should be equal.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from qad_pipeline import nvfp4_cpu  # noqa: E402
from tests.nvfp4_cases import BLOCK, KINDS, sample  # noqa: E402

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
TIES = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0])


@dataclass
class GpuKernels:
    """modelopt's kernels as the comparison calls them (inputs already on ``device``)."""

    device: str
    dynamic: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    static: Callable[..., torch.Tensor]
    block_scales: Callable[..., torch.Tensor]
    cast: Callable[[torch.Tensor], torch.Tensor]
    e4m3_division: nvfp4_cpu.E4M3ScaleDivision
    description: str


def modelopt_gpu_kernels() -> GpuKernels:
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
    division: nvfp4_cpu.E4M3ScaleDivision = "cuda_ext" if fp8_ext is not None else "eager"

    def dynamic(x: torch.Tensor, global_amax: torch.Tensor) -> torch.Tensor:
        return tensor_quant.dynamic_block_quantize_op(x, BLOCK, global_amax, 4, 2, 8, 4)

    def static(x, amax, global_amax, quantize_scales, fp8_max, out_dtype):
        return tensor_quant.static_blockwise_fp4_fake_quant(
            x, amax, global_amax, quantize_scales, fp8_max, out_dtype, False
        )

    return GpuKernels(
        device="cuda",
        dynamic=dynamic,
        static=static,
        block_scales=kernels.compute_fp4_scales,
        cast=tensor_quant.fp4_cast_ste,
        e4m3_division=division,
        description=(
            f"{torch.cuda.get_device_name()}, torch {torch.__version__}, dynamic path: "
            f"{dynamic_backend}, FP8 scale fake quant: "
            f"{'CUDA extension' if fp8_ext is not None else 'PyTorch fallback'}"
        ),
    )


# --------------------------------------------------------------------------------------------
# inputs


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")




def with_ties(x: torch.Tensor) -> torch.Tensor:
    """Blocks of exact E2M1 decision boundaries times 2**-8 .. 2**-1 (block amax 6 * 2**k).

    With a global amax of 5.25 (dynamic; global scale 2**-9) or 6 (static) every such block gets
    the exact scale 2**k, so ``|x| / scale`` lands exactly on the boundaries.
    """
    x = x.clone()
    rows = x.view(-1, x.shape[-1])
    ties = torch.cat([TIES, -TIES]).to(x.dtype)
    for r in range(3, 11):
        rows[r, :BLOCK] = ties * 2.0 ** (r - 11)
    return x


def with_tiny_blocks(x: torch.Tensor) -> torch.Tensor:
    """Blocks far below the tensor's amax: FP8 scale underflow and the 1e-5 dynamic floor."""
    x = x.clone()
    rows = x.view(-1, x.shape[-1])
    for r, factor in zip(range(3, 7), (1e-3, 1e-5, 1e-7, 1e-9)):
        rows[r, :BLOCK] *= factor
    return x


def block_amax(x: torch.Tensor) -> torch.Tensor:
    """Per-16-element amax over the flattened tensor, float32."""
    return x.float().reshape(-1, BLOCK).abs().amax(-1)


def dynamic_cases() -> Iterator[tuple[str, torch.Tensor, torch.Tensor]]:
    """(name, x, global_amax) for the dynamic path."""
    for dtype in DTYPES:
        dname = _dtype_name(dtype)
        for i, kind in enumerate(KINDS):
            x = sample(kind, (256, 1024), dtype, seed=i)
            amax = x.float().abs().amax()
            yield f"{kind}/{dname}", x, amax
            yield f"{kind}/{dname}/amax*1.3", x, amax * 1.3
        x = sample("normal", (256, 1024), dtype, seed=40)
        yield f"ties/{dname}", with_ties(x), torch.tensor(5.25)
        x = with_tiny_blocks(sample("normal", (256, 1024), dtype, seed=41))
        yield f"tiny_blocks/{dname}", x, x.float().abs().amax()
        yield f"small_global_amax/{dname}", x * 1e-3, torch.tensor(1e-3)
        yield f"reciprocal_form_amax/{dname}", x * 0.2, torch.tensor(1.0090899467468262)
        yield f"zero_global_amax/{dname}", torch.zeros(64, 128, dtype=dtype), torch.tensor(0.0)
        yield f"short_last_block/{dname}", sample("normal", (96, 1000), dtype, seed=42), None
        yield f"3d/{dname}", sample("outliers", (4, 64, 512), dtype, seed=43), None


def static_cases() -> Iterator[tuple[str, torch.Tensor, torch.Tensor, torch.Tensor]]:
    """(name, x as [blocks, 16], per-block amax, global amax) for the static path."""
    for dtype in DTYPES:
        dname = _dtype_name(dtype)
        for i, kind in enumerate(KINDS):
            x = sample(kind, (256, 1024), dtype, seed=10 + i)
            amax = block_amax(x)
            for label, factor in (("", 1.0), ("/amax*0.9", 0.9), ("/amax*1.5", 1.5)):
                blocks, global_amax = x.reshape(-1, BLOCK), x.float().abs().amax()
                yield f"{kind}/{dname}{label}", blocks, amax * factor, global_amax
        x = with_ties(sample("normal", (256, 1024), dtype, seed=50))
        yield f"ties/{dname}", x.reshape(-1, BLOCK), block_amax(x), torch.tensor(6.0)
        x = with_tiny_blocks(sample("normal", (256, 1024), dtype, seed=51))
        yield f"tiny_blocks/{dname}", x.reshape(-1, BLOCK), block_amax(x), x.float().abs().amax()
        x = sample("normal", (256, 1024), dtype, seed=52)
        # For this global amax the CUDA (reciprocal) and CPU (true division) forms differ.
        blocks, global_amax = x.reshape(-1, BLOCK) * 0.2, torch.tensor(1.0090899467468262)
        yield f"reciprocal_form_amax/{dname}", blocks, block_amax(x) * 0.2, global_amax


# --------------------------------------------------------------------------------------------
# comparison


@dataclass
class Result:
    name: str
    numel: int
    mismatches: int
    max_abs_diff: float
    examples: list[str]


def compare(name: str, gpu: torch.Tensor, cpu: torch.Tensor, x: torch.Tensor | None) -> Result:
    """Mismatch count (NaN == NaN) and largest absolute difference between two results."""
    gpu = gpu.detach().cpu()
    if gpu.shape != cpu.shape or gpu.dtype != cpu.dtype:
        problem = f"shape/dtype {gpu.shape} {gpu.dtype} vs {cpu.shape} {cpu.dtype}"
        return Result(name, cpu.numel(), cpu.numel(), math.inf, [problem])
    g, c = gpu.float().reshape(-1), cpu.float().reshape(-1)
    differ = ~((g == c) | (g.isnan() & c.isnan()))
    diff = (g - c).abs()[differ]
    show_x = x is not None and x.numel() == g.numel()
    examples = []
    for i in differ.nonzero().reshape(-1)[:3].tolist():
        source = f"x={x.reshape(-1)[i].item():.9g} " if show_x else ""
        examples.append(f"[{i}] {source}gpu={g[i].item():.9g} cpu={c[i].item():.9g}")
    max_diff = float(diff.max()) if diff.numel() else 0.0
    return Result(name, g.numel(), int(differ.sum()), max_diff, examples)


def run(gpu: GpuKernels) -> list[Result]:
    """All comparisons; CPU side always runs on ``.cpu()`` copies."""
    dev = gpu.device
    division = gpu.e4m3_division
    results = []
    for name, x, amax in dynamic_cases():
        amax = x.float().abs().amax() if amax is None else amax
        out_gpu = gpu.dynamic(x.to(dev), amax.to(dev))
        out_cpu = nvfp4_cpu.fp4_fake_quant_block(x.cpu(), amax.cpu())
        results.append(compare(f"dynamic/{name}", out_gpu, out_cpu, x))
    for name, x, amax, global_amax in static_cases():
        for fp8_max in (448.0, 256.0):
            for out_dtype in dict.fromkeys((x.dtype, torch.float32)):
                out_gpu = gpu.static(
                    x.to(dev), amax.to(dev), global_amax.to(dev), True, fp8_max, out_dtype
                )
                out_cpu = nvfp4_cpu.static_blockwise_fp4_fake_quant(
                    x.cpu(), amax, global_amax, True, fp8_max, out_dtype, e4m3_division=division
                )
                label = f"static/{name}/fp8max{int(fp8_max)}/out_{_dtype_name(out_dtype)}"
                results.append(compare(label, out_gpu, out_cpu, x))
            scales_gpu = gpu.block_scales(amax.to(dev), global_amax.to(dev), True, fp8_max)
            scales_cpu = nvfp4_cpu.compute_fp4_scales(
                amax, global_amax, True, fp8_max, e4m3_division=division
            )
            label = f"block_scales/{name}/fp8max{int(fp8_max)}"
            results.append(compare(label, scales_gpu, scales_cpu, None))
        out_gpu = gpu.static(x.to(dev), amax.to(dev), global_amax.to(dev), False, 448.0, x.dtype)
        out_cpu = nvfp4_cpu.static_blockwise_fp4_fake_quant(
            x, amax, global_amax, False, 448.0, x.dtype
        )
        results.append(compare(f"static/{name}/unquantized_scales", out_gpu, out_cpu, x))
    for dtype in DTYPES:
        x = (sample("normal", (256, 1024), torch.float32, seed=60) * 4).to(dtype)
        x = with_ties(x)
        out_gpu, out_cpu = gpu.cast(x.to(dev)), nvfp4_cpu.static_blockwise_fp4_cast(x)
        results.append(compare(f"cast/{_dtype_name(dtype)}", out_gpu, out_cpu, x))
    return results


def report(results: list[Result]) -> int:
    """Print one line per case and a summary; return the number of mismatching cases."""
    width = max(len(r.name) for r in results)
    bad = 0
    for r in results:
        status = "ok" if r.mismatches == 0 else "MISMATCH"
        print(
            f"{r.name:<{width}}  n={r.numel:>8}  mismatches={r.mismatches:>7}  "
            f"max_abs_diff={r.max_abs_diff:.3e}  {status}"
        )
        for example in r.examples:
            print(f"{'':<{width}}    {example}")
        bad += r.mismatches > 0
    total = sum(r.mismatches for r in results)
    print(f"\n{len(results)} cases, {bad} with mismatches, {total} mismatching elements")
    return bad


def main() -> int:
    """Entry point: 0 all equal, 1 mismatches, 2 cannot run here."""
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()
    try:
        gpu = modelopt_gpu_kernels()
    except (RuntimeError, ImportError) as err:
        print(f"cannot run the parity check: {err}", file=sys.stderr)
        return 2
    print(gpu.description, f"| CPU emulation e4m3_division={gpu.e4m3_division}\n")
    with torch.no_grad():
        bad = report(run(gpu))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
