"""lm-eval's `simple_evaluate` calls, run the same way on either side of the project.

`qad_pipeline.scoring.evaluation` builds the calls (JSON: task configs or registry names, lm-eval's own
settings, the item ids racing asks for) and runs them here with lm-eval's `hf` model on a model in
memory; `serving/vllm_eval.py` runs the very same calls with lm-eval's `vllm` model in the vLLM
environment. That environment pins another transformers than the project, so it cannot import the
project: it loads this file by its path, and this file imports only lm-eval and the standard library.
"""

from __future__ import annotations

# what a logged sample holds besides its per-item metric values; dropped before the results travel
SAMPLE_BULK = ("doc", "arguments", "resps", "filtered_resps", "target", "doc_hash", "prompt_hash", "target_hash")


def run_calls(lm, calls: list[dict], task_manager=None) -> dict:
    """Each call's `simple_evaluate` on `lm`, merged: {"results", "higher_is_better", "samples",
    "group_subtasks"}, each keyed by task (or group); a sample keeps its doc id, filter and metric
    values. A call's `include_path` (a folder of the project's group and task YAMLs) is indexed with
    the registry; `task_manager`, when given, is the registry already built for these calls."""
    from lm_eval import simple_evaluate

    registry = task_manager or registry_for(calls)
    out: dict[str, dict] = {"results": {}, "higher_is_better": {}, "samples": {}, "group_subtasks": {}}
    for call in calls:
        args = {k: v for k, v in call.items() if k != "include_path"}
        run = simple_evaluate(model=lm, task_manager=registry, log_samples=True, bootstrap_iters=0,
                              verbosity="WARNING", **args)
        out["results"].update(run.get("results") or {})
        out["higher_is_better"].update(run.get("higher_is_better") or {})
        out["group_subtasks"].update(run.get("group_subtasks") or {})
        for task, samples in (run.get("samples") or {}).items():
            out["samples"][task] = [{k: v for k, v in s.items() if k not in SAMPLE_BULK} for s in samples]
    return out


def registry_for(calls: list[dict]):
    """lm-eval's TaskManager for `calls`. Its own registry is indexed (~9 s, ~15,000 YAML files) only
    for a name the calls' `include_path` folders do not define: the project's tasks come as whole configs."""
    from lm_eval.tasks import TaskManager

    include = sorted({call["include_path"] for call in calls if call.get("include_path")}) or None
    names = set()
    for call in calls:
        for task in call["tasks"]:
            if isinstance(task, str):
                names.add(task)
            elif "group" in task:  # a raced group: its members by name
                names.update(m for m in task["task"] if isinstance(m, str))
    registry = TaskManager(include_path=include, include_defaults=False)
    if names - set(registry.all_tasks):
        registry = TaskManager(include_path=include, include_defaults=True)
    return registry
