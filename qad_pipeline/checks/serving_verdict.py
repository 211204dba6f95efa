"""The serving check's verdict: what vLLM served, against the student the export was made from.

`compare` measures, per position, KL(vLLM || student) over the tokens in both top-K lists plus one
bucket for the rest of the vocabulary, and top-1 agreement where the student's top token leads by
`DECIDED_MARGIN`; `judge_view` holds one view's figures against its conditions (the KL line of
`serving_reference.kl_threshold`, closer to the student than to the unquantized student, top-1
agreement for w4a16; in a noise-limited view the noise line and the quantization band instead of
the cap and the closer condition) and names every condition missed; `summary_line` is the check's
one line.
"""

from __future__ import annotations

import numpy as np

from qad_pipeline.checks.serving_reference import (CLOSER_SHARE, QUANTIZED_BAND, kl_threshold, noise_limited,
                                                   threshold_reason, threshold_terms)

TOP1_MIN = 0.95  # top-1 agreement of the w4a16 view (W4A4 rounding alone swaps top tokens)
DECIDED_MARGIN = 0.05  # nats: top-1 agreement counts the positions where the top token leads by this


def compare(vllm_positions: list, reference: dict[str, np.ndarray]) -> dict:
    """vLLM's prompt log-probs against the student's, per position.

    KL(vLLM || student) over the tokens in both top-K lists, each on its own, plus one bucket for the
    rest of the vocabulary (a coarser partition: exact when K is the vocabulary, a lower bound
    otherwise). Top-1 agreement is counted where the student's top token leads its runner-up by at
    least `DECIDED_MARGIN` nats (elsewhere BF16 rounding alone can swap them). vLLM's entry t is the
    student's position t - 1."""
    kls, agree, decided = [], 0, 0
    for p, positions in enumerate(vllm_positions):
        for t, (ids, lps) in enumerate(positions):
            ref_ids, ref_lps = reference["ids"][p, t], reference["logprobs"][p, t].astype(np.float64)
            ref = dict(zip(ref_ids.tolist(), ref_lps.tolist()))
            shared = [(lp, ref[i]) for i, lp in zip(ids, lps) if i in ref]
            p_in = np.exp([a for a, _ in shared])
            q_in = np.exp([b for _, b in shared])
            kl = float(np.sum(p_in * (np.log(np.maximum(p_in, 1e-300)) - np.log(np.maximum(q_in, 1e-300)))))
            p_rest, q_rest = max(0.0, 1 - p_in.sum()), max(1e-12, 1 - q_in.sum())
            if p_rest > 1e-9:
                kl += p_rest * (np.log(p_rest) - np.log(q_rest))
            kls.append(max(kl, 0.0))
            if ref_lps[0] - ref_lps[1] >= DECIDED_MARGIN:
                decided += 1
                agree += int(ids[int(np.argmax(lps))] == int(ref_ids[0]))
    return {"kl_divergence": float(np.mean(kls)), "kl_max_position": float(np.max(kls)),
            "top1_agreement": agree / decided if decided else None, "decided_positions": decided,
            "positions": len(kls)}


