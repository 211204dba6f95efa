"""The memory plan as `qad-pipeline plan` prints it: the table of stages (`table`), the run's time
along the DAG (`run_seconds`) and what the plan chose for the settings left at `auto` (`settled_line`)."""

from __future__ import annotations

from qad_pipeline.core.config import Params
from qad_pipeline.core.stages import STAGES
from qad_pipeline.plan import costs, eval_costs, gpus
from qad_pipeline.plan.capacity import HEADROOM, Capacity
from qad_pipeline.plan.memory import StageEstimate, settled_overrides
from qad_pipeline.plan.memory_model import GiB, MiB
from qad_pipeline.reporting.report import aligned


def settled_line(params: Params, chosen: Params) -> str | None:
    """What the plan chose for the keys `params` leaves at `auto`, as the plan prints it (None: none)."""
    picks = settled_overrides(params, chosen)
    if not picks:
        return None
    q = chosen.qad
    step = f" ({q.batch_size} x {q.grad_accum} = {q.batch_size * q.grad_accum} rows a step)" if params.qad.batch_size == "auto" else ""
    return f"chosen for auto: {', '.join(picks)}{step}"


def run_seconds(estimates: list[StageEstimate]) -> float | None:
    """The run's estimated wall time: the longest path through the stages' `after` edges, a
    per-item stage taking its items in waves of `max_parallel` (None: no time estimate)."""
    if any(e.seconds is None for e in estimates):
        return None
    took: dict[str, list[float]] = {}
    for e in estimates:
        took.setdefault(e.stage.split("/")[0], []).append(e.seconds)
    at_once = {e.stage.split("/")[0]: e.max_parallel for e in estimates}
    done: dict[str, float] = {}
    for name, times in took.items():  # in the registry's order: every stage after the ones it waits for
        waves = -(-len(times) // max(1, at_once[name])) if STAGES[name].per_recipe else 1
        done[name] = max((done.get(a, 0.0) for a in STAGES[name].after), default=0.0) + waves * max(times)
    return max(done.values())


def time_text(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.0f} min" if seconds < 7200 else f"{seconds / 3600:.1f} h"


def table(estimates: list[StageEstimate], cap: Capacity, params: Params | None = None) -> str:
    """The plan as a text table, then what the machine (or target) offers and the time (the disk in
    all: `disk_plan`)."""
    mib = lambda b: f"{b / MiB:,.0f}" if b else "-"  # noqa: E731
    gib = lambda b: f"{b / GiB:,.1f}" if b else "-"  # noqa: E731
    rows = [("stage", "peak phase", "host MiB", "GPU MiB", "GPUs", "at once", "disk GiB", "time", "fits")]
    rows += [(e.stage, e.phase, mib(e.host_bytes), mib(e.device_bytes), gpus.shown(e.gpus), str(e.max_parallel),
              gib(e.disk_bytes), time_text(e.seconds), "yes" if e.fits else "NO") for e in estimates]
    lines = aligned(list(rows[0]), [list(r) for r in rows[1:]], right=frozenset(range(2, len(rows[0]))), rule=False)
    seen = ", ".join(f"{g / GiB:.1f} GiB" for g in cap.gpu_bytes) or "none seen"
    where = f"target {cap.target}" if cap.target else f"{HEADROOM:.0%} of what is free"
    lines.append(f"usable ({where}): host {cap.host_bytes / GiB:.1f} GiB; GPUs: {seen}; the stages run on {cap.device}")
    total = run_seconds(estimates)
    left_out = eval_costs.uncounted_tasks(params) if params is not None else []
    if total is not None:
        qad_mfu, source = costs.train_mfu(costs.target_gpu(cap.target))
        lines.append(f"time: ~{time_text(total)} along the DAG (MFU {costs.EVAL_MFU:.0%} forward, assumed; "
                     f"{qad_mfu:.0%} QAD, {source}; see qad_pipeline/plan/costs.py)"
                     + (f"; not counted: lm-eval tasks {', '.join(left_out)}" if left_out else ""))
    lines += costs.eval_lines(estimates, params, cap.bf16_flops) if params is not None else []
    return "\n".join(lines)
