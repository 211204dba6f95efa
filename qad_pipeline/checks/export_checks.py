"""The export's checks of a checkpoint, before it is put in place (`qad-pipeline stage export`).

Reading an exported Model Optimizer checkpoint (`read_tensors`, each weight's stored format, names
comparable with the in-memory model) and four of the export's five checks (the fifth, the lint,
is `qad_pipeline.checks.export_lint`); the stage (`qad_pipeline/tasks/export.py`) runs them, with the
serving check (`qad_pipeline.checks.serving`):

a. formats: every layer is stored in the format its recipe asked for (no silent NVFP4 -> FP8 or
   -> BF16, `lm_head` included), and the quantization config names exactly the quantized layers;
b. size: effective bits per element and bytes, computed from the safetensors themselves, match
   what the recipe implies (within 1 %);
c. lint (`qad_pipeline.checks.export_lint`): scales, packing and the configs, before anything is read back;
d. reload: the exported weights, unpacked and dequantized with Model Optimizer's NVFP4 code and
   loaded into a plain BF16 model by transformers, reproduce the student's next-token
   distribution (weights-only view: activation and KV quantizers off on the student) within a mean
   KL of max(1e-3, 2 x the student's own implementation noise in that view (its sdpa-vs-eager KL),
   3 % of the weight quantization's own KL) (`qad_pipeline.checks.serving_reference.kl_threshold`).
   What remains is Model Optimizer's two NVFP4 code paths breaking exact rounding ties
   differently: its fake-quant kernel takes the global scale as amax x fl(1/2688), its export as
   amax / 2688, which can differ in the last bit, and a block scale or a value exactly on an FP8 or
   FP4 rounding midpoint (frequent in BF16 weights, whose 8-bit mantissas make exact ratios common)
   then lands on either side: 0.2 % of SmolLM2-135M's MLP weights, KL 0.0021, noise 0.0019.
e. weights: no block of 16 exported NVFP4 values is the student's times one ratio: a block or
   global scale that is not the student's, which the reload's KL can miss (docs/export.md: Failure catalog).
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

from qad_pipeline.core.artifacts import read_json, write_json

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


def exported_keys(name: str) -> tuple[str, ...]:
    """The normalized names under which the export holds in-memory layer `name`: fused experts'
    `gate_up_proj` (one 3-D tensor in memory, transformers >= 5) is written per expert as the
    `gate_proj` and `up_proj` the serving engines read."""
    key = normalize(name)
    if key.endswith(".experts.gate_up_proj"):
        stem = key.removesuffix("gate_up_proj")
        return stem + "gate_proj", stem + "up_proj"
    return (key,)


# -- the checks ---------------------------------------------------------------------------------


def check_formats(expected: dict[str, str], tensors: dict[str, torch.Tensor], quant_config: dict) -> dict:
    """(a) Each layer's exported format equals the recipe's, and the config names the quantized ones."""
    exported: dict[str, set[str]] = defaultdict(set)
    for name in tensors:
        if is_weight(name):
            exported[normalize(name)].add(tensor_format(name, tensors))
    problems = []
    for name, fmt in expected.items():
        held = [exported.get(key) for key in exported_keys(name)]
        got = None if None in held else set().union(*held)
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


def dequantize(name: str, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    """Weight `name` of the export unpacked and dequantized to BF16 with Model Optimizer's own NVFP4 code."""
    from modelopt.torch.quantization.qtensor import NVFP4QTensor

    t, base = tensors[name], name.removesuffix(".weight")
    fmt = tensor_format(name, tensors)
    if fmt == "nvfp4":
        q = NVFP4QTensor(torch.Size([*t.shape[:-1], t.shape[-1] * 2]), torch.bfloat16, t)
        return q.dequantize(dtype=torch.bfloat16, scale=tensors[f"{base}.weight_scale"],
                            double_scale=tensors[f"{base}.weight_scale_2"], block_sizes={-1: 16})
    if fmt == "fp8":
        return (t.float() * tensors[f"{base}.weight_scale"].float()).to(torch.bfloat16)
    return t


