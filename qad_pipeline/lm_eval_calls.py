"""lm-eval's `simple_evaluate` calls, run the same way on either side of the project.

`qad_pipeline.evaluation` builds the calls (JSON: task configs or registry names, lm-eval's own
settings, the item ids racing asks for) and runs them here with lm-eval's `hf` model on a model in
memory; `serving/vllm_eval.py` runs the very same calls with lm-eval's `vllm` model in the vLLM
environment. That environment pins another transformers than the project, so it cannot import the
project: it loads this file by its path, and this file imports only lm-eval and the standard library.
"""

from __future__ import annotations

# what a logged sample holds besides its per-item metric values; dropped before the results travel
SAMPLE_BULK = ("doc", "arguments", "resps", "filtered_resps", "target", "doc_hash", "prompt_hash", "target_hash")


def run_calls(lm, calls: list[dict]) -> dict:
    """Each call's `simple_evaluate` on `lm`, merged: {"results", "higher_is_better", "samples"},
    each keyed by task; a sample keeps its doc id, filter and metric values."""
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    # lm-eval's registry is indexed (~9 s, ~15,000 YAML files) only for a task of its own: the
    # project's tasks come as whole configs
    registry = TaskManager(include_defaults=any(isinstance(t, str) for call in calls for t in call["tasks"]))
    out: dict[str, dict] = {"results": {}, "higher_is_better": {}, "samples": {}}
    for call in calls:
        run = simple_evaluate(model=lm, task_manager=registry, log_samples=True, bootstrap_iters=0,
                              verbosity="WARNING", **call)
        out["results"].update(run.get("results") or {})
        out["higher_is_better"].update(run.get("higher_is_better") or {})
        for task, samples in (run.get("samples") or {}).items():
            out["samples"][task] = [{k: v for k, v in s.items() if k not in SAMPLE_BULK} for s in samples]
    return out
