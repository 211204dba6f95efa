"""The recipe table and the run's report, read back from the metrics files, as Markdown and text.

`recipe_rows` is the table a user compares recipes on: per-task recovery in %, the median with its
interval, bits per element, KL, median weight error, and a `choice` column that marks the selected
recipe (and names the recipe an alias row is the same as). The Prefect table artifact, the
Markdown report (Prefect) and the run description (MLflow) are all made from it.

Markdown here is GitHub-flavoured: every table has a blank line before and after it, cells hold
one line with `|` escaped, and failures are listed below a table, never inside it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from qad_pipeline.core.layout import Layout
from qad_pipeline.results.base import read_result
from qad_pipeline.results.export_metrics import ExportMetrics
from qad_pipeline.results.qad_metrics import QADMetrics
from qad_pipeline.results.run import RunSummary
from qad_pipeline.results.scores import BaselineMetrics
from qad_pipeline.results.selection_metrics import (
    RecipeFailed,
    RecipeMetrics,
    RecipeResult,
    RecipeRow,
    SelectionResult,
)
from qad_pipeline.results.served import ServedEval
from qad_pipeline.results.sweep_metrics import BPESweep

SELECTED_MARK = "★ selected"
MAX_ERROR_CHARS = 300


def _pct(x: Any, digits: int = 2) -> float | None:
    return None if not isinstance(x, (int, float)) else round(100 * x, digits)


def _interval(ci: Any) -> str:
    """[0.971, 0.990] -> "97.10–99.00"; "" when there is none."""
    if not (isinstance(ci, (list, tuple)) and len(ci) == 2 and all(isinstance(v, (int, float)) for v in ci)):
        return ""
    return f"{100 * ci[0]:.2f}–{100 * ci[1]:.2f}"


def _round(x: Any, digits: int) -> float | None:
    return None if not isinstance(x, (int, float)) else round(float(x), digits)


def _columns_of(tasks: list[str], recovery: Mapping[str, float | None], median: float | None, ci: Any,
                bpe: float | None, kl: float | None, weight: float | None, kv: str | None,
                size: int | None) -> dict:
    return {
        **{f"{t} rec. %": _pct(recovery.get(t)) for t in tasks},
        "median rec. %": _pct(median),
        "CI %": _interval(ci),
        "bits/elem": _round(bpe, 3),
        "KL": _round(kl, 4),
        "weight err.": _round(weight, 4),
        "KV cache": kv or "",
        "size MB": None if not isinstance(size, (int, float)) else round(size / 1e6, 3),
    }


def _measured(m: RecipeMetrics | None, tasks: list[str]) -> dict:
    """A recipe's columns; every value None without metrics (a failed recipe)."""
    if m is None:
        return _columns_of(tasks, {}, None, None, None, None, None, None, None)
    return _columns_of(tasks, {t: s.recovery for t, s in m.tasks.items()}, m.median_recovery, m.median_recovery_ci,
                       m.effective_bpe, m.kl_divergence, m.weight_error.median, m.kv_cache, m.size_bytes)


def _error(m: RecipeResult | None, row: RecipeRow | None) -> str:
    own = "no metrics" if m is None else m.error if isinstance(m, RecipeFailed) else None
    return own or (row.error if row is not None else None) or "failed (no error recorded)"


def recipe_rows(layout: Layout, recipes: list[str]) -> list[dict]:
    """One row for BF16 and one per recipe, in the configured order (see the module docstring).

    Every row has the same columns; a value that is not there is None. A failed recipe's error is
    under `error`, which the tables leave out and list below them.
    """
    baseline = read_result(layout.baseline_metrics, BaselineMetrics)
    tasks = list(baseline.tasks)
    selection = read_result(layout.selection_metrics, SelectionResult, missing_ok=True)
    selected = selection.selected if selection is not None else None
    table = {r.name: r for r in selection.table} if selection is not None else {}
    bf16 = _columns_of(tasks, dict.fromkeys(tasks, 1.0), 1.0, None, baseline.effective_bpe, 0.0, None, "bf16",
                       baseline.size_bytes)
    rows = [{"choice": "", "name": "bf16", "status": "ok", **bf16}]
    for name in recipes:
        m = read_result(layout.ptq_metrics(name), RecipeResult, missing_ok=True)
        sel = table.get(name)
        alias_of = sel.alias_of if sel is not None and sel.status == "alias" else None
        if alias_of and (m is None or m.status != "ok"):  # the figures of the recipe it is the same as
            m = read_result(layout.ptq_metrics(alias_of), RecipeResult, missing_ok=True)
        status = "alias" if alias_of else ("ok" if m is not None and m.status == "ok" else "failed")
        choice = SELECTED_MARK if name == selected else f"alias of {alias_of}" if alias_of else ""
        row = {"choice": choice, "name": name, "status": status}
        if status == "failed":
            row.update(_measured(None, tasks))
            row["error"] = _one_line(_error(m, sel))[:MAX_ERROR_CHARS]
        else:
            row.update(_measured(m if isinstance(m, RecipeMetrics) else None, tasks))
        rows.append(row)
    return rows