def dequantized_state_dict(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Exported weights unpacked and dequantized to BF16 (`dequantize`)."""
    return {name: dequantize(name, tensors) for name in tensors if is_weight(name)}


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


def reload_reference(student, batch: torch.Tensor, unquantized: torch.Tensor | None = None
                     ) -> tuple[torch.Tensor, float, float]:
    """What the reload check compares with: the student's weight-only logits on `batch`, and, on the
    first PROMPT_LEN tokens (eager attention holds the whole [length, length] score matrix; both are
    per-token figures), its implementation noise and the weight quantization's own KL (against
    `unquantized`, the logits on those tokens of the model before quantization where given, else of
    the student with its quantizers off)."""
    from qad_pipeline.checks.serving_reference import PROMPT_LEN, implementation_noise, kl_per_token, view_logits

    short = batch[:, :PROMPT_LEN]
    weights = view_logits(student, short, "weights")
    if unquantized is None:
        unquantized = view_logits(student, short, "unquantized")
    return (view_logits(student, batch, "weights"), implementation_noise(student, short, "weights", weights),
            kl_per_token(weights, unquantized))


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
    from qad_pipeline.checks.serving_reference import kl_threshold

    reloaded = reload_dequantized(folder, tensors, trust_remote_code)(input_ids=batch).logits.float()
    ref_lp, got_lp = torch.log_softmax(reference, -1), torch.log_softmax(reloaded, -1)
    kl = (ref_lp.exp() * (ref_lp - got_lp)).sum(-1).mean().item()
    tolerance = kl_threshold(noise, quantization_kl)
    return {"passed": kl <= tolerance, "kl_divergence": kl, "tolerance": tolerance, "student_noise": noise,
            "quantization_kl": quantization_kl,
            "top1_agreement": (reference.argmax(-1) == reloaded.argmax(-1)).float().mean().item(),
            "max_abs_logit_diff": (reloaded - reference).abs().max().item(),
            "compared": "student with weight quantizers only vs dequantized export, bf16, mean KL per token"}


SCALED_BLOCK_MIN = 0.03  # one FP8 step of a block scale is 6-12 %
UNIFORM_RATIO = 0.01  # the spread of one ratio over a block: BF16 rounding of each value, <= 2 x 2^-8


@torch.no_grad()
def student_weights(student) -> dict[str, torch.Tensor]:
    """module name -> its NVFP4 weight as the student computes with it (the weight quantizer's
    fake-quantized BF16 output, on the CPU): what `check_weights` compares the export with. Taken
    before the export, which packs the weights in place; one BF16 copy of the NVFP4 layers."""
    return {name: module.weight_quantizer(module.weight).to("cpu", torch.bfloat16)
            for name, module in student.named_modules()
            if getattr(getattr(module, "weight_quantizer", None), "is_enabled", False)
            and module.weight_quantizer.num_bits == (2, 1)}


@torch.no_grad()
def student_block_amax(student) -> dict[str, torch.Tensor]:
    """module name -> the per-block amax (one per 16 values, flat, float32, on the CPU) of each NVFP4
    weight quantizer with static block scales: what Model Optimizer's export takes each block scale
    from (`NVFP4QTensor.get_weights_scaling_factor_from_quantizer`), whatever the weight is now. A
    recipe that rewrites the weights after calibrating them (GPTQ) keeps the base weights' amax here."""
    out = {}
    for name, module in student.named_modules():
        quantizer = getattr(module, "weight_quantizer", None)
        amax = getattr(quantizer, "_amax", None)
        if (getattr(quantizer, "is_enabled", False) and quantizer.num_bits == (2, 1) and amax is not None
                and amax.numel() * 16 == module.weight.numel()):
            out[name] = amax.detach().float().reshape(-1).cpu().clone()  # the export may rewrite it
    return out


def block_amax(folder: Path, static: dict[str, torch.Tensor]):
    """module name -> the per-block amax its export's block scales came from: the student's static
    one (`student_block_amax`), else the block's largest magnitude in the weight as the checkpoint
    folder's safetensors hold it (read one at a time; names compared with `normalize`)."""
    shards = {normalize(key): (shard, key) for shard in sorted(Path(folder).glob("*.safetensors"))
              for key in safe_open(str(shard), "pt").keys() if key.endswith(".weight")}

    def amax(module: str) -> torch.Tensor:
        if module in static:
            return static[module]
        shard, key = shards[normalize(module)]
        with safe_open(str(shard), "pt") as f:
            return f.get_tensor(key).to(torch.bfloat16).float().reshape(-1, 16).abs().amax(1)
    return amax


MIDPOINT_ULPS = 4  # how far (float32 ulps) a computed block scale may sit from the FP8 midpoint it stands for


