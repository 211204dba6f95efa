"""Drawing a figure the project's way (matplotlib without a display, labels that do not overlap),
and the BPE sweep's Pareto plot (`tasks/bpe_sweep.py`); the run's own plots: `run_plots.py`."""

from __future__ import annotations

from pathlib import Path


def pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def new_figure(size=(6, 4)):
    plt = pyplot()
    return plt, *plt.subplots(figsize=size, dpi=100)


def save_figure(plt, fig, ax, out: Path, xlabel: str, ylabel: str, title: str) -> Path:
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, bbox_inches="tight")
    plt.close(fig)
    return out


def spread_labels(ax, texts) -> None:
    """Move point labels apart vertically (in pixels) until no two of them overlap."""
    fig = ax.figure
    renderer = fig.canvas.get_renderer()
    placed = []
    for text in sorted(texts, key=lambda t: ax.transData.transform(t.xy)[1]):
        for _ in range(50):
            box = text.get_window_extent(renderer)
            clash = next((b for b in placed if b.overlaps(box)), None)
            if clash is None:
                break
            x, y = text.xyann
            text.xyann = (x, y + (clash.y1 - box.y0) * 72 / fig.dpi + 1)  # offset points
        placed.append(text.get_window_extent(renderer))


def bpe_sweep_plot(sweep, out: Path) -> Path:
    """The BPE sweep's Pareto plot: median recovery (with its interval) against whole-model bits per
    element, the sweep's points joined in budget order and labelled with their budget, the knee a
    star, the fixed recipes as numbered squares on the same axes, named in the legend
    (`results.BPESweep`)."""
    plt, fig, ax = new_figure((7, 4.5))
    ranked = sorted(sweep.points, key=lambda p: p.effective_bpe)
    if ranked:
        ax.plot([p.effective_bpe for p in ranked], [100 * p.median_recovery for p in ranked], color="tab:blue",
                alpha=0.5, zorder=1)
    for i, p in enumerate([*ranked, *sweep.fixed]):
        y, (low, high) = 100 * p.median_recovery, p.median_recovery_ci
        knee, fixed = p.name == sweep.knee.name, p.kind == "fixed"
        number = i - len(ranked) + 1
        ax.errorbar([p.effective_bpe], [y], yerr=[[y - 100 * low], [100 * high - y]],
                    fmt="s" if fixed else "*" if knee else "o", ms=15 if knee else 6, capsize=3,
                    color="tab:gray" if fixed else "tab:blue", mec="black" if knee else None, zorder=3 if knee else 2,
                    label=f"R{number}: {p.name}" if fixed else f"knee: {p.budget:g} bits" if knee else None)
        label = f"R{number}" if fixed else f"{p.budget:g} b"
        ax.annotate(label, (p.effective_bpe, y), xytext=(6, -10 if fixed else 3), textcoords="offset points",
                    fontsize=7, color="dimgray" if fixed else "black")
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.15), ncol=2, frameon=False)
    return save_figure(plt, fig, ax, out, "effective bits per element (whole model)", "median recovery vs BF16 (%)",
                 f"BPE sweep of {sweep.recipe}: budget (b, searched bits) -> recovery")
