"""The serving check: a real vLLM (its own pinned environment, `qad-pipeline setup-vllm`) loads the
exports and agrees with the student they were exported from."""

import json
import re
import shlex
import subprocess
import sys

import numpy as np
import pytest
import torch
from transformers import AutoConfig, AutoTokenizer

from qad_pipeline.checks import serving, serving_reference, serving_verdict, vllm_setup
from qad_pipeline.core.config import load_params
from qad_pipeline.checks.export_checks import read_tensors
from qad_pipeline.checks.failure_catalog import nibbles_swapped
from qad_pipeline.core.layout import Layout
from tasks.baseline import run_baseline
from tasks.calibration import build_calibration
from tasks.export import run_export
from tasks.ptq import run_ptq
from tests.conftest import TINY

RECIPE = "nvfp4_4o6-mamba_w4a16-kv_nvfp4"  # the most aggressive: NVFP4 W4A4 MLP, NVFP4 KV cache


def real_overrides(*overrides: str) -> list[str]:
    """The real model's tiny run: one task, the one recipe, its PTQ checkpoint exported."""
    from benchmarks.real_model import build_real_model

    return TINY + [f"base_model.path={build_real_model()}", "eval.tasks=[heldout_continuation]",
                   f"ptq.recipes=[{RECIPE}]", f"export.source=ptq/{RECIPE}", *overrides]


def real_params(*overrides: str):
    return load_params(overrides=real_overrides(*overrides))


def export_real_model(root) -> tuple[dict, Layout, dict]:
    """PTQ with the most aggressive recipe, then the export of that PTQ checkpoint (`export.source
    ptq/<recipe>`, as `selection.policy: ptq_final` exports it), serving check included, of
    SmolLM2-135M-Instruct: a real pretrained model (`benchmarks/real_model.py`) with the outliers
    and block-scale range random weights lack, tied embeddings, head size 64 and a hidden size
    (576) that is no multiple of 128. Returns (export metrics, layout, PTQ result); the session's
    is the `real_export` fixture (tests/conftest.py)."""
    params = real_params()
    folder = params.base_model.path
    layout = Layout(root)
    build_calibration(params, AutoTokenizer.from_pretrained(folder), layout.data)
    run_baseline(params, layout.data, layout.baseline_metrics, layout.reference)
    ptq = run_ptq(params, RECIPE, layout.data, layout.reference, layout.ptq(RECIPE))
    return run_export(params, layout), layout, ptq


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "qad_pipeline", *args], capture_output=True, text=True, timeout=900)


@pytest.mark.slow
def test_real_model_export_passes_every_check_and_the_full_check_in_vllm(real_export):
    export, layout, _ = real_export
    assert export["source"] == f"ptq/{RECIPE}" and export["passed"], export["checks"]
    assert export["checks"]["lint"]["passed"] and export["checks"]["reload"]["passed"]
    check = export["checks"]["serving"]
    assert check["passed"] and check["level"] == "full", check["summary"]
    assert check["quantization"] == "modelopt_fp4" and check["kv_cache_dtype"] == "nvfp4"  # tied: no NVFP4 lm_head
    # vLLM's CPU attention has no NVFP4 KV-cache kernel (it would run its FP8 code on the cache):
    # the weights are served with a BF16 KV cache, and the check says so
    if not torch.cuda.is_available():
        assert check["served_kv_cache_dtype"] == "bfloat16" and check["kv_cache_fallback"].endswith("not nvfp4")
    assert check["logprobs_per_position"] == serving_reference.TOP_K  # 49,152 tokens: the top K, a lower bound
    # two views: NVFP4 activations in BF16 (Hopper) and as stored (Blackwell), each within its threshold
    assert set(check["views"]) == {"w4a16", "w4a4"}
    for name, view in check["views"].items():
        assert view["passed"] and view["kl_divergence"] <= view["kl_divergence_max"]
        line, cap = serving_reference.threshold_terms(view["student_noise"], view["quantization_kl"], view["unquantized_kl"])
        # W4A4 on this model: the student's own noise reaches the unquantized model's figure
        assert view["noise_limited"] == (name == "w4a4") == (cap < line)
        if view["noise_limited"]:  # served as a quantization of the model: as far from the unquantized model
            assert view["kl_divergence_max"] == line
            low, high = serving_reference.QUANTIZED_BAND
            assert low <= view["kl_to_unquantized"] / view["student_to_unquantized"] <= high
        else:  # the served model is the quantized one: measurably closer to the student than the unquantized model
            assert view["kl_divergence_max"] == min(line, cap)
            assert view["kl_divergence"] < serving_reference.CLOSER_SHARE * min(view["unquantized_kl"],
                                                                                view["kl_to_unquantized"])
    assert check["kl_divergence"] == check["views"]["w4a16"]["kl_divergence"] and check["top1_agreement"] >= serving_verdict.TOP1_MIN
    assert check["decided_positions"] > 0 and check["positions"] == serving_reference.PROMPTS * (serving_reference.PROMPT_LEN - 1)
    assert export["serving_check"]["level"] == "full"
    assert (layout.export / serving.REFERENCE_FILE).is_file()


