"""Size accounting: the storage format of every weight, effective bits per element, bytes.

Effective bits per element (BPE) as the documents define it, over all of the model's weights:
NVFP4 stores 4 bits per element plus one FP8 (E4M3) scale per 16-element block plus one FP32
scale per tensor (>= 4.5 BPE); FP8 stores 8 bits plus its FP32 scale(s); a weight left
unquantized keeps its own dtype (16 bits in a BF16 checkpoint). The accounting reads what the
quantized model actually holds, so a recipe whose pattern silently matched nothing shows it.
"""

from __future__ import annotations

from collections import Counter
import math
from dataclasses import dataclass

import torch

from qad_pipeline.core.config import BaseModelParams, resolve

FP8_SCALE_BITS = 8
TENSOR_SCALE_BITS = 32


@dataclass(frozen=True)
class TensorFormat:
    """How one weight tensor (or one expert's slice of a fused tensor) is stored."""

    name: str  # "nvfp4", "fp8", or the dtype of an unquantized weight ("bf16", "fp32")
    element_bits: int
    quantized: bool = False
    block_size: int | None = None  # elements per FP8 block scale (NVFP4)
    scale_axis: int | None = None  # one FP32 scale per channel along this axis (FP8 per-channel)


def tensor_bits(fmt: TensorFormat, shape: tuple[int, ...]) -> int:
    """Storage bits of one tensor of `shape` in format `fmt`, scales included."""
    numel = math.prod(shape)
    bits = numel * fmt.element_bits
    if not fmt.quantized:
        return bits
    if fmt.block_size:
        return bits + math.ceil(numel / fmt.block_size) * FP8_SCALE_BITS + TENSOR_SCALE_BITS
    scales = shape[fmt.scale_axis] if fmt.scale_axis is not None else 1
    return bits + scales * TENSOR_SCALE_BITS


def quantizer_format(quantizer, dtype: torch.dtype) -> TensorFormat:
    """The storage format a weight quantizer implies (the weight's dtype when disabled or absent)."""
    if quantizer is None or not quantizer.is_enabled:
        bits = torch.finfo(dtype).bits
        return TensorFormat({16: "bf16" if dtype == torch.bfloat16 else "fp16", 32: "fp32"}[bits], bits)
    num_bits = quantizer.num_bits
    blocks = quantizer.block_sizes or {}
    if num_bits == (2, 1) and blocks.get("scale_bits") == (4, 3):
        return TensorFormat("nvfp4", 4, quantized=True, block_size=blocks.get(-1, 16))
    if num_bits == (4, 3) and not blocks:
        axis = quantizer.axis
        return TensorFormat("fp8", 8, quantized=True, scale_axis=axis if isinstance(axis, int) else None)
    raise ValueError(
        f"no size accounting for quantizer format num_bits={num_bits} block_sizes={blocks}; "
        "supported: NVFP4 (e2m1 with e4m3 block scales), FP8 (e4m3), unquantized"
    )


def weight_formats(model: torch.nn.Module) -> dict[str, list[TensorFormat]]:
    """Every parameter's storage format: one entry per tensor, or one per expert of a fused one."""
    formats: dict[str, list[TensorFormat]] = {}
    seen: set[int] = set()
    for mod_name, module in model.named_modules():
        for p_name, param in module.named_parameters(recurse=False):
            if id(param) in seen:  # tied weights count once
                continue
            seen.add(id(param))
            full = f"{mod_name}.{p_name}" if mod_name else p_name
            fused = getattr(module, f"{p_name}_weight_quantizers", None)
            if fused is not None:
                formats[full] = [quantizer_format(q, param.dtype) for q in fused]
            else:
                q = getattr(module, "weight_quantizer", None) if p_name == "weight" else None
                formats[full] = [quantizer_format(q, param.dtype)]
    return formats


def size_report(model: torch.nn.Module) -> dict:
    """Effective BPE, bytes and BF16 bytes over all weights, plus a per-format element count."""
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    total_bits = numel_total = 0
    by_format: Counter[str] = Counter()
    layer_formats: dict[str, str] = {}
    for name, fmts in weight_formats(model).items():
        shape = shapes[name]
        parts = len(fmts)
        part_shape = shape[1:] if parts > 1 else shape
        for fmt in fmts:
            total_bits += tensor_bits(fmt, part_shape)
            numel_total += math.prod(part_shape)
            by_format[fmt.name] += math.prod(part_shape)
        names = sorted({f.name for f in fmts})
        layer_formats[name] = names[0] if len(names) == 1 else "+".join(names)
    return {
        "effective_bpe": total_bits / numel_total,
        "size_bytes": total_bits // 8,
        "bf16_size_bytes": numel_total * 2,
        "parameters": numel_total,
        "elements_by_format": dict(by_format),
        "layer_formats": layer_formats,
    }


def kv_cache_format(model: torch.nn.Module) -> str:
    """The KV cache format the recipe set: that of the attention modules' K/V bmm quantizers."""
    names = set()
    for name, module in model.named_modules():
        if name.endswith(("k_bmm_quantizer", "v_bmm_quantizer")):
            names.add(quantizer_format(module, torch.bfloat16).name)
    return "+".join(sorted(names)) if names else "none"


def tokenizer_bytes(model: BaseModelParams) -> int:
    """The tokenizer files every saved checkpoint gets beside its weights (PTQ, QAD, the export): a
    local base-model folder's; a hub model's: 64 MiB at most."""
    folder = resolve(model.path)
    if not folder.is_dir():
        return 64 * 2**20
    return sum(p.stat().st_size for p in folder.iterdir() if p.is_file() and p.name.startswith(("tokenizer", "vocab",
                                                                                              "merges", "special")))
