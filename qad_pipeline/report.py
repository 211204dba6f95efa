"""The recipe table, read back from the metrics files, as rows, Markdown and terminal text."""

from __future__ import annotations

from qad_pipeline.artifacts import read_json
from qad_pipeline.layout import Layout


def recipe_rows(layout: Layout, recipes: list[str]) -> list[dict]:
    """One row for BF16 and one per recipe: per-task score and recovery, median, size, status."""
    baseline = read_json(layout.baseline_metrics)
    rows = [{
        "name": "bf16",
        "status": "ok",
        **{task: round(s["value"], 4) for task, s in baseline["tasks"].items()},
        "median_recovery": 1.0,
        "effective_bpe": round(baseline["effective_bpe"], 3),
        "size_mb": round(baseline["size_bytes"] / 1e6, 3),
        "kv_cache": "bf16",
    }]
    for name in recipes:
        path = layout.ptq_metrics(name)
        m = read_json(path) if path.is_file() else {"status": "failed", "error": "no metrics"}
        if m["status"] != "ok":
            rows.append({"name": name, "status": "failed", "error": (m.get("error") or "")[:200]})
            continue
        rows.append({
            "name": name,
            "status": "ok",
            **{task: round(s["value"], 4) for task, s in m["tasks"].items()},
            "median_recovery": round(m["median_recovery"], 4),
            "effective_bpe": round(m["effective_bpe"], 3),
            "size_mb": round(m["size_bytes"] / 1e6, 3),
            "kv_cache": m["kv_cache"],
            "kl_divergence": round(m.get("kl_divergence", 0.0), 5),
        })
    return rows


def _columns(rows: list[dict]) -> list[str]:
    cols: list[str] = []
    for r in rows:
        cols += [k for k in r if k not in cols and k != "error"]
    return cols


def recipe_table_markdown(summary: dict) -> str:
    rows = summary["recipes"]
    cols = _columns(rows)
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(str(r.get(c, "")) for c in cols) + " |" for r in rows]
    sel = summary["selection"]
    lines += ["", f"**Selected:** {sel['selected'] or 'none'} ({sel['policy']} policy)", "", sel["reason"]]
    return "\n".join(lines)


def recipe_table_text(summary: dict) -> str:
    rows = summary["recipes"]
    cols = _columns(rows)
    cells = [[str(r.get(c, "")) for c in cols] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(cols)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    out = [fmt.format(*cols), fmt.format(*("-" * w for w in widths))]
    out += [fmt.format(*row) for row in cells]
    for r in rows:
        if r["status"] != "ok":
            out.append(f"{r['name']} FAILED: {r.get('error', '')}")
    sel = summary["selection"]
    out += ["", f"selected: {sel['selected'] or 'none'}", sel["reason"]]
    return "\n".join(out)