@pytest.mark.slow
def test_w4a4_view_refuses_the_unquantized_and_the_w4a16_model_served_in_its_place(real_export):
    """The student with every quantizer off (the reference's own unquantized log-probs, which vLLM
    serving the BF16 model reproduces to 0.002 nats/token) in each view's place, and the student's
    W4A16 log-probs in the w4a4 view's place (activations left in BF16): the w4a4 view's KL line
    (2 x the student's noise, ~0.40) lets both through; its quantization band refuses both, the
    w4a16 view's closer condition the first."""
    _, layout, _ = real_export
    reference = serving_reference.read_reference(layout.export)
    unquantized = reference[serving_reference.UNQUANTIZED]
    served = {"prompt_logprobs": serving_verdict.as_served(unquantized)}
    result = serving_verdict.judge_view("w4a16", served, reference["w4a16"], unquantized)
    assert not result["passed"] and result["kl_to_unquantized"] == pytest.approx(0, abs=1e-9)
    assert any("not closer to the student" in reason for reason in result["reasons"]), result["reasons"]
    w4a16 = {"prompt_logprobs": serving_verdict.as_served(reference["w4a16"])}
    for served, ratio in ((served, 0.0), (w4a16, 0.6)):
        w4a4 = serving_verdict.judge_view("w4a4", served, reference["w4a4"], unquantized)
        assert w4a4["noise_limited"] and w4a4["kl_divergence"] < w4a4["kl_divergence_max"]  # why the band is needed
        assert not w4a4["passed"] and w4a4["quantization_ratio"] <= ratio, w4a4["quantization_ratio"]
        assert "not quantized as the student is" in w4a4["reasons"][0]


@pytest.mark.slow
def test_verify_serving_command_passes_the_export_and_fails_a_corrupted_copy(real_export, tmp_path, monkeypatch):
    """The failing path through a real vLLM; the passing one with the real export's own check result
    (the export ran the same `serving.verify_serving` in the fixture, through vLLM: checked above)."""
    from typer.testing import CliRunner

    from qad_pipeline.cli import app

    export, layout, _ = real_export
    passed = export["checks"]["serving"]
    monkeypatch.setattr(serving, "verify_serving", lambda folder, level: passed if folder == layout.export else None)
    good = CliRunner().invoke(app, ["verify-serving", str(layout.export)])
    assert good.exit_code == 0, good.output
    assert good.output.strip().splitlines()[-1] == passed["summary"]
    assert passed["summary"].startswith("serving check passed: level full")
    monkeypatch.undo()

    broken = nibbles_swapped(layout.export, tmp_path / "swapped")
    bad = cli("verify-serving", str(broken))
    last = bad.stdout.strip().splitlines()[-1]
    assert bad.returncode == 1 and last.startswith("serving check FAILED: level full"), bad.stdout + bad.stderr[-2000:]
    assert re.search(r"w4a16: KL [\d.]+ nats/token \(max [\d.]+\), top-1 0\.[01]", last), last


@pytest.mark.slow
def test_verify_export_gives_a_copy_the_export_stages_verdicts_and_refuses_an_edit(real_export, tmp_path):
    """`verify-export` on a copy of the export (no serving reference: it writes the run's student's
    beside links to the copy) reproduces the export stage's figures; on a copy whose one layer's
    global scale was edited, exit 2 and one line naming the check that failed and its figure."""
    import shutil

    from safetensors.torch import save_file
    from typer.testing import CliRunner

    from qad_pipeline.cli import app

    export, layout, _ = real_export
    settings = [arg for item in real_overrides() for arg in ("--set", item)]
    copy = shutil.copytree(layout.export, tmp_path / "copy", ignore=shutil.ignore_patterns(serving.REFERENCE_FILE))
    before = {p.name: p.stat().st_mtime_ns for p in copy.iterdir()}
    good = CliRunner().invoke(app, ["verify-export", str(copy), "--out-root", str(layout.root), "--json", *settings])
    assert good.exit_code == 0, good.output
    assert good.output.strip().splitlines()[-1].startswith(f"verify-export passed: {copy} against the run's student")
    result = json.loads(good.output[good.output.index('{\n  "checkpoint"'):good.output.rindex("}") + 1])
    assert set(result["checks"]) == set(export["checks"]) == {"formats", "size", "lint", "weights", "reload", "serving"}
    for name in ("formats", "size", "lint", "weights"):
        assert result["checks"][name] == export["checks"][name]
    assert result["checks"]["reload"]["kl_divergence"] == export["checks"]["reload"]["kl_divergence"]
    for view, figures in export["checks"]["serving"]["views"].items():
        assert result["checks"]["serving"]["views"][view]["kl_divergence"] == pytest.approx(figures["kl_divergence"],
                                                                                              rel=1e-6)
    assert {p.name: p.stat().st_mtime_ns for p in copy.iterdir()} == before  # nothing written into the folder

    tensors = read_tensors(copy)
    tensors["model.layers.3.mlp.down_proj.weight_scale_2"] *= 1.5  # one layer's global scale, edited
    save_file(tensors, str(copy / "model.safetensors"), metadata={"format": "pt"})
    bad = CliRunner().invoke(app, ["verify-export", str(copy), "--out-root", str(layout.root), *settings,
                                   "--set", "export.serving_check=skip"])
    last = bad.output.strip().splitlines()[-1]
    assert bad.exit_code == 2 and re.match(r"error: verify-export FAILED: \S+ against the run's student \(ptq/\S+\): "
                                           r"lint: model\.layers\.3\.mlp\.down_proj\.weight_scale_2: [\d.e-]+, the "
                                           r"student's calibrated scale is [\d.e-]+", last), last
    assert re.search(r"; reload: \{'kl_divergence': [\d.e-]+, 'tolerance': [\d.e-]+\}", last), last


