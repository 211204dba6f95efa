"""The serving check's gates, pinned: each threshold constant of `serving_reference.kl_threshold` and
`serving_verdict.judge_view` has a served model just over its line that fails and one just under it that
passes, so loosening any constant (10x, or 2x for the tight ones) fails a named test here. The
served models are the student's log-probs with a corruption scaled to land where the test needs
(`served_at`); the real model's w4a4 view refusing its unquantized model is in test_serving.py."""

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


def test_noise_cannot_widen_the_line_past_what_the_unquantized_model_scores():
    """A view whose student noise is as large as the quantization itself (W4A4 on SmolLM2: 0.20 vs
    0.29) is capped at CLOSER_SHARE of the unquantized model's figure, and a served model between
    the cap and the noise line fails with that reason."""
    logprobs, reference, unquantized = student(noise=0.5, own_kl=0.5)
    unquantized_kl = serving_verdict.compare(serving_verdict.as_served(unquantized), reference)["kl_divergence"]
    cap = CLOSER_SHARE * unquantized_kl
    assert line_of(reference, unquantized) == pytest.approx(cap) and cap < NOISE_FACTOR * 0.5 and CLOSER_SHARE == 0.9
    assert verdict(logprobs, reference, unquantized, 0.8 * cap)["passed"]
    failed = verdict(logprobs, reference, unquantized, 1.05 * cap)
    assert not failed["passed"] and "not measurably closer to the student than the unquantized model" in \
        failed["reasons"][0]


def test_served_model_must_be_closer_to_the_student_than_to_the_unquantized_model():
    """Position by position on the same prompts: the unquantized model itself, served in the
    student's place, is ~0 from the unquantized reference and fails however wide the KL line is."""
    logprobs, reference, unquantized = student(noise=10.0, own_kl=10.0)  # the KL line alone would pass anything
    as_unquantized = {"prompt_logprobs": serving_verdict.as_served(unquantized)}
    failed = serving_verdict.judge_view("w4a4", as_unquantized, {**reference, "own_kl": 10.0}, unquantized)
    assert failed["kl_to_unquantized"] == pytest.approx(0, abs=1e-9) and not failed["passed"]
    assert any("not closer to the student" in r for r in failed["reasons"])
    # the log-probs mixed towards the unquantized model: at 0.45 still closer to the student (0.73 of
    # its distance to the unquantized model), halfway closer to neither (1.09)
    for weight, passed in ((0.45, True), (0.5, False)):
        mixed = torch.log_softmax((1 - weight) * logprobs + weight * _dense(unquantized), -1)
        result = serving_verdict.judge_view("w4a4", {"prompt_logprobs": serving_verdict.as_served(top(mixed))}, reference, unquantized)
        assert result["passed"] == passed, (weight, result["reasons"])
        assert passed or result["reasons"][0].startswith("the served model is")


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
