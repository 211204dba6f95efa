"""The serving check's gates, pinned: each threshold constant of `serving_reference.kl_threshold` and
`serving_verdict.judge_view` has a served model just over its line that fails and one just under it that
passes, so loosening any constant (10x, or 2x for the tight ones) fails a named test here. The
served models are the student's log-probs with a corruption scaled to land where the test needs
(`served_at`), or, in a noise-limited view, other draws of the quantization error
(`quantization_draws`); the real model's w4a4 view refusing its unquantized model and its W4A16
model is in test_serving.py."""

import numpy as np
import pytest
import torch

from qad_pipeline.checks import serving_reference, serving_verdict
from qad_pipeline.checks.serving_reference import CLOSER_SHARE, KL_FLOOR, NOISE_FACTOR, QUANTIZATION_SHARE

PROMPTS, POSITIONS, VOCAB = 2, 25, 64


def top(logprobs: torch.Tensor) -> dict:
    ranked = logprobs.topk(VOCAB, -1)
    return {"ids": ranked.indices.numpy(), "logprobs": ranked.values.numpy()}


def student(seed: int = 0, **figures) -> tuple[torch.Tensor, dict, dict]:
    """(log-probs, the view's reference with `figures` (noise, own_kl), the unquantized reference:
    ~0.5 nats/token from the student)."""
    gen = torch.Generator().manual_seed(seed)
    logits = 3 * torch.randn(PROMPTS, POSITIONS, VOCAB, generator=gen)
    unquantized = torch.log_softmax(logits + 1.5 * torch.randn(logits.shape, generator=gen), -1)
    return torch.log_softmax(logits, -1), {**top(torch.log_softmax(logits, -1)), **figures}, top(unquantized)


def served_at(logprobs: torch.Tensor, reference: dict, kl: float) -> dict:
    """The student's log-probs plus a fixed random direction, scaled so that `compare` gives `kl`."""
    direction = torch.randn(logprobs.shape, generator=torch.Generator().manual_seed(1))

    def at(scale: float) -> dict:
        return {"prompt_logprobs": serving_verdict.as_served(top(torch.log_softmax(logprobs + scale * direction, -1)))}

    low, high = 0.0, 4.0
    for _ in range(60):
        mid = (low + high) / 2
        low, high = (mid, high) if serving_verdict.compare(at(mid)["prompt_logprobs"], reference)["kl_divergence"] < kl \
            else (low, mid)
    served = at(high)
    assert serving_verdict.compare(served["prompt_logprobs"], reference)["kl_divergence"] == pytest.approx(kl, rel=1e-3)
    return served


def verdict(logprobs, reference, unquantized, kl: float, view: str = "w4a4") -> dict:
    return serving_verdict.judge_view(view, served_at(logprobs, reference, kl), reference, unquantized)


def line_of(reference, unquantized) -> float:
    unquantized_kl = serving_verdict.compare(serving_verdict.as_served(unquantized), reference)["kl_divergence"]
    return serving_reference.kl_threshold(reference["noise"], reference["own_kl"], unquantized_kl)


def test_kl_floor_is_the_line_where_noise_and_quantization_are_tiny():
    logprobs, reference, unquantized = student(noise=0.0, own_kl=0.01)
    assert line_of(reference, unquantized) == KL_FLOOR == 1e-3
    assert verdict(logprobs, reference, unquantized, 0.8e-3)["passed"]
    assert not verdict(logprobs, reference, unquantized, 1.25e-3)["passed"]


def test_noise_factor_sets_the_line_at_twice_the_students_noise():
    logprobs, reference, unquantized = student(noise=0.01, own_kl=0.2)
    assert line_of(reference, unquantized) == pytest.approx(NOISE_FACTOR * 0.01) and NOISE_FACTOR == 2.0
    assert verdict(logprobs, reference, unquantized, 0.016)["passed"]
    failed = verdict(logprobs, reference, unquantized, 0.025)
    assert not failed["passed"] and failed["reasons"] == ["KL 0.025 nats/token is over its threshold 0.02"]


def test_quantization_share_sets_the_line_at_three_percent_of_the_quantizations_kl():
    logprobs, reference, unquantized = student(noise=0.0, own_kl=0.2)
    assert line_of(reference, unquantized) == pytest.approx(QUANTIZATION_SHARE * 0.2) and QUANTIZATION_SHARE == 0.03
    assert verdict(logprobs, reference, unquantized, 0.0048)["passed"]
    assert not verdict(logprobs, reference, unquantized, 0.0075)["passed"]