def weight_error_rows(layout: Layout, recipes: list[str]) -> list[dict]:
    """Per recipe that recorded it: median relative weight error over layers and its worst layers."""
    rows = []
    for name in recipes:
        m = read_result(layout.ptq_metrics(name), RecipeResult, missing_ok=True)
        if not isinstance(m, RecipeMetrics) or m.weight_error.median is None:
            continue
        weight = m.weight_error
        worst = ", ".join(f"{w.layer} ({w.error:.4f})" for w in weight.worst)
        rows.append({"name": name, "median rel. error": round(weight.median, 4),
                     "layers": len(weight.layers), "worst layers": worst})
    return rows


def read_summary(layout: Layout, params, **run: Any) -> RunSummary:
    """The run summary, the input of every report (console, Prefect, MLflow's report.md and run
    description, `qad-pipeline log-mlflow`): the selection, the recipe rows (the sweep's points
    among the candidates too), weight error, the BPE sweep when this run swept
    (`stages.with_sweep`), QAD and the export, read from the files; `run` adds what only the flow
    knows (`failed`, `cached`, `baseline_cached`, `seconds`); a stage that declares a report section
    (`Stage.report`) adds it, read from its result."""
    from qad_pipeline.core.stages import STAGES, with_sweep

    selection = read_result(layout.selection_metrics, SelectionResult)
    names = [*params.ptq.recipes, *(r.name for r in selection.table if r.name not in params.ptq.recipes)]
    return RunSummary(selection=selection, recipes=recipe_rows(layout, names),
                      weight_error=weight_error_rows(layout, names),
                      sweep=read_result(layout.bpe_sweep_metrics, BPESweep, missing_ok=True) if with_sweep(params)
                      else None,
                      qad=read_result(layout.qad_metrics, QADMetrics, missing_ok=True),
                      export=read_result(layout.export_metrics, ExportMetrics, missing_ok=True),
                      served=read_result(layout.served_metrics, ServedEval, missing_ok=True),
                      sections={s.name: s.load("report")(read_result(layout.root / s.result, s.load("schema")), params)
                                for s in STAGES.values() if s.report and s.runs(params)
                                and (layout.root / s.result).is_file()},
                      root=str(layout.root), **run)


# -- tables --------------------------------------------------------------------------------------


def _one_line(text: Any) -> str:
    return " ".join(str(text).split())


def _columns(rows: list[dict]) -> list[str]:
    cols: list[str] = []
    for r in rows:
        cols += [k for k in r if k not in cols and k != "error"]
    return cols


def _fmt(value) -> str:
    if value is None:
        return "–"
    return format(value, ".6g") if isinstance(value, float) else str(value)


def _cell(value) -> str:
    return _one_line(_fmt(value)).replace("|", r"\|")


def markdown_table(rows: list[dict]) -> list[str]:
    """A GitHub-flavoured Markdown table, with a blank line before and after it."""
    if not rows:
        return []
    cols = _columns(rows)
    lines = ["| " + " | ".join(_cell(c) for c in cols) + " |", "|" + "---|" * len(cols)]
    return ["", *lines, *("| " + " | ".join(_cell(r.get(c)) for c in cols) + " |" for r in rows), ""]


def aligned(header: list[str], cells: list[list[str]], right: frozenset[int] = frozenset(),
            rule: bool = True) -> list[str]:
    """The project's one text table: columns two spaces apart, left-aligned but those in `right`,
    a rule of dashes under the header unless `rule` is off."""
    widths = [max(len(h), *(len(row[i]) for row in cells)) for i, h in enumerate(header)]

    def line(row: list[str]) -> str:
        return "  ".join(c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths)))

    return [line(header), *([line(["-" * w for w in widths])] if rule else []), *(line(r) for r in cells)]


def text_table(rows: list[dict]) -> list[str]:
    if not rows:
        return []
    cols = _columns(rows)
    return aligned(cols, [[_one_line(_fmt(r.get(c))) for c in cols] for r in rows])


# -- the report ------------------------------------------------------------------------------------


def _qad_rows(q: QADMetrics) -> list[dict]:
    out = []
    for r in q.table:
        row = {"name": r.get("name")}
        row.update({f"{k[:-len('_recovery')]} rec. %": _pct(v) for k, v in r.items()
                    if k.endswith("_recovery") and k != "median_recovery"})
        row["median rec. %"] = _pct(r.get("median_recovery"))
        row["KL"] = _round(r.get("kl_divergence"), 4)
        out.append(row)
    return out


