"""The run's two plots, drawn from its metrics files: recovery against bits per element, QAD loss.

Written to `metrics/plots/*.png` at the end of the flow; MLflow logs them with the run.
"""

from __future__ import annotations

from pathlib import Path

from qad_pipeline.artifacts import read_json
from qad_pipeline.layout import Layout


def _figure():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt, *plt.subplots(figsize=(6, 4), dpi=100)


def _save(plt, fig, ax, out: Path, xlabel: str, ylabel: str, title: str) -> Path:
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)
    return out


def recovery_vs_bpe(layout: Layout, recipes: list[str], out: Path) -> Path | None:
    """One point per recipe that ran: median recovery against effective bits per element."""
    points = []
    for name in recipes:
        path = layout.ptq_metrics(name)
        if path.is_file() and (m := read_json(path)).get("status") == "ok":
            points.append((name, m["effective_bpe"], m["median_recovery"]))
    if not points:
        return None
    plt, fig, ax = _figure()
    selected = read_json(layout.selection_metrics).get("selected") if layout.selection_metrics.is_file() else None
    for name, bpe, rec in points:
        ax.scatter([bpe], [100 * rec], marker="*" if name == selected else "o", s=120 if name == selected else 40)
        ax.annotate(name, (bpe, 100 * rec), fontsize=7, xytext=(4, 4), textcoords="offset points")
    if layout.qad_metrics.is_file() and layout.export_metrics.is_file():
        q, e = read_json(layout.qad_metrics), read_json(layout.export_metrics)
        ax.scatter([e["effective_bpe"]], [100 * q["median_recovery"]], marker="D", s=60, label="QAD (exported)")
        ax.legend(fontsize=7)
    return _save(plt, fig, ax, out, "effective bits per element", "median recovery vs BF16 (%)",
                 "PTQ recipes: accuracy recovery against size")


def qad_loss_curve(layout: Layout, out: Path) -> Path | None:
    """The QAD KL loss per step."""
    path = layout.qad / "loss.json"
    if not path.is_file():
        return None
    losses = read_json(path)["losses"]
    plt, fig, ax = _figure()
    ax.plot([p["step"] for p in losses], [p["loss"] for p in losses])
    return _save(plt, fig, ax, out, "step", "KL(teacher || student) per token", "QAD distillation loss")


def write_plots(layout: Layout, recipes: list[str]) -> list[Path]:
    folder = layout.metrics / "plots"
    made = [recovery_vs_bpe(layout, recipes, folder / "recovery_vs_bpe.png"),
            qad_loss_curve(layout, folder / "qad_loss.png")]
    return [p for p in made if p is not None]