def test_a_view_whose_noise_stays_under_the_cap_is_capped_there_and_not_noise_limited():
    """The cap at CLOSER_SHARE of the unquantized model's figure binds where it lies under the noise
    line only in a noise-limited view; below it, noise widens the line up to the cap."""
    logprobs, reference, unquantized = student(noise=0.2, own_kl=0.5)
    unquantized_kl = serving_verdict.compare(serving_verdict.as_served(unquantized), reference)["kl_divergence"]
    assert NOISE_FACTOR * 0.2 < CLOSER_SHARE * unquantized_kl and CLOSER_SHARE == 0.9
    assert not serving_reference.noise_limited(0.2, 0.5, unquantized_kl)
    assert line_of(reference, unquantized) == pytest.approx(NOISE_FACTOR * 0.2)
    result = verdict(logprobs, reference, unquantized, 0.3)
    assert result["passed"] and not result["noise_limited"]


def test_served_model_must_be_closer_to_the_student_than_to_the_unquantized_model():
    """Position by position on the same prompts: the unquantized model itself, served in the
    student's place, is ~0 from the unquantized reference and fails; a mix towards it fails once it
    is no longer closer to the student, though within the KL line."""
    logprobs, reference, unquantized = student(noise=0.2, own_kl=0.5)  # a wide line, not noise-limited
    as_unquantized = {"prompt_logprobs": serving_verdict.as_served(unquantized)}
    failed = serving_verdict.judge_view("w4a4", as_unquantized, reference, unquantized)
    assert failed["kl_to_unquantized"] == pytest.approx(0, abs=1e-9) and not failed["passed"]
    assert not failed["noise_limited"] and any("not closer to the student" in r for r in failed["reasons"])
    # the log-probs mixed towards the unquantized model: at 0.45 still closer to the student (0.73 of
    # its distance to the unquantized model), halfway closer to neither (1.09)
    for weight, passed in ((0.45, True), (0.5, False)):
        mixed = torch.log_softmax((1 - weight) * logprobs + weight * _dense(unquantized), -1)
        result = serving_verdict.judge_view("w4a4", {"prompt_logprobs": serving_verdict.as_served(top(mixed))}, reference, unquantized)
        assert result["passed"] == passed, (weight, result["reasons"])
        assert passed or result["reasons"][0].startswith("the served model is")


def quantization_draws(noise: float = 0.6):
    """A noise-limited view as W4A4 makes one (docs/export.md): the unquantized model's logits, the
    student's = those plus one random quantization error, and `draw(scale)`, another implementation's
    = those plus an independent error `scale` times as large, as far from the student as from the
    unquantized model when scale is 1. Returns (reference, unquantized, draw)."""
    gen = torch.Generator().manual_seed(3)
    base = 3 * torch.randn(PROMPTS, POSITIONS, VOCAB, generator=gen)
    error = 1.0 * torch.randn(base.shape, generator=gen)
    other = 1.0 * torch.randn(base.shape, generator=gen)
    logprobs = torch.log_softmax(base + error, -1)
    unquantized = top(torch.log_softmax(base, -1))
    own_kl = serving_verdict.compare(serving_verdict.as_served(top(logprobs)), unquantized)["kl_divergence"]
    reference = {**top(logprobs), "noise": noise, "own_kl": own_kl}

    def draw(scale: float) -> dict:
        return {"prompt_logprobs": serving_verdict.as_served(top(torch.log_softmax(base + scale * other, -1)))}

    return reference, unquantized, draw


def drawn_at(draw, unquantized, reference, ratio: float) -> dict:
    """Another implementation's draw whose distance from the unquantized model is `ratio` x the student's."""
    own = serving_verdict.compare(serving_verdict.as_served(reference), unquantized)["kl_divergence"]
    low, high = 0.0, 4.0
    for _ in range(50):
        mid = (low + high) / 2
        low, high = (mid, high) if serving_verdict.compare(draw(mid)["prompt_logprobs"], unquantized)[
            "kl_divergence"] < ratio * own else (low, mid)
    return draw(high)


