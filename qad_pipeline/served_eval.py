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

import json
import math
import subprocess
import tempfile
from pathlib import Path

from qad_pipeline.calibration_data import load_ppl_windows
from qad_pipeline.config import PROJECT_ROOT, EvalParams
from qad_pipeline.evaluation import eval_calls, read_scores

EVAL_SCRIPT = PROJECT_ROOT / "serving" / "vllm_eval.py"


class ServedEvalFailed(RuntimeError):
    pass


def vllm_evaluate(folder: Path, params: EvalParams, data_dir: Path, env: Path | None = None,
                  timeout: int = 7200, log=print) -> dict:
    """Scores of the checkpoint in `folder` served by vLLM: {"tasks", "items", "served"} (`served`:
    vLLM's version, the quantization and KV-cache dtype it ran, and the KV-cache fallback, if any)."""
    from qad_pipeline.serving import vllm_process_env, vllm_python

    windows = load_ppl_windows(data_dir)
    calls, metric_orders = eval_calls(params, Path(data_dir) / "eval")
    python = vllm_python(env)
    with tempfile.TemporaryDirectory(prefix="qad-served-eval-") as tmp:
        request, out = Path(tmp) / "request.json", Path(tmp) / "out.json"
        request.write_text(json.dumps({"calls": calls, "windows": windows.tolist(), "batch_size": params.batch_size,
                                       "max_model_len": None}))
        log(f"vLLM scores {folder} ({len(params.tasks)} task(s), {len(windows)} perplexity windows)")
        proc = subprocess.run([str(python), str(EVAL_SCRIPT), str(folder), str(request), str(out)],
                              capture_output=True, text=True, env=vllm_process_env(), timeout=timeout)
        if proc.returncode != 0 or not out.is_file():
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-12:]
            raise ServedEvalFailed(f"vLLM could not score {folder} (exit {proc.returncode}): " + " | ".join(tail))
        side = json.loads(out.read_text())
    tasks = read_scores(params, side.pop("lm_eval"), metric_orders)
    nll = side.pop("window_nll")
    positions = windows.shape[1] - 1
    tasks["perplexity"] = {"metric": "perplexity", "value": math.exp(sum(nll) / (len(nll) * positions)),
                           "higher_is_better": False,
                           "items": {"aggregation": "perplexity", "ids": list(range(len(nll))),
                                     "values": [-n / positions for n in nll]}}
    items = {task: score.pop("items") for task, score in tasks.items() if score.get("items")}
    for score in tasks.values():
        score.pop("items", None)
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