def _failures(rows: list[dict]) -> list[str]:
    failed = [f"- {r['name']} FAILED: {r['error'][:MAX_ERROR_CHARS]}" for r in rows if r.get("error")]
    return ["Failed recipes:", "", *failed, ""] if failed else []


def _summary(summary: RunSummary | Mapping[str, Any]) -> RunSummary:
    """The run summary as a model: the flow's result and `qad-pipeline log-mlflow`'s are dicts."""
    return summary if isinstance(summary, RunSummary) else RunSummary.model_validate(summary)


def _sections(summary: RunSummary, table, heading) -> list[str]:
    sel = summary.selection
    out = [*heading("Recipes (PTQ)"), *table(summary.recipes), *_failures(summary.recipes)]
    if summary.recipes:
        out += [(f"{SELECTED_MARK}: the chosen recipe; recovery: quantized vs BF16 score, "
                 "median over tasks (CI: its interval)."), ""]
    out += [*heading("Selection"),
            (f"Selected: {sel.selected or 'none'} ({sel.policy} policy, band {_interval(sel.band)} %). "
             f"{_one_line(sel.reason)}"), ""]
    if sel.runner_up:
        out += [f"Runner-up: {sel.runner_up}.", ""]
    if sel.could_compress_further:
        out += ["Compression could go further: the selected recipe is above the band's upper end.", ""]
    if summary.weight_error:
        out += [*heading("Weight error (relative, per quantized layer)"), *table(summary.weight_error)]
    if summary.sweep is not None:
        sweep = summary.sweep
        out += [*heading(f"BPE sweep of {sweep.recipe}"), *table(sweep_rows(sweep.model_dump(mode="json"))),
                f"Knee: {_one_line(sweep.knee.reason)}", ""]
    if summary.qad is not None:
        q = summary.qad
        verdict = "beats" if q.qad_beats_ptq else "does NOT beat"
        batches = (f" of {q.batch_size * q.grad_accum} rows ({q.batch_size} x {q.grad_accum} micro-batches"
                   f"{f', {q.world_size} processes' if q.world_size and q.world_size > 1 else ''})"
                   if q.batch_size and q.grad_accum else "")
        out += [*heading("QAD"),
                (f"QAD ({q.steps} steps{batches}, KD loss {q.first_loss:.5f} -> {q.final_loss:.5f}): "
                 f"median recovery {100 * q.median_recovery:.2f} % (CI {_interval(q.median_recovery_ci)} %)"
                 f", {verdict} PTQ's {100 * q.ptq_median_recovery:.2f} %."), "",
                *table(_qad_rows(q))]
    if summary.export is not None:
        e = summary.export
        checks = ", ".join(f"{n} {'ok' if c['passed'] else 'FAILED'}" for n, c in e.checks.items())
        serving = e.serving
        out += [*heading("Export"), f"- path: {e.path}",
                (f"- {e.size_bytes / 1e6:.2f} MB vs {e.bf16_size_bytes / 1e6:.2f} MB in BF16 "
                 f"({e.size_ratio:.2f}x smaller), {e.effective_bpe:.3f} bits per element; checks: {checks}"),
                f"- {e.serving_check.summary}",
                *(f"- {label}: {value}" for label, value in
                  (("Blackwell", serving.blackwell), ("Hopper", serving.hopper), ("Serve with vLLM", serving.vllm),
                   ("Serve with SGLang", serving.sglang), ("Serve with TensorRT-LLM", serving.tensorrt_llm))),
                ""]
    if summary.served is not None:
        out += [*heading("Served (vLLM)"), *_served_lines(summary.served, table)]
    for stage, lines in summary.sections.items():
        out += [*heading(stage), *lines, ""]
    if summary.settled:
        out += [*heading("Chosen by the memory plan"), f"For the settings left at auto: {', '.join(summary.settled)}.", ""]
    return out


def _served_lines(s: ServedEval, table) -> list[str]:
    """The export's recovery as vLLM serves it, beside the in-memory one (or why it did not run)."""
    if not s.ran:
        return [f"Not scored through vLLM; the recovery above is the in-memory one: {_one_line(s.why_not)}", ""]
    kv = s.served.get("export", {}).get("kv_cache_fallback")
    mem = s.in_memory
    line = (f"The exported checkpoint served by vLLM: median recovery {100 * s.median_recovery:.2f} % "
            f"(CI {_interval(s.median_recovery_ci)} %) against the BF16 model served by vLLM"
            + (f"; in memory ({mem.stage}) {100 * mem.median_recovery:.2f} % (CI {_interval(mem.median_recovery_ci)} %)"
               f": the intervals {'overlap' if s.agree else 'do NOT overlap'}" if mem else "")
            + (f". KV cache served in BF16 here: {kv}" if kv else "") + ".")
    overlap = {True: "yes", False: "NO", None: ""}
    rows = [{"task": r["task"], "in-memory rec. %": _pct(r.get("in_memory_recovery")),
             "in-memory CI %": _interval(r.get("in_memory_recovery_ci")), "served rec. %": _pct(r.get("served_recovery")),
             "served CI %": _interval(r.get("served_recovery_ci")), "overlap": overlap[r.get("intervals_overlap")]}
            for r in s.table]
    return [line, "", *table(rows)]


