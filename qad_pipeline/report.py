"""The recipe table and the run's report, read back from the metrics files, as Markdown and text.

`recipe_rows` is the table a user compares recipes on: per-task recovery in %, the median with its
interval, bits per element, KL, median weight error, and a `choice` column that marks the selected
recipe (and names the recipe an alias row is the same as). The Prefect table artifact, the
Markdown report (Prefect) and the run description (MLflow) are all made from it.

Markdown here is GitHub-flavoured: every table has a blank line before and after it, cells hold
one line with `|` escaped, and failures are listed below a table, never inside it.
"""

from __future__ import annotations

from typing import Any

from qad_pipeline.artifacts import read_json
from qad_pipeline.layout import Layout

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


def _selection_rows(layout: Layout) -> dict[str, dict]:
    if not layout.selection_metrics.is_file():
        return {}
    return {r["name"]: r for r in read_json(layout.selection_metrics).get("table") or [] if r.get("name")}


def _measured(name: str, m: dict, tasks: list[str]) -> dict:
    weight = m.get("weight_error") if isinstance(m.get("weight_error"), dict) else {}
    size = m.get("size_bytes")
    return {
        **{f"{t} rec. %": _pct((m.get("tasks") or {}).get(t, {}).get("recovery")) for t in tasks},
        "median rec. %": _pct(m.get("median_recovery")),
        "CI %": _interval(m.get("median_recovery_ci")),
        "bits/elem": _round(m.get("effective_bpe"), 3),
        "KL": _round(m.get("kl_divergence"), 4),
        "weight err.": _round(weight.get("median"), 4),
        "KV cache": m.get("kv_cache") or "",
        "size MB": None if not isinstance(size, (int, float)) else round(size / 1e6, 3),
    }


def recipe_rows(layout: Layout, recipes: list[str]) -> list[dict]:
    """One row for BF16 and one per recipe, in the configured order (see the module docstring).

    Every row has the same columns; a value that is not there is None. A failed recipe's error is
    under `error`, which the tables leave out and list below them.
    """
    baseline = read_json(layout.baseline_metrics)
    tasks = list(baseline.get("tasks") or {})
    selection = read_json(layout.selection_metrics) if layout.selection_metrics.is_file() else {}
    selected = selection.get("selected")
    table = _selection_rows(layout)
    bf16 = {"tasks": {t: {"recovery": 1.0} for t in tasks}, "median_recovery": 1.0, "kl_divergence": 0.0,
            **{k: baseline.get(k) for k in ("effective_bpe", "size_bytes")}, "kv_cache": "bf16"}
    rows = [{"choice": "", "name": "bf16", "status": "ok", **_measured("bf16", bf16, tasks)}]
    for name in recipes:
        path = layout.ptq_metrics(name)
        m = read_json(path) if path.is_file() else {"status": "failed", "error": "no metrics"}
        sel = table.get(name, {})
        alias_of = sel.get("alias_of") if sel.get("status") == "alias" else None
        if alias_of and m.get("status") != "ok":
            target = layout.ptq_metrics(alias_of)
            m = {**(read_json(target) if target.is_file() else {}), "status": "alias"}
        status = "alias" if alias_of else ("ok" if m.get("status") == "ok" else "failed")
        choice = SELECTED_MARK if name == selected else f"alias of {alias_of}" if alias_of else ""
        row = {"choice": choice, "name": name, "status": status}
        if status == "failed":
            row.update(_measured(name, {}, tasks))
            error = m.get("error") or sel.get("error") or "failed (no error recorded)"
            row["error"] = _one_line(error)[:MAX_ERROR_CHARS]
        else:
            row.update(_measured(name, m, tasks))
        rows.append(row)
    return rows


def weight_error_rows(layout: Layout, recipes: list[str]) -> list[dict]:
    """Per recipe that recorded it: median relative weight error over layers and its worst layers."""
    rows = []
    for name in recipes:
        path = layout.ptq_metrics(name)
        weight = read_json(path).get("weight_error") if path.is_file() else None
        if not isinstance(weight, dict) or weight.get("median") is None:
            continue
        worst = ", ".join(f"{w.get('layer')} ({w.get('error', 0):.4f})" for w in weight.get("worst") or [])
        rows.append({"name": name, "median rel. error": round(weight["median"], 4),
                     "layers": len(weight.get("layers") or {}), "worst layers": worst})
    return rows


def read_summary(layout: Layout, recipes: list[str]) -> dict:
    """The report's input from the files alone: selection, recipe rows, weight error, QAD, export."""
    summary: dict[str, Any] = {"selection": read_json(layout.selection_metrics),
                               "recipes": recipe_rows(layout, recipes),
                               "weight_error": weight_error_rows(layout, recipes)}
    for key, path in (("qad", layout.qad_metrics), ("export", layout.export_metrics)):
        if path.is_file():
            summary[key] = read_json(path)
    return summary


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


