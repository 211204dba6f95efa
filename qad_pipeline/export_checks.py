"""The export's checks of a checkpoint, before it is put in place (`qad-pipeline stage export`).

Reading an exported Model Optimizer checkpoint (`read_tensors`, each weight's stored format, names
comparable with the in-memory model) and four of the export's checks; the stage
(`qad_pipeline/tasks/export.py`) runs them, with the serving check (`qad_pipeline.serving`):

a. formats: every layer is stored in the format its recipe asked for (no silent NVFP4 -> FP8 or
   -> BF16, `lm_head` included), and the quantization config names exactly the quantized layers;
b. size: effective bits per element and bytes, computed from the safetensors themselves, match
   what the recipe implies (within 1 %);
c. lint, before anything is read back: every scale tensor finite and > 0 (weight block scales,
   global scales, input scales, KV scales), every NVFP4 weight packed as uint8 with its FP8 block
   scales and FP32 global scale, each input scale the student's calibrated one;
d. reload: the exported weights, unpacked and dequantized with Model Optimizer's NVFP4 code and
   loaded into a plain BF16 model by transformers, reproduce the student's next-token
   distribution (weights-only view: activation and KV quantizers off on the student) within a mean
   KL of max(1e-3, 2 x the student's own implementation noise in that view (its sdpa-vs-eager KL),
   3 % of the weight quantization's own KL) (`qad_pipeline.serving_reference.kl_threshold`).
   What remains is Model Optimizer's two NVFP4 code paths breaking exact rounding ties
   differently: its fake-quant kernel takes the global scale as amax x fl(1/2688), its export as
   amax / 2688, which can differ in the last bit, and a block scale or a value exactly on an FP8 or
   FP4 rounding midpoint (frequent in BF16 weights, whose 8-bit mantissas make exact ratios common)
   then lands on either side: 0.2 % of SmolLM2-135M's MLP weights, KL 0.0021, noise 0.0019.
"""

from __future__ import annotations

import re
import shutil
import tempfile
from collections import Counter, defaultdict
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from qad_pipeline.artifacts import read_json, write_json

BPE_TOLERANCE = 0.01  # relative
FORMAT_OF_ALGO = {"NVFP4": "nvfp4", "W4A16_NVFP4": "nvfp4", "FP8": "fp8", "W4A8_NVFP4_FP8": "nvfp4"}


# -- reading an exported checkpoint ---------------------------------------------------------------


def read_tensors(folder: Path) -> dict[str, torch.Tensor]:
    tensors = {}
    for shard in sorted(Path(folder).glob("*.safetensors")):
        with safe_open(str(shard), "pt") as f:
            for key in f.keys():
                tensors[key] = f.get_tensor(key)
    return tensors


def tensor_format(name: str, tensors: dict[str, torch.Tensor]) -> str:
    """The storage format of weight `name` as the safetensors hold it."""
    t = tensors[name]
    base = name.removesuffix(".weight")
    if t.dtype == torch.uint8 and f"{base}.weight_scale" in tensors:
        return "nvfp4"
    if t.dtype == torch.float8_e4m3fn:
        return "fp8"
    return {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}.get(t.dtype, str(t.dtype))


def is_weight(name: str) -> bool:
    """A model weight, as opposed to a scale that belongs to one."""
    return not re.search(r"\.(weight_scale(_2)?|input_scale|[kv]_scale|pre_quant_scale)$", name)


def normalize(name: str) -> str:
    """A layer name comparable between the in-memory model and the export.

    The export may rename the prefix (`model.` -> `backbone.`), unfuse experts
    (`experts.up_proj` -> `experts.<i>.up_proj.weight`) and drop `.weight`.
    """
    name = name.removesuffix(".weight")
    name = re.sub(r"\.experts\.\d+\.", ".experts.", name)
    match = re.search(r"(layers\.\d+\..*)$", name)
    return match.group(1) if match else name.split(".")[-1] if "." in name else name


# -- the checks ---------------------------------------------------------------------------------


