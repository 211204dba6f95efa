"""The served evaluation: `qad-pipeline stage served_eval` (with `eval.backend: vllm`).

After the export's checks, scores what will be served: the exported checkpoint and the BF16 base
model, both through lm-eval's `vllm` model in the project's vLLM environment
(`qad_pipeline.scoring.served_scores.vllm_evaluate`), on the same tasks, settings and perplexity windows as
every other evaluation. The served recovery is the export's score over the served BF16 score, with
the same paired bootstrap interval (`recovery.score_recovery`); next to it, the recovery the
pipeline measured in memory (transformers, fake quantization: the final eval's for a QAD student,
the PTQ stage's for an exported recipe), and whether the two intervals overlap.

Where vLLM cannot run the export on this machine (its serving check ran at the `config` level:
the demo's NemotronH MoE on vLLM's CPU build), the stage writes why and the run's recovery stays
the in-memory one. Writes `metrics/served.json` (`ServedEval`) and each model's per-item values
under `artifacts/served_eval/`.
"""

from __future__ import annotations

import time
from pathlib import Path

from qad_pipeline.core.artifacts import write_json
from qad_pipeline.core.config import Params
from qad_pipeline.core.layout import Layout
from qad_pipeline.scoring.recovery import score_recovery
from qad_pipeline.results.base import read_result, write_result
from qad_pipeline.results.export_metrics import ExportMetrics
from qad_pipeline.results.qad_metrics import QADMetrics
from qad_pipeline.results.selection_metrics import RecipeMetrics
from qad_pipeline.results.served import InMemory, ServedEval


def in_memory(layout: Layout, source: str) -> InMemory | None:
    """The recovery measured in memory of what the export holds: the final eval's (QAD), the PTQ stage's."""
    if source == "qad":
        stage, m = "final_eval", read_result(layout.qad_metrics, QADMetrics, missing_ok=True)
    else:
        stage = source
        m = read_result(layout.ptq_metrics(source.removeprefix("ptq/")), RecipeMetrics, missing_ok=True)
    if m is None:
        return None
    return InMemory(stage=stage, median_recovery=m.median_recovery, median_recovery_ci=m.median_recovery_ci,
                    tasks={t: s.recovery for t, s in m.tasks.items()},
                    tasks_ci={t: s.recovery_ci for t, s in m.tasks.items()})


def overlap(a, b) -> bool | None:
    return None if a is None or b is None else max(a[0], b[0]) <= min(a[1], b[1])


def comparison(served: dict, memory: InMemory | None) -> list[dict]:
    """Per task and for the median: the in-memory and the served recovery, their intervals, and
    whether the intervals overlap."""
    rows = []
    for task, score in served["tasks"].items():
        mem_ci = memory.tasks_ci.get(task) if memory else None
        rows.append({"task": task, "in_memory_recovery": memory.tasks.get(task) if memory else None,
                     "in_memory_recovery_ci": mem_ci, "served_recovery": score.get("recovery"),
                     "served_recovery_ci": score.get("recovery_ci"),
                     "intervals_overlap": overlap(mem_ci, score.get("recovery_ci"))})
    mem_ci = memory.median_recovery_ci if memory else None
    rows.append({"task": "median", "in_memory_recovery": memory.median_recovery if memory else None,
                 "in_memory_recovery_ci": mem_ci, "served_recovery": served["median_recovery"],
                 "served_recovery_ci": served["median_recovery_ci"],
                 "intervals_overlap": overlap(mem_ci, served["median_recovery_ci"])})
    return rows


def run_served_eval(params: Params, layout: Layout, log=print) -> ServedEval:
    """Stage core: score the export and the BF16 base model through vLLM; write metrics/served.json."""
    from qad_pipeline.core.modeling import model_location
    from qad_pipeline.scoring.served_scores import served_backend_limit, vllm_evaluate

    started = time.perf_counter()
    export = read_result(layout.export_metrics, ExportMetrics)
    why = served_backend_limit(export)
    if why:
        result = ServedEval(backend="vllm", ran=False, why_not=why, export=export.path, source=export.source,
                            in_memory=in_memory(layout, export.source))
        write_result(layout.served_metrics, result)
        return result
    bf16 = vllm_evaluate(Path(model_location(params.base_model)), params.eval, layout.data, log=log)
    served = vllm_evaluate(layout.export, params.eval, layout.data, log=log)
    write_json(layout.served_eval / "bf16_items.json", bf16["items"])
    write_json(layout.served_eval / "export_items.json", served["items"])
    scored = score_recovery({"tasks": served["tasks"]}, served["items"], {"tasks": bf16["tasks"]}, bf16["items"])
    memory = in_memory(layout, export.source)
    table = comparison(scored, memory)
    result = ServedEval(
        backend="vllm", ran=True, export=export.path, source=export.source, baseline_tasks=bf16["tasks"],
        tasks=scored["tasks"], median_recovery=scored["median_recovery"],
        median_recovery_ci=scored["median_recovery_ci"], recovery_interval=scored["recovery_interval"],
        in_memory=memory, agree=table[-1]["intervals_overlap"],  # the median's row
        table=table, served={"bf16": bf16["served"], "export": served["served"]},
        seconds=round(time.perf_counter() - started, 1))
    write_result(layout.served_metrics, result)
    return result


def main(params: Params, layout: Layout, recipe: str | None = None) -> str:
    """The served evaluation: `qad-pipeline stage served_eval`."""
    r = run_served_eval(params, layout)
    if not r.ran:
        return f"served eval: not run, recovery stays the in-memory one: {r.why_not}"
    mem = (f"; in memory ({r.in_memory.stage}) {100 * r.in_memory.median_recovery:.2f} %, intervals "
           + ("overlap" if r.agree else "do NOT overlap")) if r.in_memory else ""
    return (f"served eval (vLLM, the exported checkpoint): median recovery {100 * r.median_recovery:.2f} % "
            f"[{100 * r.median_recovery_ci[0]:.2f}-{100 * r.median_recovery_ci[1]:.2f}]{mem}")
