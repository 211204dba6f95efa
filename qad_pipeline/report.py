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


def _fmt(value) -> str:
    return f"{value:.4f}" if isinstance(value, float) else str(value)


def markdown_table(rows: list[dict]) -> list[str]:
    cols = _columns(rows)
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    return lines + ["| " + " | ".join(_fmt(r.get(c, "")) for c in cols) + " |" for r in rows]


def text_table(rows: list[dict]) -> list[str]:
    cols = _columns(rows)
    cells = [[_fmt(r.get(c, "")) for c in cols] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(cols)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    return [fmt.format(*cols), fmt.format(*("-" * w for w in widths))] + [fmt.format(*row) for row in cells]


def _qad_rows(summary: dict) -> list[dict]:
    keep = ("name", "median_recovery", "kl_divergence")
    return [{k: v for k, v in r.items() if k in keep or k.endswith("_recovery")} for r in summary["qad"]["table"]]


def _sections(summary: dict, table) -> list[str]:
    sel = summary["selection"]
    out = ["Recipes (PTQ):", *table(summary["recipes"])]
    out += [f"{r['name']} FAILED: {r.get('error', '')}" for r in summary["recipes"] if r["status"] != "ok"]
    out += ["", f"Selected: {sel['selected'] or 'none'} ({sel['policy']} policy). {sel['reason']}"]
    if "qad" in summary:
        q = summary["qad"]
        verdict = "beats" if q["qad_beats_ptq"] else "does NOT beat"
        out += ["", f"QAD ({q['steps']} steps, KD loss {q['first_loss']:.5f} -> {q['final_loss']:.5f}): "
                    f"median recovery {q['median_recovery']:.4f}, {verdict} PTQ's {q['ptq_median_recovery']:.4f}",
                *table(_qad_rows(summary))]
    if "export" in summary:
        e = summary["export"]
        checks = ", ".join(f"{n} {'ok' if c['passed'] else 'FAILED'}" for n, c in e["checks"].items())
        out += ["", f"Export: {e['path']}",
                f"  {e['size_bytes'] / 1e6:.2f} MB vs {e['bf16_size_bytes'] / 1e6:.2f} MB in BF16 "
                f"({e['size_ratio']:.2f}x smaller), {e['effective_bpe']:.3f} bits per element; checks: {checks}",
                f"  Blackwell: {e['serving']['blackwell']}", f"  Hopper: {e['serving']['hopper']}",
                f"  Serve with vLLM: {e['serving']['vllm']}"]
    return out


def report_markdown(summary: dict) -> str:
    return "\n".join(_sections(summary, markdown_table))


def report_text(summary: dict) -> str:
    return "\n".join(_sections(summary, text_table))