def check_formats(expected: dict[str, str], tensors: dict[str, torch.Tensor], quant_config: dict) -> dict:
    """(a) Each layer's exported format equals the recipe's, and the config names the quantized ones."""
    exported: dict[str, set[str]] = defaultdict(set)
    for name in tensors:
        if is_weight(name):
            exported[normalize(name)].add(tensor_format(name, tensors))
    problems = []
    for name, fmt in expected.items():
        key = normalize(name)
        got = exported.get(key)
        if got is None:
            problems.append(f"{name}: expected {fmt}, missing from the export")
        elif got != {fmt} and not (fmt in ("bf16", "fp32", "fp16") and got <= {"bf16", "fp32", "fp16"}):
            problems.append(f"{name}: expected {fmt}, exported as {'+'.join(sorted(got))}")

    layers = quant_config.get("quantization", {}).get("quantized_layers") or {}
    module_names = {n.removesuffix(".weight") for n in tensors if n.endswith(".weight")}
    module_names |= {re.sub(r"\.experts\.\d+\..*$", ".experts", n) for n in module_names}
    for layer, spec in layers.items():
        if layer not in module_names:
            problems.append(f"hf_quant_config names layer {layer!r}, which the checkpoint does not hold")
            continue
        want = FORMAT_OF_ALGO.get(spec.get("quant_algo"))
        held = {tensor_format(n, tensors) for n in tensors if n.startswith(layer + ".") and n.endswith(".weight")}
        if want and held != {want}:
            problems.append(f"hf_quant_config says {layer} is {spec.get('quant_algo')}, tensors are {sorted(held)}")
    formats = {name: "+".join(sorted(fmts)) for name, fmts in sorted(exported.items())}
    return {"passed": not problems, "problems": problems[:20], "layer_formats": formats,
            "layers_by_format": dict(Counter(formats.values()))}


def export_size(tensors: dict[str, torch.Tensor]) -> dict:
    """Bits per element and bytes of the exported weights, scales included."""
    bits = elements = 0
    for name, t in tensors.items():
        bits += t.numel() * t.element_size() * 8
        if is_weight(name):
            elements += t.numel() * (2 if tensor_format(name, tensors) == "nvfp4" else 1)
    return {"effective_bpe": bits / elements, "tensor_bytes": bits // 8, "elements": elements,
            "bf16_size_bytes": elements * 2}


def check_size(expected_bpe: float, tensors: dict[str, torch.Tensor]) -> dict:
    """(b) Effective bits per element from the safetensors match the recipe's accounting."""
    size = export_size(tensors)
    rel = abs(size["effective_bpe"] - expected_bpe) / expected_bpe
    return {"passed": rel <= BPE_TOLERANCE, "expected_bpe": expected_bpe, "relative_difference": rel,
            "tolerance": BPE_TOLERANCE, **size}


def dequantized_state_dict(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Exported weights unpacked and dequantized to BF16 with Model Optimizer's own NVFP4 code."""
    from modelopt.torch.quantization.qtensor import NVFP4QTensor

    out = {}
    for name, t in tensors.items():
        if not is_weight(name):
            continue
        base = name.removesuffix(".weight")
        fmt = tensor_format(name, tensors)
        if fmt == "nvfp4":
            shape = torch.Size([*t.shape[:-1], t.shape[-1] * 2])
            q = NVFP4QTensor(shape, torch.bfloat16, t)
            out[name] = q.dequantize(
                dtype=torch.bfloat16, scale=tensors[f"{base}.weight_scale"],
                double_scale=tensors[f"{base}.weight_scale_2"], block_sizes={-1: 16},
            )
        elif fmt == "fp8":
            out[name] = (t.float() * tensors[f"{base}.weight_scale"].float()).to(torch.bfloat16)
        else:
            out[name] = t
    return out


def reload_dequantized(folder: Path, tensors: dict[str, torch.Tensor], trust_remote_code: bool = False):
    """Load the export back as a plain BF16 model: dequantized weights, quantization config dropped.

    With `trust_remote_code` (base_model.trust_remote_code) the model's own code files that the
    export carries go along, and transformers may run them.
    """
    from transformers import AutoModelForCausalLM

    with tempfile.TemporaryDirectory() as tmp:
        config = read_json(folder / "config.json")
        config.pop("quantization_config", None)
        write_json(Path(tmp) / "config.json", config)
        if trust_remote_code:
            for code in folder.glob("*.py"):
                shutil.copy2(code, tmp)
        save_file(dequantized_state_dict(tensors), str(Path(tmp) / "model.safetensors"))
        model = AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.bfloat16, trust_remote_code=trust_remote_code)
    model.config.use_cache = False
    return model.eval()