def text_table(rows: list[dict]) -> list[str]:
    if not rows:
        return []
    cols = _columns(rows)
    cells = [[_one_line(_fmt(r.get(c))) for c in cols] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(cols)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    return [fmt.format(*cols), fmt.format(*("-" * w for w in widths))] + [fmt.format(*row) for row in cells]


# -- the report ------------------------------------------------------------------------------------


def _qad_rows(summary: dict) -> list[dict]:
    out = []
    for r in summary["qad"].get("table") or []:
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


def _sections(summary: dict, table, heading) -> list[str]:
    sel = summary["selection"]
    band = sel.get("band") or []
    band_text = f", band {_interval(band)} %" if len(band) == 2 else ""
    out = [*heading("Recipes (PTQ)"), *table(summary["recipes"]), *_failures(summary["recipes"])]
    if summary["recipes"]:
        out += [(f"{SELECTED_MARK}: the chosen recipe; recovery: quantized vs BF16 score, "
                 "median over tasks (CI: its interval)."), ""]
    out += [*heading("Selection"),
            (f"Selected: {sel.get('selected') or 'none'} ({sel.get('policy')} policy{band_text}). "
             f"{_one_line(sel.get('reason') or '')}"), ""]
    if sel.get("runner_up"):
        out += [f"Runner-up: {sel['runner_up']}.", ""]
    if sel.get("could_compress_further"):
        out += ["Compression could go further: the selected recipe is above the band's upper end.", ""]
    if summary.get("weight_error"):
        out += [*heading("Weight error (relative, per quantized layer)"), *table(summary["weight_error"])]
    if "qad" in summary:
        q = summary["qad"]
        verdict = "beats" if q.get("qad_beats_ptq") else "does NOT beat"
        ci = _interval(q.get("median_recovery_ci"))
        out += [*heading("QAD"),
                (f"QAD ({q['steps']} steps, KD loss {q['first_loss']:.5f} -> {q['final_loss']:.5f}): "
                 f"median recovery {100 * q['median_recovery']:.2f} %" + (f" (CI {ci} %)" if ci else "")
                 + f", {verdict} PTQ's {100 * q['ptq_median_recovery']:.2f} %."), "",
                *table(_qad_rows(summary))]
    if "export" in summary:
        e = summary["export"]
        checks = ", ".join(f"{n} {'ok' if c['passed'] else 'FAILED'}" for n, c in e["checks"].items())
        serving = e.get("serving") or {}
        out += [*heading("Export"), f"- path: {e['path']}",
                (f"- {e['size_bytes'] / 1e6:.2f} MB vs {e['bf16_size_bytes'] / 1e6:.2f} MB in BF16 "
                 f"({e['size_ratio']:.2f}x smaller), {e['effective_bpe']:.3f} bits per element; checks: {checks}"),
                *([f"- {e['serving_check']['summary']}"] if e.get("serving_check") else []),
                *(f"- {label}: {serving[key]}" for key, label in
                  (("blackwell", "Blackwell"), ("hopper", "Hopper"), ("vllm", "Serve with vLLM"),
                   ("sglang", "Serve with SGLang"), ("tensorrt_llm", "Serve with TensorRT-LLM")) if key in serving),
                ""]
    return out


def _join(lines: list[str]) -> str:
    """The lines as one text, runs of blank lines collapsed to one."""
    out: list[str] = []
    for line in lines:
        if line or (out and out[-1]):
            out.append(line)
    return "\n".join(out).strip()


def report_markdown(summary: dict) -> str:
    return _join(_sections(summary, markdown_table, lambda title: ["", f"## {title}", ""])) + "\n"


def report_text(summary: dict) -> str:
    return _join(_sections(summary, text_table, lambda title: ["", f"{title}:"]))


def run_description(summary: dict, *, reason_file: str | None = None, max_chars: int = 8000) -> str:
    """The MLflow parent run's description (Markdown): the decision first, then the recipe table
    (left out, pointing at report.md, when the whole would be longer than `max_chars`)."""
    sel = summary["selection"]
    by_name = {r["name"]: r for r in summary["recipes"]}
    chosen = by_name.get(sel.get("selected") or "")
    rows = []
    if chosen is not None:
        rows.append({"": "selected PTQ", "recipe": chosen["name"], "median rec. %": chosen.get("median rec. %"),
                     "CI %": chosen.get("CI %"), "bits/elem": chosen.get("bits/elem"), "KL": chosen.get("KL")})
    if "qad" in summary:
        q, e = summary["qad"], summary.get("export") or {}
        rows.append({"": "QAD (exported)" if e.get("passed") else "QAD", "recipe": q.get("recipe"),
                     "median rec. %": _pct(q.get("median_recovery")), "CI %": _interval(q.get("median_recovery_ci")),
                     "bits/elem": _round(e.get("effective_bpe", chosen and chosen.get("bits/elem")), 3),
                     "KL": _round(q.get("kl_divergence"), 4)})
    reason = _one_line(sel.get("reason") or "")
    short = reason if len(reason) <= 400 else reason[:400].rsplit(" ", 1)[0] + " …"
    out = [f"**Selected:** {sel.get('selected') or 'none'} ({sel.get('policy')} policy)", "", *markdown_table(rows),
           f"**Why:** {short}" + (f" (full text: `{reason_file}`)" if reason_file and short != reason else ""), ""]
    if sel.get("runner_up"):
        out += [f"**Runner-up:** {sel['runner_up']}", ""]
    full = _join([*out, "**Recipes**", "", *markdown_table(summary["recipes"]), *_failures(summary["recipes"])])
    return (full if len(full) < max_chars else _join([*out, "The recipe table is in `report.md`."])[:max_chars]) + "\n"