def judge_view(view: str, served: dict, reference: dict, unquantized: dict) -> dict:
    """One view's figures (`compare`) against its conditions, each failure with its reason: the KL to
    the student within `kl_threshold` (of the student's own implementation noise and quantization KL
    in that view); the served model closer to the student than to the unquantized student
    (`unquantized`), by CLOSER_SHARE, position by position on the same prompts: an engine that
    serves the unquantized model is ~0 from it, a faithful one as far as the quantization goes; and,
    for w4a16, a top-1 agreement of at least TOP1_MIN. In a noise-limited view (`noise_limited`: no
    faithful server can be closer to the student than the unquantized model is) the KL to the student
    is held to the noise line alone, and the served model's distance from the unquantized model must
    be QUANTIZED_BAND x the student's own instead of the closer condition."""
    figures = compare(served["prompt_logprobs"], reference)
    unquantized_kl = compare(as_served(unquantized), reference)["kl_divergence"]  # an engine serving it: this
    noise, own_kl, kl = reference["noise"], reference["own_kl"], figures["kl_divergence"]
    limited = noise_limited(noise, own_kl, unquantized_kl)
    kl_max = threshold_terms(noise, own_kl, unquantized_kl)[0] if limited else kl_threshold(noise, own_kl, unquantized_kl)
    to_unquantized = compare(served["prompt_logprobs"], unquantized)["kl_divergence"]
    student_to_unquantized = compare(as_served(reference), unquantized)["kl_divergence"]
    ratio = to_unquantized / student_to_unquantized if student_to_unquantized > 0 else None
    agreement = figures["top1_agreement"]
    reasons = []
    if kl > kl_max:
        reasons.append(f"KL {kl:.4g} nats/token is over its threshold {kl_max:.4g}" if limited else
                       threshold_reason(kl, noise, own_kl, unquantized_kl))
    if limited and (ratio is None or not QUANTIZED_BAND[0] <= ratio <= QUANTIZED_BAND[1]):
        reasons.append(f"the served model is {to_unquantized:.4g} nats/token from the unquantized model, "
                       f"{ratio if ratio is not None else float('nan'):.2f} x the student's own {student_to_unquantized:.4g}: "
                       f"not quantized as the student is (band {QUANTIZED_BAND[0]}-{QUANTIZED_BAND[1]} x; the view's own "
                       f"noise {noise:.4g} reaches the unquantized model's {unquantized_kl:.4g})")
    if not limited and kl > CLOSER_SHARE * to_unquantized:
        reasons.append(f"the served model is {kl:.4g} nats/token from the student and {to_unquantized:.4g} from the "
                       f"unquantized model: not closer to the student by {CLOSER_SHARE} (is it quantized?)")
    if view == "w4a16" and agreement is not None and agreement < TOP1_MIN:
        reasons.append(f"top-1 agreement {agreement:.3f} < {TOP1_MIN}")
    return {**figures, "kl_divergence_max": kl_max, "kl_to_unquantized": to_unquantized,
            "unquantized_kl": unquantized_kl, "noise_limited": limited,
            "student_to_unquantized": student_to_unquantized, "quantization_ratio": ratio,
            "student_noise": noise, "quantization_kl": own_kl,
            "served_as": served.get("quantization"), "served_kv_cache_dtype": served.get("kv_cache_dtype"),
            "passed": not reasons, "reasons": reasons}


def as_served(reference: dict) -> list:
    """A reference's top-K log-probs in the form vLLM returns them (`compare`'s first argument)."""
    return [[[ids.tolist(), lps.tolist()] for ids, lps in zip(prompt_ids, prompt_lps)]
            for prompt_ids, prompt_lps in zip(reference["ids"], reference["logprobs"])]


def summary_line(result: dict) -> str:
    verdict = "passed" if result["passed"] else "FAILED"
    head = (f"serving check {verdict}: level {result['level']}, vLLM {result['vllm_version']}, "
            f"quantization {result['quantization']}, kv cache {result['kv_cache_dtype']}")
    if result["level"] == "full" and "views" in result:
        kv = (f"; served with a {result['served_kv_cache_dtype']} KV cache: {result['kv_cache_fallback']}"
              if result.get("kv_cache_fallback") else "")
        parts = []
        for view, v in result["views"].items():
            top1 = v["top1_agreement"]
            parts.append(f"{view}: KL {v['kl_divergence']:.5f} nats/token (max {v['kl_divergence_max']:.4f}), top-1 "
                         + (f"{top1:.3f}" if top1 is not None else "n/a")
                         + (f" (min {TOP1_MIN})" if view == "w4a16" else "") + f" over {v['decided_positions']} decided"
                         + (f", noise-limited: {v['quantization_ratio'] or 0:.2f} x the student's distance from the "
                            f"unquantized model (band {QUANTIZED_BAND[0]}-{QUANTIZED_BAND[1]})" if v.get("noise_limited") else "")
                         + "".join(f" [FAILED: {r}]" for r in v["reasons"][:1]))
        return f"{head}, {result['positions']} positions; " + "; ".join(parts) + kv
    if result.get("error"):
        return f"{head}: {result['error'].splitlines()[-1][:300]}"
    problems = result["config_problems"]
    why = (result.get("why_not_full") or "").strip().splitlines()
    return (f"{head}, {result['layers_checked']} layers as stored"
            + (f"; {len(problems)} problem(s): {problems[0]}" if problems else "")
            + (f"; no full check: {why[-1][:200]}" if why else ""))
