"""The standard suite's evaluation cost, as docs/memory-plan.md's tables: `python scripts/eval_costs_table.py`.

The plan (`qad-pipeline plan --params profiles/llama-3.1-8b_8xh100.yaml`, for its hardware.target
8xH100-80GB) of that profile, racing off and on (`race.enabled`, fractions [0.25, 0.5, 1.0]): per
task, then per stage its requests, tokens and GPU-hours of evaluation. Tokens of lm-eval's tasks and
every GPU-hour are the plan's estimates (qad_pipeline/plan/eval_costs.py, qad_pipeline/plan/costs.py: an
assumed MFU), not measurements. `tests/test_eval_costs.py` checks that docs/memory-plan.md has this output.
"""

from __future__ import annotations

from qad_pipeline.plan import capacity, costs, memory
from qad_pipeline.core.config import PROJECT_ROOT, load_params
from qad_pipeline.plan.eval_costs import STANDARD, EvalCost, count_text, stage_cost, task_sizes
from qad_pipeline.plan.memory_model import model_shape

PROFILE = PROJECT_ROOT / "profiles" / "llama-3.1-8b_8xh100.yaml"


def _markdown(head: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)] + ["| " + " | ".join(r) + " |" for r in rows]


def task_table() -> list[str]:
    params = load_params(PROFILE)
    rows = []
    for size in task_sizes(params)[0]:
        known, n = STANDARD[size.task], sum(size.items.values())
        shots = params.eval.settings(size.task).num_fewshot
        rows.append([size.task, known.split, f"{n:,}", str(known.choices), str(known.fewshot if shots is None else shots),
                     f"{size.requests:,}", count_text(size.tokens), "yes" if size.raced else "no"])
    return _markdown(["task", "split", "items", "requests per item", "few-shot", "requests", "tokens (est.)", "raced"],
                     rows)


def _stages(race: bool) -> dict[str, list[tuple[EvalCost, float]]]:
    """Per evaluating stage: (what it evaluates, GPU-hours) of each of its processes; the race's
    worst case under `race`, its best case under `race_best`."""
    params = load_params(PROFILE, [f"race.enabled={str(race).lower()}"])
    cap = capacity.target_capacity(params.hardware.target)
    shape, out = model_shape(params.base_model), {}

    def hours(cost: EvalCost, gpus: tuple) -> float:
        return costs.eval_seconds(cost, shape, cap.bf16_flops) * max(1, len(gpus)) / 3600

    for est in memory.plan(params, cap):
        cost = stage_cost(est.stage, params)
        if cost is not None:
            out.setdefault(est.stage.split("/")[0], []).append((cost, hours(cost, est.gpus)))
            if cost.best is not None:
                out["race_best"] = [(cost.best, hours(cost.best, est.gpus))]
    return out


def _cells(runs: list[tuple[EvalCost, float]]) -> list[str]:
    total = sum((c for c, _ in runs), EvalCost())
    return [f"{total.requests:,}", count_text(total.tokens), count_text(total.window_tokens),
            f"{sum(h for _, h in runs):.2f}"]


def stage_table() -> list[str]:
    full, raced = _stages(False), _stages(True)
    rows = []
    for name in ["baseline", "ptq", "race", "final_eval", "served_eval"]:
        label = {"ptq": f"ptq ({len(full['ptq'])} recipes)", "race": "race: worst case / best case",
                 "served_eval": "served_eval (BF16 + export, vLLM)"}.get(name, name)
        both = zip(_cells(raced["race"]), _cells(raced["race_best"])) if name == "race" else None
        rows.append([label, *(_cells(full[name]) if name in full else ["-"] * 4),
                     *([f"{a} / {b}" for a, b in both] if both else _cells(raced[name]))])
    worst = [run for name, runs in raced.items() if name != "race_best" for run in runs]
    best = [run for name, runs in raced.items() if name != "race" for run in runs]
    rows.append(["total", *_cells([run for runs in full.values() for run in runs]),
                 *[f"{a} / {b}" for a, b in zip(_cells(worst), _cells(best))]])
    head = ["stage", "requests", "tokens", "window tokens", "GPU-h", "racing: requests", "tokens", "window tokens", "GPU-h"]
    return _markdown(head, rows)


if __name__ == "__main__":
    print("\n".join(task_table()))
    print()
    print("\n".join(stage_table()))
