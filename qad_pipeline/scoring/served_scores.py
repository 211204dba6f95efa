"""Scoring a checkpoint as vLLM serves it (`eval.backend: vllm`; the `served_eval` stage).

`vllm_evaluate` runs the project's lm-eval calls (`evaluation.eval_calls`: the same tasks, few-shot,
chat template, generation settings, metric and filter as every other evaluation) through lm-eval's
`vllm` model, in the pinned vLLM environment (`serving/vllm_eval.py`; `qad-pipeline setup-vllm`
installs lm-eval there at the project's version), and the held-out perplexity windows through
vLLM's prompt log-probs. Its result has `evaluate_model`'s shape, without KL: the BF16 reference's
estimator needs the model's log-probs at the reference's own top-k and tail tokens, which vLLM's
prompt log-probs (its own top-K) do not give.

`served_backend_limit` says where vLLM cannot serve the run's export on this machine (the serving
check ran at its `config` level: NemotronH's MoE on vLLM's CPU build), so the stage says so and the
run's recovery stays the in-memory one.
"""

from __future__ import annotations

import math
from pathlib import Path

from qad_pipeline.core.calibration_data import load_ppl_windows
from qad_pipeline.core.config import PROJECT_ROOT, EvalParams
from qad_pipeline.scoring.evaluation import eval_calls, perplexity_task, pop_items, read_scores

EVAL_SCRIPT = PROJECT_ROOT / "serving" / "vllm_eval.py"


class ServedEvalFailed(RuntimeError):
    pass


def vllm_evaluate(folder: Path, params: EvalParams, data_dir: Path, env: Path | None = None,
                  timeout: int = 7200, log=print) -> dict:
    """Scores of the checkpoint in `folder` served by vLLM: {"tasks", "items", "served"} (`served`:
    vLLM's version, the quantization and KV-cache dtype it ran, and the KV-cache fallback, if any)."""
    from qad_pipeline.checks.vllm_setup import run_vllm_script

    windows = load_ppl_windows(data_dir)
    calls, metric_orders = eval_calls(params, Path(data_dir) / "eval")
    log(f"vLLM scores {folder} ({len(params.tasks)} task(s), {len(windows)} perplexity windows)")
    request = {"calls": calls, "windows": windows.tolist(), "batch_size": params.batch_size, "max_model_len": None}
    side = run_vllm_script(EVAL_SCRIPT, folder, request, f"vLLM could not score {folder}", ServedEvalFailed, env,
                           timeout)
    tasks = read_scores(params, side.pop("lm_eval"), metric_orders)
    nll = side.pop("window_nll")
    positions = windows.shape[1] - 1
    tasks["perplexity"] = perplexity_task(math.exp(sum(nll) / (len(nll) * positions)), nll, list(range(len(nll))),
                                          positions)
    items = pop_items(tasks)
    return {"tasks": tasks, "items": items, "served": side}


def served_backend_limit(export_metrics) -> str | None:
    """Why the export cannot be scored through vLLM here (None: it can): its serving check did not
    run vLLM on the weights."""
    check = export_metrics.serving_check
    if check.level == "full":
        return None
    if check.level == "skipped":
        return "the export's serving check was skipped (export.serving_check: skip): vLLM never loaded it"
    return f"vLLM cannot run this checkpoint here, only accept its config: {check.summary}"