@pytest.mark.slow
def test_printed_vllm_command_is_what_vllm_runs(real_export):
    """vLLM's own argument parser and model config take the printed command, and run exactly the
    quantization method and KV-cache dtype it names (vLLM would silently override a wrong one)."""
    export, _, _ = real_export
    command = export["serving"]["vllm"]
    words = shlex.split(command)
    named = {"quantization": words[words.index("--quantization") + 1],
             "kv_cache_dtype": words[words.index("--kv-cache-dtype") + 1]}
    assert serving.check_serve_command(command) == named == {"quantization": "modelopt_fp4", "kv_cache_dtype": "nvfp4"}
    assert "--quantization" not in export["serving"]["sglang"]  # SGLang reads hf_quant_config.json itself


@pytest.mark.slow
def test_served_eval_scores_the_real_export_and_bf16_through_lm_evals_vllm_model(real_export):
    """eval.backend vllm: the served_eval stage scores the exported checkpoint itself and the BF16
    model through lm-eval's vLLM model, on the items and windows the in-memory evaluation scored."""
    from qad_pipeline.core.artifacts import read_json
    from qad_pipeline.results.base import read_result
    from qad_pipeline.results.scores import BaselineMetrics
    from tasks.selection import run_selection
    from tasks.served_eval import run_served_eval

    _, layout, _ = real_export
    params = real_params("eval.backend=vllm")
    run_selection(params, layout)
    result = run_served_eval(params, layout, log=lambda *_: None)
    assert result.ran and result.source == f"ptq/{RECIPE}" and result.in_memory.stage == f"ptq/{RECIPE}"
    served = result.served["export"]
    assert served["quantization"] == "modelopt_fp4" and result.served["bf16"]["quantization"] is None
    if not torch.cuda.is_available():  # no NVFP4 KV cache in vLLM's CPU attention: said, as the serving check says it
        assert served["kv_cache_dtype"] == "bfloat16" and served["kv_cache_fallback"].endswith("not nvfp4")
    in_memory = read_json(layout.ptq(RECIPE) / "items.json")
    served_items = read_json(layout.served_eval / "export_items.json")
    assert {t: v["ids"] for t, v in served_items.items()} == {t: v["ids"] for t, v in in_memory.items()}
    # BF16 through vLLM and through transformers: the same model, so the same scores up to kernels
    # (measured on the full real-model eval: perplexity 29.328 vs 29.341, Brier score 0.0253 vs 0.0244)
    bf16 = read_result(layout.baseline_metrics, BaselineMetrics).tasks
    for task, score in result.baseline_tasks.items():
        assert score.metric == bf16[task].metric, task
        assert score.value == pytest.approx(bf16[task].value, rel=0.01, abs=0.01), (task, score.value, bf16[task].value)
    low, high = result.median_recovery_ci
    assert low <= result.median_recovery <= high and result.agree is not None


@pytest.mark.slow
def test_demo_export_gets_the_config_level_check(pipeline_run):
    """NemotronH's MoE does not run on vLLM's CPU build: the check falls back to vLLM's config-level
    acceptance, says so, and the printed command is what vLLM runs."""
    summary, layout, _, _ = pipeline_run
    check = summary["export"]["checks"]["serving"]
    assert check["passed"] and check["level"] == "config", check["summary"]
    assert check["quantization"] == "modelopt_mixed" and not check["config_problems"]
    assert check["layers_checked"] > 0 and check["why_not_full"]
    command = summary["export"]["serving"]["vllm"]
    ran = serving.check_serve_command(command)
    assert f"--quantization {ran['quantization']}" in command


