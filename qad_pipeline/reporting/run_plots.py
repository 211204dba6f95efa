"""The run's two plots, drawn from its metrics files: recovery against bits per element, QAD loss.

Written to `metrics/plots/*.png` at the end of the flow; MLflow logs them with the run.
"""

from __future__ import annotations

from pathlib import Path

from qad_pipeline.core.layout import Layout
from qad_pipeline.reporting.plots import new_figure, pyplot, save_figure, spread_labels
from qad_pipeline.results.base import read_result
from qad_pipeline.results.export_metrics import ExportMetrics
from qad_pipeline.results.qad_metrics import QADMetrics, QADTraining
from qad_pipeline.results.selection_metrics import RecipeMetrics, RecipeResult, SelectionResult


def _recipe_points(layout: Layout, recipes: list[str]) -> list[dict]:
    """One point per recipe that ran (aliases folded into the recipe they are the same as)."""
    selection = read_result(layout.selection_metrics, SelectionResult, missing_ok=True)
    table = {r.name: r for r in selection.table} if selection is not None else {}
    points: dict[str, dict] = {}
    for name in recipes:
        m = read_result(layout.ptq_metrics(name), RecipeResult, missing_ok=True)
        if isinstance(m, RecipeMetrics):
            points[name] = {"names": [name], "bpe": m.effective_bpe, "rec": m.median_recovery,
                            "ci": m.median_recovery_ci}
    for name in recipes:
        row = table.get(name)
        if row is not None and row.status == "alias" and row.alias_of in points:
            points[row.alias_of]["names"].append(name)
            points.pop(name, None)
    return list(points.values())


def recovery_figure(layout: Layout, recipes: list[str]):
    """The recovery plot as a matplotlib figure (None when no recipe ran); see `recovery_vs_bpe`."""
    points = _recipe_points(layout, recipes)
    if not points:
        return None
    selection = read_result(layout.selection_metrics, SelectionResult, missing_ok=True)
    selected = selection.selected if selection is not None else None
    plt, fig, ax = new_figure((7, 4.5))
    colors = plt.get_cmap("tab10").colors
    ys = []
    texts = []
    for i, p in enumerate(sorted(points, key=lambda p: (p["bpe"], p["rec"]))):
        is_selected = selected in p["names"]
        label = " = ".join(p["names"]) + (" (selected)" if is_selected else "")
        y = 100 * p["rec"]
        yerr = None
        if p["ci"]:
            low, high = 100 * p["ci"][0], 100 * p["ci"][1]
            yerr = [[max(0.0, y - low)], [max(0.0, high - y)]]
            ys += [low, high]
        ys.append(y)
        ax.errorbar([p["bpe"]], [y], yerr=yerr, fmt="*" if is_selected else "o", ms=16 if is_selected else 7,
                    color=colors[i % len(colors)], mec="black" if is_selected else None, capsize=3,
                    label=f"{i + 1}: {label}", zorder=3 if is_selected else 2)
        texts.append(ax.annotate(str(i + 1), (p["bpe"], y), xytext=(10 if is_selected else 6, 2), textcoords="offset points", fontsize=8))
    if layout.qad_metrics.is_file() and layout.export_metrics.is_file():
        q, e = read_result(layout.qad_metrics, QADMetrics), read_result(layout.export_metrics, ExportMetrics)
        y, (ci_low, ci_high) = 100 * q.median_recovery, q.median_recovery_ci
        yerr = [[max(0.0, y - 100 * ci_low)], [max(0.0, 100 * ci_high - y)]]
        ys += [y, 100 * ci_low, 100 * ci_high]
        ax.errorbar([e.effective_bpe], [y], yerr=yerr, fmt="D", ms=7, color="black", capsize=3,
                    label="QAD (exported)")
    low, high = min(ys), max(ys)
    pad = max(0.5, 0.1 * (high - low))
    band = selection.band if selection is not None else None
    if band is not None:
        b_low, b_high = 100 * band[0], 100 * band[1]
        low, high = min(low, b_low) if b_low > low - 5 else low, max(high, b_high) if b_high < high + 5 else high
        ax.axhspan(b_low, b_high, color="tab:green", alpha=0.12, zorder=0,
                   label=f"target band {b_low:.5g}–{b_high:.5g} %")
    ax.set_ylim(low - pad, high + pad)
    xs = [p["bpe"] for p in points]
    ax.set_xlim(min(xs) - 0.5, max(xs) + 0.8)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0)
    spread_labels(ax, texts)
    ax.set_xlabel("effective bits per element")
    ax.set_ylabel("median recovery vs BF16 (%)")
    ax.set_title("PTQ recipes: accuracy recovery against size")
    ax.grid(alpha=0.3)
    return fig


def recovery_vs_bpe(layout: Layout, recipes: list[str], out: Path) -> Path | None:
    """Median recovery (with its interval) against effective bits per element, one point per
    recipe, the selected one a star; the target band shaded; QAD's exported model a diamond."""
    fig = recovery_figure(layout, recipes)
    if fig is None:
        return None
    plt = pyplot()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, bbox_inches="tight")
    plt.close(fig)
    return out


def qad_loss_curve(layout: Layout, out: Path) -> Path | None:
    """The QAD KL loss per step."""
    path = layout.qad / "loss.json"
    if not path.is_file():
        return None
    losses = read_result(path, QADTraining).losses
    plt, fig, ax = new_figure()
    ax.plot([p.step for p in losses], [p.loss for p in losses])
    return save_figure(plt, fig, ax, out, "step", "KL(teacher || student) per token", "QAD distillation loss")


def write_plots(layout: Layout, recipes: list[str]) -> list[Path]:
    folder = layout.metrics / "plots"
    made = [recovery_vs_bpe(layout, recipes, folder / "recovery_vs_bpe.png"),
            qad_loss_curve(layout, folder / "qad_loss.png")]
    return [p for p in made if p is not None]