def _join(lines: list[str]) -> str:
    """The lines as one text, runs of blank lines collapsed to one."""
    out: list[str] = []
    for line in lines:
        if line or (out and out[-1]):
            out.append(line)
    return "\n".join(out).strip()


def report_markdown(summary: RunSummary | Mapping[str, Any]) -> str:
    return _join(_sections(_summary(summary), markdown_table, lambda title: ["", f"## {title}", ""])) + "\n"


def report_text(summary: RunSummary | Mapping[str, Any]) -> str:
    return _join(_sections(_summary(summary), text_table, lambda title: ["", f"{title}:"]))


def run_description(summary: RunSummary | Mapping[str, Any], *, reason_file: str | None = None,
                    max_chars: int = 8000) -> str:
    """The MLflow parent run's description (Markdown): the decision first, then the recipe table
    (left out, pointing at report.md, when the whole would be longer than `max_chars`)."""
    summary = _summary(summary)
    sel = summary.selection
    by_name = {r["name"]: r for r in summary.recipes}
    chosen = by_name.get(sel.selected or "")
    rows = []
    if chosen is not None:
        rows.append({"": "selected PTQ", "recipe": chosen["name"], "median rec. %": chosen.get("median rec. %"),
                     "CI %": chosen.get("CI %"), "bits/elem": chosen.get("bits/elem"), "KL": chosen.get("KL")})
    if summary.qad is not None:
        q, e = summary.qad, summary.export
        bits = e.effective_bpe if e is not None else chosen and chosen.get("bits/elem")
        rows.append({"": "QAD (exported)" if e is not None and e.passed else "QAD", "recipe": q.recipe,
                     "median rec. %": _pct(q.median_recovery), "CI %": _interval(q.median_recovery_ci),
                     "bits/elem": _round(bits, 3), "KL": _round(q.kl_divergence, 4)})
    reason = _one_line(sel.reason)
    short = reason if len(reason) <= 400 else reason[:400].rsplit(" ", 1)[0] + " …"
    out = [f"**Selected:** {sel.selected or 'none'} ({sel.policy} policy)", "", *markdown_table(rows),
           f"**Why:** {short}" + (f" (full text: `{reason_file}`)" if reason_file and short != reason else ""), ""]
    if sel.runner_up:
        out += [f"**Runner-up:** {sel.runner_up}", ""]
    full = _join([*out, "**Recipes**", "", *markdown_table(summary.recipes), *_failures(summary.recipes)])
    return (full if len(full) < max_chars else _join([*out, "The recipe table is in `report.md`."])[:max_chars]) + "\n"


# -- the BPE sweep -------------------------------------------------------------------------------


def sweep_rows(sweep: dict) -> list[dict]:
    """The sweep's table (`results.BPESweep` as a dict): one row per point by budget, then the
    fixed recipes on the same axes; the knee marked."""
    knee = (sweep.get("knee") or {}).get("name")
    rows = []
    for p in [*sweep.get("points", []), *sweep.get("fixed", [])]:
        low, high = p["median_recovery_ci"]
        rows.append({
            "point": p["name"], "budget": p.get("budget") if p.get("budget") is not None else "fixed",
            "searched bits": _round(p.get("searched_effective_bits"), 3), "bits/element": _round(p["effective_bpe"], 3),
            "median rec. %": _pct(p["median_recovery"]), "interval %": f"{100 * low:.2f}-{100 * high:.2f}",
            "KL": _round(p["kl_divergence"], 4),
            "formats": ", ".join(f"{k.removesuffix('_CFG')} {v}" for k, v in sorted(p.get("layers_by_format", {}).items())),
            "": "★ knee" if p["name"] == knee else "",
        })
    return rows


def sweep_text(sweep: dict) -> str:
    knee = sweep.get("knee") or {}
    lines = [f"BPE sweep of {sweep.get('recipe')}", "", *text_table(sweep_rows(sweep)), "",
             f"Knee: {knee.get('reason', '')}",  # the reason starts with the knee's name
             f"Eval noise (widest half interval): {100 * sweep.get('noise', 0):.2f} points; curve monotone within it: "
             f"{'yes' if sweep.get('monotone_within_noise') else 'no'}."]
    if sweep.get("failed"):
        lines.append(f"Failed points: {', '.join(sweep['failed'])}.")
    return "\n".join(lines)