def test_a_noise_limited_view_judges_the_served_model_as_a_quantization_of_the_model():
    """Where two faithful implementations differ by as much as the unquantized model does (the cap
    under the noise line), the served model is held to the noise line, and its distance from the
    unquantized model must be QUANTIZED_BAND x the student's: another draw of the same size passes,
    the unquantized model (0), a draw 0.6 x as far (activations not quantized, as W4A16 serving
    them: 0.36 on SmolLM2) and one 1.6 x as far fail; loosening either end 2x fails a case here."""
    reference, unquantized, draw = quantization_draws()
    unquantized_kl = serving_verdict.compare(serving_verdict.as_served(unquantized), reference)["kl_divergence"]
    assert serving_reference.noise_limited(reference["noise"], reference["own_kl"], unquantized_kl)
    assert serving_reference.QUANTIZED_BAND == (0.75, 1.33)
    for ratio, passed in ((1.0, True), (0.8, True), (1.25, True), (0.6, False), (1.6, False), (0.0, False)):
        served = {"prompt_logprobs": serving_verdict.as_served(unquantized)} if ratio == 0 else \
            drawn_at(draw, unquantized, reference, ratio)
        result = serving_verdict.judge_view("w4a4", served, reference, unquantized)
        assert result["noise_limited"] and result["passed"] == passed, (ratio, result["reasons"])
        assert result["kl_divergence_max"] == pytest.approx(NOISE_FACTOR * reference["noise"])
        assert result["quantization_ratio"] == pytest.approx(ratio, abs=1e-3)
        assert passed or "not quantized as the student is" in result["reasons"][0]
    # the noise line still holds: a draw as far from the unquantized model as the student, but farther
    # from the student than twice its noise, fails on the line
    tight = {**reference, "noise": 0.35}
    assert serving_reference.noise_limited(0.35, reference["own_kl"], unquantized_kl)
    result = serving_verdict.judge_view("w4a4", drawn_at(draw, unquantized, reference, 1.0), tight, unquantized)
    assert not result["passed"] and result["reasons"][0].endswith(f"over its threshold {NOISE_FACTOR * 0.35:.4g}")


def _dense(reference: dict) -> torch.Tensor:
    """A full-vocabulary reference's log-probs back in token order."""
    dense = torch.empty(PROMPTS, POSITIONS, VOCAB)
    dense.scatter_(-1, torch.tensor(reference["ids"]).long(), torch.tensor(reference["logprobs"]))
    return dense


def swapped(margins: np.ndarray, swap: np.ndarray) -> tuple[dict, dict]:
    """A student whose top token leads its runner-up by `margins` (nats) per position, and a served
    model equal to it but with those two swapped where `swap`."""
    logits = torch.zeros(PROMPTS, POSITIONS, VOCAB)
    logits[..., 0], logits[..., 1] = 5.0, 5.0 - torch.tensor(margins, dtype=torch.float32)
    served = logits.clone()
    served[..., 0][torch.tensor(swap)], served[..., 1][torch.tensor(swap)] = \
        logits[..., 1][torch.tensor(swap)], logits[..., 0][torch.tensor(swap)]
    return top(torch.log_softmax(logits, -1)), {"prompt_logprobs": serving_verdict.as_served(top(torch.log_softmax(served, -1)))}


@pytest.mark.parametrize("swaps, passed", [(2, True), (4, False)])  # of 50 decided: top-1 0.96 and 0.92
def test_top1_agreement_of_the_w4a16_view_is_pinned_at_95_percent(swaps, passed):
    margins = np.full((PROMPTS, POSITIONS), 1.0)
    swap = np.zeros((PROMPTS, POSITIONS), bool)
    swap.flat[:swaps] = True
    reference, served = swapped(margins, swap)
    reference.update(noise=0.5, own_kl=5.0)
    unquantized = top(torch.log_softmax(torch.randn(PROMPTS, POSITIONS, VOCAB, generator=torch.Generator()
                                                    .manual_seed(3)) * 3, -1))
    result = serving_verdict.judge_view("w4a16", served, reference, unquantized)
    assert serving_verdict.TOP1_MIN == 0.95 and result["decided_positions"] == PROMPTS * POSITIONS
    assert result["passed"] == passed and result["top1_agreement"] == pytest.approx(1 - swaps / 50)
    assert passed or result["reasons"] == [f"top-1 agreement {1 - swaps / 50:.3f} < 0.95"]


def test_a_position_is_decided_from_a_lead_of_005_nats():
    """Swapped tokens that lead by 0.06 nats count against the agreement (a margin loosened to 0.12
    would let them through); those that lead by 0.04 do not count at all."""
    margins = np.full((PROMPTS, POSITIONS), 1.0)
    swap = np.zeros((PROMPTS, POSITIONS), bool)
    swap.flat[:4], margins.flat[:4] = True, 0.06
    margins.flat[4:8] = 0.04
    reference, served = swapped(margins, swap)
    reference.update(noise=0.5, own_kl=5.0)
    unquantized = top(torch.log_softmax(3 * torch.randn(PROMPTS, POSITIONS, VOCAB, generator=torch.Generator()
                                                        .manual_seed(3)), -1))
    result = serving_verdict.judge_view("w4a16", served, reference, unquantized)
    assert serving_verdict.DECIDED_MARGIN == 0.05 and result["decided_positions"] == 46 and not result["passed"]
