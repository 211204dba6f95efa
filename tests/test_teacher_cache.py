"""The cached teacher (qad_pipeline/training/cached_teacher.py): written from the demo model over synthetic
training windows, read back as QAD reads it, against Model Optimizer's live KD loss.

Measured on the demo (4,096-token vocabulary, 8 random-token windows x 32 positions, temperature
2, so a flat teacher with much mass in the tail; a student whose logits are the teacher's plus
Gaussian noise of 0.5): with the top k holding the whole vocabulary the cached loss equals the
live one to float rounding. At k = 8 with 16 tail samples one cache's mean loss scatters by ~11 %
(standard deviation over seeds) around the live 0.1235; the mean of 80 caches was 0.1239 +- 0.0015.
The one-bucket estimator (m = 0) is below the live loss at every position.

Unbiasedness, of the loss and of its gradient (what training follows), is checked on a problem
small enough for 400 caches in a second (`test_the_cached_loss_and_its_gradient_are_unbiased`)."""

import numpy as np
import pytest
import torch
from modelopt.torch.distill.losses import LogitsDistillationLoss

from qad_pipeline.core.config import PROJECT_PARAMS, ConfigError, load_params
from qad_pipeline.core.modeling import load_model
from qad_pipeline.scoring.reference import kl_estimate, reference_terms
from qad_pipeline.core.stages import planned
from qad_pipeline.training.cached_teacher import TeacherCache, used_windows, write_cache
from qad_pipeline.training.training_text import batch_indices

WINDOWS, SEQ, T = 8, 32, 2.0


def settings(k: int, m: int, seed: int = 0, **more) -> list[str]:
    base = {"qad.teacher": "cached", "qad.seq_len": SEQ, "qad.batch_size": 4, "qad.steps": 2, "qad.grad_accum": 1,
            "qad.temperature": T, "qad.teacher_top_k": k, "qad.teacher_tail_samples": m, "qad.seed": seed, **more}
    return [f"{key}={value}" for key, value in base.items()]


@pytest.fixture(scope="module")
def teacher(demo_model_path):
    params = load_params(PROJECT_PARAMS, [f"base_model.path={demo_model_path}", "hardware.device=cpu"])
    return params, load_model(params.base_model, params.hardware)


@pytest.fixture(scope="module")
def windows():
    return np.random.default_rng(0).integers(0, 4096, size=(WINDOWS, SEQ)).astype(np.int64)


def losses(teacher, windows, tmp_path, k: int, m: int, seed: int = 0):
    """(cached loss per token, live loss per token) for every window, the student's logits noisy."""
    base, model = teacher
    params = load_params(PROJECT_PARAMS, [f"base_model.path={base.base_model.path}", *settings(k, m, seed)])
    folder = tmp_path / f"cache-{k}-{m}-{seed}"
    write_cache(model, windows, params, folder, batch_size=4)
    cache = TeacherCache(folder, params, windows)
    rows = np.array(cache.manifest["windows"])
    with torch.no_grad():
        teacher_logits = model(input_ids=torch.from_numpy(windows[rows])).logits.float()
    student = teacher_logits + 0.5 * torch.randn(teacher_logits.shape, generator=torch.Generator().manual_seed(1))
    live = LogitsDistillationLoss(temperature=T, reduction="none")(student, teacher_logits)
    return cache.loss(rows, student, T), live


def test_the_cache_is_exact_when_its_top_k_holds_the_vocabulary(teacher, windows, tmp_path):
    cached, live = losses(teacher, windows, tmp_path, k=4096, m=32)
    torch.testing.assert_close(cached, live, rtol=1e-4, atol=1e-6)


def test_one_bucket_is_a_lower_bound(teacher, windows, tmp_path):
    """One bucket (m = 0): at or below the live loss at every position (log-sum inequality)."""
    bucket, live = losses(teacher, windows, tmp_path, k=8, m=0)
    assert (bucket <= live + 1e-6).all() and bucket.mean() < live.mean()