def fp8_roundings(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The FP8 (E4M3) value(s) a positive float32 rounds to: nearest, and at a midpoint either.

    `x` is a block scale recomputed here, amax / (top x the stored global scale); Model Optimizer's
    export and its fake-quant kernel compute it in other orders (amax / 6 / (global amax / 6) x 448),
    so an exact midpoint of theirs can come out a float32 ulp or two beside it here (SmolLM2-135M's
    GPTQ export: 42.0000038 for their 42, between 40 and 44, in 361 blocks of one layer). Within
    MIDPOINT_ULPS of a midpoint counts as one; a scale one FP8 step off is half a step (>= 3 %) away."""
    nearest = x.to(torch.float8_e4m3fn)
    raw = nearest.view(torch.uint8).to(torch.int16)
    rf = nearest.float()
    other = torch.where(rf > x, (raw - 1).clamp_min(0), raw + 1).to(torch.uint8).view(torch.float8_e4m3fn).float()
    at_midpoint = ((rf + other) / 2 - x).abs() <= MIDPOINT_ULPS * torch.finfo(torch.float32).eps * x
    return rf, torch.where(at_midpoint, other, rf)


def is_candidate_scale(amax: torch.Tensor, name: str, tensors: dict[str, torch.Tensor],
                       blocks: torch.Tensor) -> torch.Tensor:
    """Per block of `blocks`: is the export's FP8 scale a rounding of the block's amax (`amax`, one
    per block of the tensor: `block_amax`) / (6 x global scale) or amax / (4 x global scale), the
    candidates of Model Optimizer's NVFP4 recipes (the 4/6 recipe picks one of the two per block),
    either way at an FP8 midpoint (`fp8_roundings`)."""
    base = name.removesuffix(".weight")
    scale = tensors[f"{base}.weight_scale"].float().reshape(-1)[blocks]
    amax = amax[blocks]
    ok = torch.zeros_like(scale, dtype=torch.bool)
    for top in (6.0, 4.0):
        nearest, either = fp8_roundings(amax / (top * tensors[f"{base}.weight_scale_2"].float()))
        ok |= (scale == nearest) | (scale == either)
    return ok


def check_weights(tensors: dict[str, torch.Tensor], reference: dict[str, torch.Tensor], amax=None) -> dict:
    """(e) No block of 16 exported values off from the student's by one common ratio.

    The export's dequantized NVFP4 weights against the student's (`student_weights`), block by block.
    The legitimate differences are single values re-rounded at a tie (module docstring: a few % of
    the elements with the 4/6 recipe), and BF16 rounding of the fake-quantized values (a common
    ratio within 0.8 %); a block whose every non-zero value is off by the same ratio of at least
    SCALED_BLOCK_MIN is a block scale, or with every block of a tensor its global scale, that is not
    what the student computed with (a hand edit, a wrong FP8 step), which the reload's KL can miss.
    Model Optimizer's export and its fake-quant kernel round a block scale that falls exactly on an
    FP8 midpoint differently (1,157 of SmolLM2-135M's 4,976,640 blocks with the 4/6 recipe): `amax`
    (module -> the per-block amax its scales came from, `block_amax`) clears a block whose scale is
    one of its candidates (`is_candidate_scale`); a scale one FP8 step off is not (it is at least half
    a step from the block's amax / 6 and amax / 4)."""
    stored = {normalize(n): n for n in tensors if n.endswith(".weight") and tensor_format(n, tensors) == "nvfp4"}
    problems, scaled_blocks, compared = [], 0, 0
    for module, want in reference.items():
        name = stored.get(normalize(module))
        if name is None:
            continue  # the formats check reports a layer not stored as NVFP4
        got = dequantize(name, tensors).float().reshape(-1, 16)
        want = want.float().reshape(-1, 16)
        nonzero = want != 0
        ratio = torch.where(nonzero, got / torch.where(nonzero, want, 1.0), float("nan"))
        high, low = ratio.nan_to_num(-torch.inf).amax(1), ratio.nan_to_num(torch.inf).amin(1)
        uniform = (high - low).abs() <= UNIFORM_RATIO * high.abs()
        scaled = nonzero.any(1) & uniform & ((high - 1).abs() >= SCALED_BLOCK_MIN)
        if amax is not None and bool(scaled.any()):
            blocks = scaled.nonzero()[:, 0]
            scaled[blocks[is_candidate_scale(amax(module), name, tensors, blocks)]] = False
        compared += want.shape[0]
        if bool(scaled.any()):
            n, first = int(scaled.sum()), int(scaled.nonzero()[0])
            scaled_blocks += n
            problems.append(f"{name}: {n} of {want.shape[0]} blocks of 16 values are the student's times one ratio "
                            f"(block {first}: x{high[first].item():.4f}): a scale that is not the student's")
    return {"passed": not problems, "problems": problems[:20], "scaled_blocks": scaled_blocks,
            "blocks_compared": compared, "ratio_min": SCALED_BLOCK_MIN,
            "compared": "export's dequantized NVFP4 weights vs the student's fake-quantized ones, per block of 16"}
