"""The student's side of the serving check: what the served checkpoint must reproduce.

The export stage, before it packs the student's weights, runs the student over held-out prompts in
each view a server runs the checkpoint in (`VIEWS`) and writes `serving_reference.npz` beside the
weights: per view the student's top-K next-token log-probs, its implementation noise (the KL
between transformers' sdpa and eager attention on the same quantized model: what two faithful
implementations differ by) and the quantization's own KL in that view; and the top-K log-probs of
the student with every quantizer off (`UNQUANTIZED`), from which a served model must be further than
from the student. `qad_pipeline.checks.serving` compares vLLM with it. Views:

    w4a16   NVFP4 activations in BF16 (a GPU without FP4 tensor cores: Hopper); KV cache in BF16
    w4a4    every quantizer but the KV cache's (Blackwell); only where NVFP4 activations are quantized
    weights every quantizer but the weights' (the export's reload check)

The KV cache is BF16 in every view: vLLM's CPU build has no NVFP4 KV cache; on a GPU its FP8/NVFP4
KV cache adds its own small difference.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from qad_pipeline.core.config import ConfigError

VIEWS = ("w4a16", "w4a4")
PROMPTS, PROMPT_LEN = 4, 64  # held-out windows for the full check
FULL_VOCAB_MAX = 8192  # vocabularies up to this size are compared whole
TOP_K = 1024  # otherwise the top K log-probs per position
REFERENCE_FILE = "serving_reference.npz"
UNQUANTIZED = "unquantized"  # the reference's entry for the student with every quantizer off

# The threshold of every comparison with the student (the export's reload check, each serving view):
# its mean KL per token may be the largest of an absolute floor, NOISE_FACTOR x the student's own
# implementation noise in that view, and QUANTIZATION_SHARE of the quantization's own KL in that
# view (vs the student with every quantizer off), but never more than CLOSER_SHARE of what the
# unquantized model scores in the same comparison: however noisy the view, the served model must be
# measurably closer to the student than the unquantized model is. Measured on SmolLM2-135M (docs/export.md:
# Serving check): a faithful export comes within 1.3-1.7 % of the quantization's KL in the
# reload and w4a16 views (at 0.7-1.4 x the noise); in the w4a4 view at the noise itself, 0.76 of what
# the unquantized model scores (0.197 and 0.258, top-1024 comparison; vLLM serving the BF16 model
# in its place: 0.258).
KL_FLOOR = 1e-3
NOISE_FACTOR = 2.0
QUANTIZATION_SHARE = 0.03
CLOSER_SHARE = 0.9
# A view is noise-limited where the cap lies below the noise line: two faithful implementations of the
# student differ by about as much as the unquantized model does, so no faithful server can be measurably
# closer to the student than the unquantized model is. There the served model is held to the noise line
# and judged as a quantization of the model instead: its distance from the unquantized model must be
# QUANTIZED_BAND x the student's own, in the same comparison. Measured on SmolLM2-135M's W4A4 view
# (local-Hessian student, 4 x 64 held-out tokens, 2026-12-06): the student's noise 0.254 against the
# unquantized model's 0.263. In this comparison (top 1,024 + the rest), vLLM's CPU build serving the
# export is 1.01 x the student's distance (0.2705 / 0.2670), the student's W4A16 log-probs in its
# place 0.37, the unquantized model 0; with the exact KL over the vocabulary, the student itself with
# eager attention is 0.97 x (0.2806 / 0.2893), in float32 1.03 x, the W4A16 student 0.36 x. The QAD
# student's export (from GPTQ, 40 steps): noise 0.197 against 0.179, vLLM 1.16 x (0.2502 / 0.2151).
QUANTIZED_BAND = (0.75, 1.33)


def threshold_terms(noise: float, quantization_kl: float, unquantized_kl: float | None = None) -> tuple[float, float]:
    """(the line before its cap, the cap); `unquantized_kl`: what the unquantized model scores in this
    comparison (the quantization's own KL where the comparison is the exact KL over the whole
    vocabulary, as the reload check's)."""
    return (max(KL_FLOOR, NOISE_FACTOR * noise, QUANTIZATION_SHARE * quantization_kl),
            CLOSER_SHARE * (quantization_kl if unquantized_kl is None else unquantized_kl))


def noise_limited(noise: float, quantization_kl: float, unquantized_kl: float | None = None) -> bool:
    """Whether the student's own implementation noise reaches what the unquantized model scores
    (`threshold_terms`' cap below its line): see QUANTIZED_BAND."""
    line, cap = threshold_terms(noise, quantization_kl, unquantized_kl)
    return cap < line


def kl_threshold(noise: float, quantization_kl: float, unquantized_kl: float | None = None) -> float:
    """A comparison's threshold in nats per token (the constants above; `threshold_terms`)."""
    return min(threshold_terms(noise, quantization_kl, unquantized_kl))


def threshold_reason(kl: float, noise: float, quantization_kl: float, unquantized_kl: float | None = None) -> str:
    """Why a comparison at `kl` failed its `kl_threshold`, in one phrase: which term set the line."""
    line, cap = threshold_terms(noise, quantization_kl, unquantized_kl)
    if cap < line:
        return (f"KL {kl:.4g} nats/token is not measurably closer to the student than the unquantized model "
                f"({cap / CLOSER_SHARE:.4g}): the threshold is capped at {CLOSER_SHARE} x that ({cap:.4g}), "
                f"below {NOISE_FACTOR} x the student's noise ({noise:.4g})")
    return f"KL {kl:.4g} nats/token is over its threshold {line:.4g}"


def held_out_prompts(windows: np.ndarray, count: int = PROMPTS, length: int = PROMPT_LEN) -> list[list[int]]:
    """Prompts for the full check: the first `count` held-out windows, `length` tokens each."""
    if len(windows) == 0:
        raise ConfigError("no held-out windows for the serving check (the calibration stage writes them)")
    return [[int(t) for t in w[:length]] for w in windows[:count]]


def _is_nvfp4_activation(name: str, quantizer) -> bool:
    block = getattr(quantizer, "block_sizes", None) or {}
    return name.endswith("input_quantizer") and quantizer.num_bits == (2, 1) and block.get("type") == "dynamic"


def view_switches(student, view: str) -> list:
    """The enabled quantizers a view (module docstring; `unquantized`: all) turns off."""
    from modelopt.torch.quantization.nn import TensorQuantizer

    def off(name: str, q) -> bool:
        if name.endswith(("k_bmm_quantizer", "v_bmm_quantizer")):
            return True
        if view == "w4a16":
            return _is_nvfp4_activation(name, q)
        if view == "weights":
            return not (name.endswith("weight_quantizer") or "weight_quantizers." in name)
        return view == "unquantized"

    return [m for n, m in student.named_modules() if isinstance(m, TensorQuantizer) and m.is_enabled and off(n, m)]


@torch.no_grad()
def view_logits(student, batch: torch.Tensor, view: str, attention: str | None = None) -> torch.Tensor:
    """The student's logits in a view (`view_switches`), its quantizers switched back on afterwards;
    `attention` runs it with another of transformers' attention implementations for this forward."""
    from qad_pipeline.core.modeling import input_device

    switched = view_switches(student, view)
    held = student.config._attn_implementation
    for q in switched:
        q.disable()
    try:
        if attention:
            student.set_attn_implementation(attention)
        return student(input_ids=batch.to(input_device(student))).logits.float().cpu()
    finally:
        if attention:
            student.set_attn_implementation(held)
        for q in switched:
            q.enable()


def kl_per_token(p_logits: torch.Tensor, q_logits: torch.Tensor) -> float:
    """Mean KL(p || q) in nats per position, every position but the last (which predicts nothing checked)."""
    p, q = torch.log_softmax(p_logits[:, :-1].float(), -1), torch.log_softmax(q_logits[:, :-1].float(), -1)
    return float((p.exp() * (p - q)).sum(-1).mean())


def implementation_noise(student, batch: torch.Tensor, view: str, logits: torch.Tensor | None = None) -> float:
    """KL between the student's log-probs (`logits`, computed when not given) and the same view with
    another of transformers' attention implementations (eager; sdpa where the student runs eager),
    equal up to BF16 rounding: what two faithful implementations of this quantized model differ by on
    these prompts. Eager attention holds [batch, heads, length, length] scores: keep `batch` short."""
    other = "sdpa" if student.config._attn_implementation == "eager" else "eager"
    if logits is None:
        logits = view_logits(student, batch, view)
    return kl_per_token(view_logits(student, batch, view, attention=other), logits)


def student_reference(student, prompts: list[list[int]], unquantized: torch.Tensor | None = None) -> dict:
    """What the served checkpoint must reproduce, per view (`VIEWS`; w4a4 only where NVFP4
    activations are quantized): the student's logits, its implementation noise, and the
    quantization's own KL in that view (vs the student with every quantizer off); and, as
    `UNQUANTIZED`, the logits of the student with every quantizer off, which the served model must be
    further from than from the student. `unquantized`: those logits from elsewhere (the base model,
    where the recipe rewrote the weights: `export_verify.unquantized_logits`)."""
    from modelopt.torch.quantization.nn import TensorQuantizer

    batch = torch.tensor(prompts)
    nvfp4_activations = any(isinstance(q, TensorQuantizer) and q.is_enabled and _is_nvfp4_activation(n, q)
                            for n, q in student.named_modules())
    views = ["w4a16", "w4a4"] if nvfp4_activations else ["w4a16"]
    if unquantized is None:
        unquantized = view_logits(student, batch, "unquantized")
    out = {}
    for view in views:
        logits = view_logits(student, batch, view)
        out[view] = {"logits": logits, "noise": implementation_noise(student, batch, view, logits),
                     "own_kl": kl_per_token(logits, unquantized)}
    out[UNQUANTIZED] = {"logits": unquantized}
    return out


def write_reference(folder: Path, prompts: list[list[int]], views: dict) -> Path:
    """`serving_reference.npz` in the export: the prompts and, per view (and for the unquantized
    student), the student's top-K next-token log-probs at each position but the last (K: the whole
    vocabulary up to FULL_VOCAB_MAX), its implementation noise and the quantization's own KL."""
    arrays = {"prompts": np.asarray(prompts, dtype=np.int64)}
    for view, ref in views.items():
        logprobs = torch.log_softmax(ref["logits"][:, :-1].float(), -1)
        k = logprobs.shape[-1] if logprobs.shape[-1] <= FULL_VOCAB_MAX else TOP_K
        top = logprobs.topk(k, -1)
        arrays.update({f"{view}_ids": top.indices.numpy().astype(np.int32),
                       f"{view}_logprobs": top.values.numpy().astype(np.float32)})
        arrays.update({f"{view}_{key}": np.float64(ref[key]) for key in ("noise", "own_kl") if key in ref})
    path = Path(folder) / REFERENCE_FILE
    np.savez_compressed(path, **arrays)
    return path


def reference_bytes(prompts: int, positions: int, vocab: int) -> int:
    """At most how many bytes `write_reference` writes (both views and the unquantized student,
    before compression)."""
    k = vocab if vocab <= FULL_VOCAB_MAX else TOP_K
    return (len(VIEWS) + 1) * prompts * (positions - 1) * k * 8 + prompts * positions * 8


def read_reference(folder: Path) -> dict[str, dict]:
    """{"prompts": array, UNQUANTIZED: {"ids", "logprobs"}, view: {"ids", "logprobs", "noise", "own_kl"}}
    for each view written."""
    path = Path(folder) / REFERENCE_FILE
    if not path.is_file():
        raise ConfigError(f"{folder} has no {REFERENCE_FILE}: the export stage writes it beside the weights "
                          "(the student's log-probs the served checkpoint must reproduce); re-run the export")
    with np.load(path) as data:
        if f"{UNQUANTIZED}_ids" not in data.files:
            raise ConfigError(f"{path} was written by an older export (no unquantized reference); re-run the export")
        out: dict = {"prompts": data["prompts"],
                     UNQUANTIZED: {"ids": data[f"{UNQUANTIZED}_ids"], "logprobs": data[f"{UNQUANTIZED}_logprobs"]}}
        for view in VIEWS:
            if f"{view}_ids" in data.files:
                out[view] = {"ids": data[f"{view}_ids"], "logprobs": data[f"{view}_logprobs"],
                             "noise": float(data[f"{view}_noise"]), "own_kl": float(data[f"{view}_own_kl"])}
        return out