def reload_reference(student, batch: torch.Tensor) -> tuple[torch.Tensor, float, float]:
    """What the reload check compares with: the student's weight-only logits on `batch`, and, on the
    first PROMPT_LEN tokens (eager attention holds the whole [length, length] score matrix; both are
    per-token figures), its implementation noise and the weight quantization's own KL."""
    from qad_pipeline.serving_reference import PROMPT_LEN, implementation_noise, kl_per_token, view_logits

    short = batch[:, :PROMPT_LEN]
    weights = view_logits(student, short, "weights")
    return (view_logits(student, batch, "weights"), implementation_noise(student, short, "weights", weights),
            kl_per_token(weights, view_logits(student, short, "unquantized")))


@torch.no_grad()
def check_reload(folder: Path, tensors: dict[str, torch.Tensor], reference: torch.Tensor, batch: torch.Tensor,
                 noise: float, quantization_kl: float, trust_remote_code: bool = False) -> dict:
    """(d) The reloaded export reproduces the student's weight-only next-token distribution.

    Judged by the mean KL divergence per token (and reported with top-1 agreement and the largest
    logit difference) against `serving_reference.kl_threshold` of the student's own sdpa-vs-eager KL
    (`noise`) and the weight quantization's KL in this view: exact FP4/FP8 rounding ties fall
    differently in Model Optimizer's fake-quant kernel and its export (module docstring), so it is
    close to, not bit-equal with, the student.
    """
    from qad_pipeline.serving_reference import kl_threshold

    reloaded = reload_dequantized(folder, tensors, trust_remote_code)(input_ids=batch).logits.float()
    ref_lp, got_lp = torch.log_softmax(reference, -1), torch.log_softmax(reloaded, -1)
    kl = (ref_lp.exp() * (ref_lp - got_lp)).sum(-1).mean().item()
    tolerance = kl_threshold(noise, quantization_kl)
    return {"passed": kl <= tolerance, "kl_divergence": kl, "tolerance": tolerance, "student_noise": noise,
            "quantization_kl": quantization_kl,
            "top1_agreement": (reference.argmax(-1) == reloaded.argmax(-1)).float().mean().item(),
            "max_abs_logit_diff": (reloaded - reference).abs().max().item(),
            "compared": "student with weight quantizers only vs dequantized export, bf16, mean KL per token"}


SCALE_SUFFIXES = ("weight_scale", "weight_scale_2", "input_scale", "k_scale", "v_scale")


def lint(tensors: dict[str, torch.Tensor], input_scales: dict[str, float]) -> dict:
    """(c) The failures users report of NVFP4 checkpoints that load but serve wrongly, one line per
    tensor: a scale that is zero, negative, NaN or infinite (an MoE expert calibration never routed
    to, exported with a zero input scale, gives NaN in vLLM); an NVFP4 weight without its FP8 block
    scales or FP32 global scale, or block scales that do not cover it; an input scale that is not
    the student's calibrated one (`input_scales`: module -> amax / (6 x 448), or amax / 448 for FP8)."""
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
    stored_inputs = {normalize(n.removesuffix(".input_scale")): n for n in tensors if n.endswith(".input_scale")}
    for module, expected in input_scales.items():  # in-memory names; the export may rename (`normalize`)
        name = stored_inputs.get(normalize(module))
        if name is None:
            problems.append(f"{module}.input_scale: missing, the student quantizes this layer's input")
        elif not torch.allclose(tensors[name].float().max(), torch.tensor(expected), rtol=1e-6, atol=0.0):
            problems.append(f"{name}: {tensors[name].float().max().item():.6g}, the student's calibrated "
                            f"scale is {expected:.6g}")
    return {"passed": not problems, "problems": problems[:20], "problem_count": len(problems)}


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