def test_the_cached_loss_and_its_gradient_are_unbiased():
    """400 caches of one tiny problem (256 positions, a 64-token vocabulary, k = 8 with 16 tail
    samples, 39 % of the mass in the tail): each cache as the writer makes it (`reference_terms`),
    its loss as QAD computes it (`kl_estimate`, behind `TeacherCache.loss` and the chunked loss).

    Loss: the mean over caches within 3 standard errors of the live loss (its standard error here
    is 0.5 % of the loss; 20 caches of the demo resolved 7.5 %). Gradient, with respect to the
    student's logits: ||mean - live||^2 over the noise's share of it, trace(covariance) / 400 from
    the caches' own scatter. Unbiased, that ratio is 1 (measured 0.98-1.02 over three sets of
    seeds); a bias b adds 400 ||b||^2 / trace(covariance), so the bound 1.2 fails any bias above
    3.5 % of the gradient's norm. The control: the same caches without the tail's mass (p_R = 1,
    the renormalisation left out) give 289."""
    gen = torch.Generator().manual_seed(0)
    teacher_logits = 3.0 * torch.randn(256, 64, generator=gen)
    student = teacher_logits + 0.5 * torch.randn(teacher_logits.shape, generator=gen)
    teacher_lp = torch.log_softmax(teacher_logits / T, dim=-1)

    def loss_and_gradient(per_position):
        logits = student.clone().requires_grad_(True)
        loss = per_position(logits).mean()
        loss.backward()
        return loss.item(), logits.grad

    def cached(terms, renormalised=True):
        top_ids, top_lp, tail_ids, tail_lp, rest = terms
        rest = rest if renormalised else torch.zeros_like(rest)
        return lambda logits: T**2 * kl_estimate(top_ids, top_lp, tail_ids, tail_lp, rest,
                                                 torch.log_softmax(logits / T, dim=-1))

    live_loss, live_grad = loss_and_gradient(lambda logits: LogitsDistillationLoss(
        temperature=T, reduction="none")(logits, teacher_logits))
    caches = [reference_terms(teacher_lp, 8, 16, torch.Generator().manual_seed(seed)) for seed in range(400)]

    def bias_over_noise(renormalised=True):
        values, grads = zip(*(loss_and_gradient(cached(terms, renormalised)) for terms in caches))
        grads = torch.stack(grads)
        noise = grads.var(0).sum() / len(caches)  # E ||mean - expectation||^2
        return np.array(values), (((grads.mean(0) - live_grad) ** 2).sum() / noise).item()

    values, ratio = bias_over_noise()
    assert abs(values.mean() - live_loss) < 3 * values.std(ddof=1) / np.sqrt(len(values))
    assert 0.8 < ratio < 1.2, ratio
    assert bias_over_noise(renormalised=False)[1] > 1.2  # the check sees a biased estimator


def test_the_cache_holds_the_windows_qad_draws_and_refuses_others(teacher, windows, tmp_path):
    base, model = teacher
    params = load_params(PROJECT_PARAMS, [f"base_model.path={base.base_model.path}", *settings(8, 4)])
    stream = batch_indices(WINDOWS, 4, 0)
    assert set(used_windows(WINDOWS, params)) == set(np.concatenate([next(stream), next(stream)]))
    write_cache(model, windows, params, tmp_path / "c", batch_size=4)
    with pytest.raises(ConfigError, match="written for other training windows or teacher settings"):
        TeacherCache(tmp_path / "c", params.model_copy(update={"qad": params.qad.model_copy(update={"temperature": 1.0})}),
                     windows)
    with pytest.raises(ConfigError, match="no teacher cache at"):
        TeacherCache(tmp_path / "none", params, windows)


def test_the_stage_runs_only_for_a_cached_teacher():
    names = [s.name for s, _ in planned(load_params(PROJECT_PARAMS, ["qad.teacher=cached"]))]
    assert names.index("calibration") < names.index("teacher_cache") < names.index("qad")
    assert "teacher_cache" not in [s.name for s, _ in planned(load_params(PROJECT_PARAMS))]
    assert "teacher_cache" not in [s.name for s, _ in planned(load_params(
        PROJECT_PARAMS, ["qad.teacher=cached", "selection.policy=ptq_final"]))]
