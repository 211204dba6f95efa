"""eval.backend vllm: the served_eval stage (the export and the BF16 model scored as vLLM serves
them) with vLLM's side stood in for; the real vLLM runs in tests/test_serving.py."""

import pytest

from qad_pipeline.scoring import served_scores
from qad_pipeline.core.config import ConfigError, load_params
from qad_pipeline.core.layout import Layout
from qad_pipeline.reporting.report import read_summary, report_text
from qad_pipeline.results.base import write_result
from qad_pipeline.tracking.children import ChildRun, served_eval_run
from tasks import served_eval as stage
from tests import samples


def fake_scores(cloze: list[float], ppl_nll: list[float]) -> dict:
    """What `vllm_evaluate` returns for one model: a cloze task (per-item accuracy) and perplexity."""
    import math

    tasks = {"heldout_cloze": {"metric": "acc", "filter": "none", "value": sum(cloze) / len(cloze),
                               "higher_is_better": True, "all": {"acc,none": sum(cloze) / len(cloze)}},
             "perplexity": {"metric": "perplexity", "value": math.exp(-sum(ppl_nll) / len(ppl_nll)),
                            "higher_is_better": False}}
    items = {"heldout_cloze": {"aggregation": "mean", "ids": list(range(len(cloze))), "values": cloze},
             "perplexity": {"aggregation": "perplexity", "ids": list(range(len(ppl_nll))), "values": ppl_nll}}
    return {"tasks": tasks, "items": items, "served": {"vllm_version": "0.32.0", "kv_cache_fallback": None}}


@pytest.fixture
def run(tmp_path):
    layout = Layout(tmp_path)
    write_result(layout.export_metrics, samples.export_metrics(layout.export))
    recovered = {"heldout_cloze": samples.score(0.5, recovery=0.9), "perplexity": samples.score(40.0, "perplexity",
                                                                                                 False, recovery=0.95)}
    write_result(layout.qad_metrics, samples.qad_metrics("a", recovered, 0.925))
    write_result(layout.selection_metrics, samples.selection("a", []))
    write_result(layout.baseline_metrics, samples.baseline({"heldout_cloze": samples.score(0.55)}))
    return load_params(overrides=["eval.backend=vllm"]), layout


def test_the_served_recovery_is_the_export_over_the_served_bf16_beside_the_in_memory_one(run, monkeypatch):
    params, layout = run
    bf16 = fake_scores([1.0] * 40 + [0.0] * 10, [-3.0] * 20)
    export = fake_scores([1.0] * 36 + [0.0] * 14, [-3.1] * 20)
    scored = []

    def fake(folder, eval_params, data_dir, log=print):
        scored.append(folder)
        return export if folder == layout.export else bf16

    monkeypatch.setattr(served_scores, "vllm_evaluate", fake)
    result = stage.run_served_eval(params, layout, log=lambda *_: None)
    assert result.ran and scored[1] == layout.export  # the BF16 base model first, then the export itself
    assert result.tasks["heldout_cloze"].recovery == pytest.approx(0.72 / 0.8)
    assert result.tasks["perplexity"].recovery == pytest.approx(20.0855 / 22.198, rel=1e-3)  # lower is better
    assert result.median_recovery == pytest.approx((0.9 + 20.0855 / 22.198) / 2, rel=1e-3)
    low, high = result.median_recovery_ci
    assert low < result.median_recovery < high
    assert result.in_memory.stage == "final_eval" and result.in_memory.median_recovery == 0.925
    assert result.agree == (max(low, 0.915) <= min(high, 0.93))
    assert (layout.served_eval / "export_items.json").is_file() and layout.served_metrics.is_file()
    text = report_text(read_summary(layout, params))
    assert "The exported checkpoint served by vLLM: median recovery" in text and "in memory (final_eval) 92.50 %" in text
    child = ChildRun("served_eval", "served_eval", 0, 1)
    served_eval_run(child, result, params)  # its MLflow run
    assert child.metrics["median_recovery"] == result.median_recovery and child.metrics["in_memory_median_recovery"] == 0.925
    assert child.metrics["recovery.perplexity"] == result.tasks["perplexity"].recovery and child.tags["ran"] is True


def test_an_export_vllm_cannot_run_here_keeps_the_in_memory_recovery_and_says_why(run, monkeypatch):
    params, layout = run
    config_only = "serving check passed: level config, vLLM 0.32.0, ...; no full check: NemotronH is not supported on CPU"
    write_result(layout.export_metrics, samples.export_metrics(layout.export, serving_check={
        "level": "config", "summary": config_only}))
    monkeypatch.setattr(served_scores, "vllm_evaluate", lambda *a, **k: pytest.fail("vLLM must not be asked"))
    result = stage.run_served_eval(params, layout)
    assert not result.ran and result.why_not.endswith(config_only) and result.median_recovery is None
    assert stage.main(params, layout).startswith("served eval: not run, recovery stays the in-memory one")
    assert "Not scored through vLLM; the recovery above is the in-memory one" in report_text(read_summary(layout, params))


def test_the_vllm_backend_is_refused_up_front_without_an_export_or_without_lm_eval_beside_vllm(tmp_path, monkeypatch):
    from qad_pipeline.checks import vllm_setup

    with pytest.raises(ConfigError, match="eval.backend vllm scores the exported checkpoint, and export.source is none"):
        vllm_setup.check_served_eval_env(load_params(overrides=["eval.backend=vllm", "export.source=none"]))
    env = tmp_path / "venv"
    (env / "bin").mkdir(parents=True)
    (env / "bin" / "python").symlink_to("/usr/bin/python3")  # a Python without lm-eval
    monkeypatch.setenv("QAD_VLLM_ENV", str(env))
    with pytest.raises(ConfigError, match=r"needs lm-eval [\d.]+ in the vLLM environment .*qad-pipeline setup-vllm"):
        vllm_setup.check_served_eval_env(load_params(overrides=["eval.backend=vllm"]))
    with pytest.raises(ConfigError, match="backend"):
        load_params(overrides=["eval.backend=tgi"])