@pytest.mark.slow
def test_tied_embeddings_stay_tied_through_ptq_export_and_serving(real_export):
    """SmolLM2's lm_head is its input embedding (`tie_word_embeddings`): the lm_head stays the
    BF16 embedding, PTQ -> export -> reload agree on formats and size, and vLLM serves it."""
    export, layout, ptq = real_export
    assert ptq["layer_formats"]["model.embed_tokens.weight"] == "bf16"
    assert "lm_head.weight" not in ptq["layer_formats"]  # one tensor: the tied embedding
    assert ptq["layer_formats"]["model.layers.0.mlp.up_proj.weight"] == "nvfp4"
    assert "lm_head" not in ptq["weight_error"]["layers"]
    assert export["passed"], export["checks"]
    assert export["checks"]["size"]["passed"] and export["checks"]["reload"]["passed"]
    assert export["checks"]["serving"]["level"] == "full" and export["checks"]["serving"]["passed"]
    assert AutoConfig.from_pretrained(layout.export).tie_word_embeddings
    tensors = read_tensors(layout.export)  # one tied tensor, in BF16: what vLLM ties back on load
    assert tensors["model.embed_tokens.weight"].dtype == torch.bfloat16 and "lm_head.weight" not in tensors
    assert tensors["model.layers.0.mlp.up_proj.weight"].dtype == torch.uint8  # packed NVFP4


def test_compare_is_the_exact_kl_over_the_whole_vocabulary_and_a_lower_bound_below_it():
    gen = torch.Generator().manual_seed(0)
    student = torch.log_softmax(3 * torch.randn(2, 5, 50, generator=gen), -1)
    served = torch.log_softmax(student + 0.3 * torch.randn(2, 5, 50, generator=gen), -1)
    exact = (served.exp() * (served - student)).sum(-1).mean().item()

    def top(lp, k):
        v = lp.topk(k, -1)
        return v.indices.numpy(), v.values.numpy()

    def vllm_side(k):
        ids, lps = top(served, k)
        return [[[ids[p, t].tolist(), lps[p, t].tolist()] for t in range(5)] for p in range(2)]

    def reference(k):
        ids, lps = top(student, k)
        return {"ids": ids, "logprobs": lps}

    whole = serving_verdict.compare(vllm_side(50), reference(50))
    assert whole["kl_divergence"] == pytest.approx(exact, rel=1e-4)  # float32 log-probs
    truncated = serving_verdict.compare(vllm_side(8), reference(8))
    assert 0 <= truncated["kl_divergence"] <= exact + 1e-12
    same = serving_verdict.compare(vllm_side(50), {"ids": top(served, 50)[0], "logprobs": top(served, 50)[1]})
    assert same["kl_divergence"] == pytest.approx(0, abs=1e-9) and same["top1_agreement"] == 1.0


def test_missing_vllm_environment_is_one_line_naming_the_fix(tmp_path, monkeypatch):
    monkeypatch.setenv("QAD_VLLM_ENV", str(tmp_path / "nowhere"))
    with pytest.raises(Exception, match="qad-pipeline setup-vllm"):
        vllm_setup.vllm_python()


@pytest.mark.slow
def test_reference_file_is_not_a_weight_file_a_server_would_load(real_export):
    _, layout, _ = real_export
    with np.load(layout.export / serving.REFERENCE_FILE) as ref:
        assert ref["prompts"].shape == (serving_reference.PROMPTS, serving_reference.PROMPT_LEN)
        for view in serving_reference.VIEWS:  # NVFP4 activations are quantized: both views
            assert ref[f"{view}_logprobs"].shape == (serving_reference.PROMPTS, serving_reference.PROMPT_LEN - 1,
                                                     serving_reference.TOP_K)
            assert 0 <= float(ref[f"{view}_noise"]) < float(ref[f"{view}_own_kl"])
        assert ref[f"{serving_reference.UNQUANTIZED}_logprobs"].shape == ref["w4a16_logprobs"].shape
    assert not list(layout.export.glob("serving_reference*.safetensors"))


def test_vllm_environment_is_found_beside_the_running_python(tmp_path, monkeypatch):
    """A copy of the code (the DVC test project holds one) still finds the checkout's environment."""
    from pathlib import Path

    monkeypatch.delenv("QAD_VLLM_ENV", raising=False)
    monkeypatch.setattr(serving, "PROJECT_ROOT", tmp_path / "copy")
    assert vllm_setup.vllm_env() == Path(sys.prefix).parent / ".venv-vllm"
    assert vllm_setup.vllm_python().is_file()
