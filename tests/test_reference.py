"""The BF16 reference: written once by the baseline, read streaming; its KL estimate is close to the
exact full-vocabulary KL; the PTQ stage never runs the BF16 model over the eval windows."""

import pytest
import torch
import torch.nn.functional as F

from qad_pipeline.core.calibration_data import load_calibration, load_ppl_windows
from qad_pipeline.core.config import load_params
from qad_pipeline.core.modeling import load_model
from qad_pipeline.scoring.reference import Reference, ReferenceWriter, logprob_chunks, score_windows
from tests.conftest import GOOD_RECIPES

AGGRESSIVE = "nvfp4_4o6-mamba_w4a16-kv_nvfp4"


@pytest.fixture(scope="module")
def models(pipeline_run):
    """The BF16 demo model, the most aggressive recipe's quantized model, and the run's eval windows."""
    from tasks.ptq import quantize_model

    _, layout, overrides, _ = pipeline_run
    params = load_params(overrides=overrides)
    windows = torch.from_numpy(load_ppl_windows(layout.data))
    bf16 = load_model(params.base_model, params.hardware)
    quantized = load_model(params.base_model, params.hardware)
    quantize_model(quantized, params.recipe_path(AGGRESSIVE), torch.from_numpy(load_calibration(layout.data)),
                   params.ptq.calib_batch_size)
    return params, layout, bf16, quantized, windows


def full_logprobs(model, windows):
    with torch.no_grad():
        return F.log_softmax(model(input_ids=windows).logits[:, :-1].float(), dim=-1)


def write_reference(folder, model, windows, k, m):
    writer = ReferenceWriter(folder, len(windows), windows.shape[1] - 1, model.config.vocab_size, k, m)
    score_windows(model, windows, 2, writer=writer)
    writer.close({})
    return Reference(folder)


def test_chunked_log_probs_equal_the_full_forward_and_stay_within_the_chunk(models):
    _, _, bf16, quantized, windows = models
    for model in (bf16, quantized):
        full = full_logprobs(model, windows)
        seen = torch.full_like(full, float("nan"))
        for i, s, e, lp in logprob_chunks(model, windows, batch_size=2, chunk_tokens=40):
            assert lp.shape[0] * lp.shape[1] <= 40  # never more than one chunk of [tokens, vocab]
            seen[i : i + lp.shape[0], s:e] = lp
        torch.testing.assert_close(seen, full, rtol=0, atol=1e-5)


def test_kl_estimate_is_close_to_the_exact_full_vocabulary_kl(models, tmp_path):
    """Measured: k = m = 32 on the 4 x 63 positions of the tests' run was within 1 % of the exact
    KL (five seeds of the tail samples within 3.8 %); the bound below allows 3x the worst seed."""
    _, _, bf16, quantized, windows = models
    p, q = full_logprobs(bf16, windows), full_logprobs(quantized, windows)
    exact = (p.exp() * (p - q)).sum(-1).mean().item()
    assert exact > 1e-3  # quantization really moved the distribution

    estimate = score_windows(quantized, windows, 2, reference=write_reference(tmp_path / "mc", bf16, windows, 32, 32))
    assert estimate["kl_divergence"] == pytest.approx(exact, rel=0.12)

    bucket = score_windows(quantized, windows, 2, reference=write_reference(tmp_path / "b", bf16, windows, 32, 0))
    assert bucket["kl_divergence"] <= exact * (1 + 1e-4)  # without tail samples: a lower bound

    whole = write_reference(tmp_path / "all", bf16, windows, 10**6, 32)  # k >= vocab: exact
    assert whole.manifest["k"] == bf16.config.vocab_size and whole.manifest["tail_samples"] == 0
    assert score_windows(quantized, windows, 2, reference=whole)["kl_divergence"] == pytest.approx(exact, rel=1e-4)
    assert score_windows(bf16, windows, 2, reference=whole)["kl_divergence"] == pytest.approx(0.0, abs=1e-6)


def test_the_reference_is_bounded_and_belongs_to_its_windows(models):
    params, layout, _, _, windows = models
    ref = Reference(layout.reference)
    positions = windows.shape[1] - 1
    k, m = params.eval.kl_top_k, params.eval.kl_tail_samples
    on_disk = sum(a.nbytes for a in ref.arrays)
    assert on_disk == len(windows) * positions * (8 * k + 8 * m + 4)  # independent of the vocabulary
    ref.check_windows(windows)
    with pytest.raises(ValueError, match="computed on other eval windows"):
        ref.check_windows(windows[:, :-1])


def test_ptq_never_runs_the_bf16_model_over_the_eval_windows(models, monkeypatch, tmp_path):
    """One model is loaded, and nothing runs through it before Model Optimizer quantizes it."""
    import tasks.ptq as ptq

    params, layout, _, _, _ = models
    loaded, forwards_before_quantize = [], []
    real_load, real_quantize = ptq.load_model, ptq.quantize_model

    def counting_load(*args, **kwargs):
        model = real_load(*args, **kwargs)
        model.calls = 0
        model.register_forward_pre_hook(lambda m, _: setattr(m, "calls", m.calls + 1))
        loaded.append(model)
        return model

    def recording_quantize(model, *args):
        forwards_before_quantize.append(model.calls)
        return real_quantize(model, *args)

    monkeypatch.setattr(ptq, "load_model", counting_load)
    monkeypatch.setattr(ptq, "quantize_model", recording_quantize)
    result = ptq.run_ptq(params, GOOD_RECIPES[0], layout.data, layout.reference, tmp_path / "ptq")
    assert len(loaded) == 1 and forwards_before_quantize == [0]
    assert result["kl_divergence"] > 0 and loaded[0].calls > 0  # the quantized model was evaluated
