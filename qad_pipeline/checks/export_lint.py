"""The export's lint (check c of `qad_pipeline.checks.export_checks`): the failures users report of NVFP4
checkpoints that load but serve wrongly, found in the tensors and configs before anything is read
back. `lint_folder` runs its static rules on any export folder, without the student; the export
stage adds the student's calibrated input and global weight scales (`student_input_scales`,
`student_weight_scales`). Each rule's failure class is an entry of `qad_pipeline.checks.failure_catalog`.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from qad_pipeline.core.artifacts import read_json
from qad_pipeline.checks.export_checks import is_weight, normalize, read_tensors, tensor_format

SCALE_SUFFIXES = ("weight_scale", "weight_scale_2", "input_scale", "k_scale", "v_scale")
FUSED_SIBLINGS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"), ("w1", "w3"))  # one GEMM in a server
INPUT_QUANTIZING_ALGOS = {"NVFP4", "FP8", "W4A8_NVFP4_FP8"}


def layer_algo(module: str, quant_config: dict) -> str | None:
    """The quantization algorithm hf_quant_config gives `module` (an expert's projection takes its
    MoE block's), or None where it excludes it."""
    from fnmatch import fnmatch

    q = quant_config.get("quantization", {})
    layers = q.get("quantized_layers")
    if layers:
        spec = layers.get(module) or layers.get(re.sub(r"\.experts\.\d+\..*$", ".experts", module)) or {}
        return spec.get("quant_algo")
    if any(fnmatch(module, pattern) for pattern in q.get("exclude_modules") or []):
        return None
    return q.get("quant_algo")


def lint(tensors: dict[str, torch.Tensor], input_scales: dict[str, float], config: dict | None = None,
         quant_config: dict | None = None, weight_scales: dict[str, float] | None = None) -> dict:
    """(c) The failures users report of NVFP4 checkpoints that load but serve wrongly, one line per
    tensor: a scale that is zero, negative, NaN or infinite (an MoE expert calibration never routed
    to, exported with a zero input scale, gives NaN in vLLM); an NVFP4 weight without its FP8 block
    scales or FP32 global scale, or block scales that do not cover it; an input scale that is not
    the student's calibrated one (`input_scales`: module -> amax / (6 x 448), or amax / 448 for FP8),
    a global weight scale that is not the student's (`weight_scales`: module -> amax / (6 x 448)).
    With the checkpoint's `config` and `quant_config` (hf_quant_config.json), the rules that need no
    student (`lint_config`; `lint_folder` runs them on any export folder)."""
    problems = []
    for name, t in tensors.items():
        if name.rsplit(".", 1)[-1] in SCALE_SUFFIXES:
            bad = ~torch.isfinite(t.float()) | (t.float() <= 0)
            if bool(bad.any()):
                problems.append(f"{name}: {int(bad.sum())} of {t.numel()} scale values are not finite and > 0")
    for name, t in tensors.items():
        if not name.endswith(".weight") or tensor_format(name, tensors) != "nvfp4":
            continue
        base = name.removesuffix(".weight")
        block, glob = tensors.get(f"{base}.weight_scale"), tensors.get(f"{base}.weight_scale_2")
        if glob is None or glob.dtype != torch.float32:
            problems.append(f"{base}.weight_scale_2: the NVFP4 weight's FP32 global scale is missing or not float32")
        if block.dtype != torch.float8_e4m3fn or block.shape[-1] * 8 != t.shape[-1]:
            problems.append(f"{base}.weight_scale: {block.dtype} {tuple(block.shape)} does not hold one FP8 scale "
                            f"per 16 elements of the packed weight {tuple(t.shape)}")
    for suffix, expected_scales, what in (("input_scale", input_scales, "quantizes this layer's input"),
                                          ("weight_scale_2", weight_scales or {}, "quantizes this layer's weight")):
        stored = {normalize(n.removesuffix(f".{suffix}")): n for n in tensors if n.endswith(f".{suffix}")}
        for module, expected in expected_scales.items():  # in-memory names; the export may rename (`normalize`)
            name = stored.get(normalize(module))
            if name is None:
                problems.append(f"{module}.{suffix}: missing, the student {what}")
            elif not torch.allclose(tensors[name].float().max(), torch.tensor(expected), rtol=1e-6, atol=0.0):
                problems.append(f"{name}: {tensors[name].float().max().item():.6g}, the student's calibrated "
                                f"scale is {expected:.6g}")
    if config is not None and quant_config is not None:
        problems += lint_config(tensors, config, quant_config)
    return {"passed": not problems, "problems": problems[:20], "problem_count": len(problems)}


def lint_config(tensors: dict[str, torch.Tensor], config: dict, quant_config: dict) -> list[str]:
    """The lint's rules between the tensors and the configs, each a failure a server shows silently:
    fused siblings (q/k/v, gate/up, an expert's w1/w3) with different global or input scales, of which
    the server keeps one for the fused GEMM (vLLM #54974); a layer whose algorithm quantizes its input
    without an input scale (vLLM #45102: lm_head; #45212: an expert never routed); a weight-only NVFP4
    MoE (vLLM #54189: the fused MoE folds an uninitialised input scale, every expert zero); a tied
    embedding also stored as lm_head, or an untied model without one (vLLM #48238); a quantized KV
    cache without a scale for every attention layer."""
    problems = []
    modules = {n.removesuffix(".weight") for n in tensors if n.endswith(".weight") and is_weight(n)
               and tensor_format(n, tensors) in ("nvfp4", "fp8")}
    for module in sorted(modules):
        parent, leaf = module.rsplit(".", 1) if "." in module else ("", module)
        for group in FUSED_SIBLINGS:
            if leaf != group[0]:
                continue
            siblings = [f"{parent}.{s}" for s in group if f"{parent}.{s}" in modules]
            for suffix in ("weight_scale_2", "input_scale"):
                values = {s: tensors[f"{s}.{suffix}"].float().max().item() for s in siblings if f"{s}.{suffix}" in tensors}
                if len(set(values.values())) > 1:
                    problems.append(f"{parent}.{'/'.join(group)}: {suffix} " + " vs ".join(f"{v:.6g}" for v in values.values())
                                    + ": a server fuses them into one GEMM with one scale (vLLM #54974, the fused-scale bug)")
        algo = layer_algo(module, quant_config)
        if algo in INPUT_QUANTIZING_ALGOS and f"{module}.input_scale" not in tensors:
            problems.append(f"{module}.input_scale: missing, and hf_quant_config gives the layer {algo}, which "
                            "quantizes its input (vLLM #45102, #45212: loaded as zero)")
    weight_only_moe = sorted({re.sub(r"\.experts\.\d+\..*$", ".experts", m) for m in modules
                              if ".experts." in m and layer_algo(m, quant_config) == "W4A16_NVFP4"})
    problems += [f"{moe}: experts quantized weight-only (W4A16_NVFP4): vLLM's NVFP4 fused MoE folds an uninitialised "
                 "input scale and serves every expert as zero (vLLM #54189)" for moe in weight_only_moe]
    text = config.get("text_config") or config
    tied = text.get("tie_word_embeddings", config.get("tie_word_embeddings"))
    heads = [n for n in tensors if n.endswith("lm_head.weight")]
    if tied and heads:
        problems.append(f"{heads[0]}: stored, and config.json ties it to the input embedding (tie_word_embeddings): "
                        "a server loads one of the two (vLLM #48238)")
    elif tied is False and not heads:
        problems.append("lm_head.weight: missing, and config.json unties it from the input embedding "
                        "(tie_word_embeddings false): a server has no output layer to load (vLLM #48238)")
    if quant_config.get("quantization", {}).get("kv_cache_quant_algo"):
        for k_proj in sorted(n.removesuffix(".weight") for n in tensors if n.endswith(".k_proj.weight")):
            attention = k_proj.removesuffix(".k_proj")
            for scale in (f"{k_proj}.k_scale", f"{attention}.v_proj.v_scale"):
                if scale not in tensors:
                    problems.append(f"{scale}: missing, and hf_quant_config quantizes the KV cache "
                                    f"({quant_config['quantization']['kv_cache_quant_algo']})")
    return problems


def lint_folder(folder: Path, input_scales: dict[str, float] | None = None) -> dict:
    """The lint of an export folder as it is on disk (no student: its static rules)."""
    folder = Path(folder)
    return lint(read_tensors(folder), input_scales or {}, read_json(folder / "config.json"),
                read_json(folder / "hf_quant_config.json"))


def student_input_scales(student) -> dict[str, float]:
    """module name -> the input scale the export must write for it: the calibrated amax of its
    enabled NVFP4 (amax / (6 x 448)) or FP8 (amax / 448) input quantizer."""
    scales = {}
    for name, module in student.named_modules():
        q = getattr(module, "input_quantizer", None)
        if q is None or not getattr(q, "is_enabled", False) or getattr(q, "amax", None) is None or q.amax.numel() != 1:
            continue
        if q.num_bits == (2, 1):
            scales[name] = float(q.amax.float() / (6 * 448))
        elif q.num_bits == (4, 3):
            scales[name] = float(q.amax.float() / 448)
    return scales


def student_weight_scales(student) -> dict[str, float]:
    """module name -> the global scale (weight_scale_2) the export must write for its NVFP4 weight:
    the weight quantizer's calibrated amax / (6 x 448)."""
    from modelopt.torch.quantization.qtensor import NVFP4QTensor

    return {name: float(NVFP4QTensor.get_weights_scaling_factor_2_from_quantizer(module.weight_quantizer))
            for name, module in student.named_modules()
            if getattr(getattr(module, "weight_quantizer", None), "is_enabled", False)
            and module.weight_quantizer.num_bits == (2, 1) and module.weight_quantizer.amax is not None}
