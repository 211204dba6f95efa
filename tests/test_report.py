"""The recipe table, the Markdown report and the recovery plot (qad_pipeline/reporting/report.py, plots.py),
from metrics files shaped like the stages' (with the intervals, settings, aliases and weight
error that selection records).

Markdown is checked by parsing it (markdown-it-py, GitHub-flavoured tables), not by string match.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from markdown_it import MarkdownIt

from qad_pipeline.core.config import PROJECT_PARAMS, load_params
from qad_pipeline.core.layout import Layout
from qad_pipeline.reporting.report import SELECTED_MARK, read_summary, recipe_rows, report_markdown, run_description
from qad_pipeline.results.base import write_result
from qad_pipeline.results.selection_metrics import RecipeFailed, RecipeRow
from tests import samples

TASKS = ("heldout_cloze", "perplexity")
# name: (per-task recovery, median, interval, bits, kl); all close together, as on the demo
MEASURED = {
    "nvfp4_max-mamba_fp8-kv_fp8": ((0.990, 0.985), 0.9875, (0.970, 0.999), 8.116, 0.0115),
    "nvfp4_mse-mamba_fp8-kv_fp8": ((0.991, 0.986), 0.9885, (0.971, 1.000), 8.116, 0.0112),
    "nvfp4_4o6-mamba_w4a16-kv_nvfp4": ((0.992, 0.988), 0.9900, (0.975, 1.003), 7.600, 0.0140),
}
ALIAS = "nvfp4_max-mamba_w4a16-kv_fp8"
BROKEN = "broken-recipe"
ERROR = "ValueError: bad | pipe\nsecond line"
RECIPES = [*MEASURED, ALIAS, BROKEN]
SELECTED = "nvfp4_4o6-mamba_w4a16-kv_nvfp4"
PARAMS = load_params(PROJECT_PARAMS, {"ptq.recipes": RECIPES})


def tables(markdown: str) -> list[list[list[str]]]:
    """Each parsed table as its rows of cell texts."""
    out, row = [], None
    for tok in MarkdownIt("commonmark").enable("table").parse(markdown):
        if tok.type == "table_open":
            out.append([])
        elif tok.type == "tr_open":
            row = []
        elif tok.type == "inline" and row is not None:
            row.append(tok.content)
        elif tok.type == "tr_close":
            out[-1].append(row)
            row = None
    return out


@pytest.fixture
def layout(tmp_path) -> Layout:
    layout = Layout(tmp_path)
    higher = {"heldout_cloze": True, "perplexity": False}
    write_result(layout.baseline_metrics, samples.baseline(
        {t: samples.score(1.0, higher_is_better=higher[t]) for t in TASKS}, effective_bpe=16.0, size_bytes=6_000_000))
    table = []
    for name, (per_task, median, ci, bpe, kl) in MEASURED.items():
        write_result(layout.ptq_metrics(name), samples.recipe_metrics(
            name, {t: samples.score(r, higher_is_better=higher[t], recovery=r, recovery_ci=(r - 0.02, r + 0.01))
                   for t, r in zip(TASKS, per_task)},
            median, median_recovery_ci=ci, effective_bpe=bpe, kl_divergence=kl, size_bytes=3_000_000,
            kv_cache=name.rsplit("_", 1)[1],
            weight_error={"median": 0.08, "mean": 0.085, "layers": {"a": 0.08, "b": 0.09},
                          "worst": [{"layer": "model.layers.3.mlp.up_proj", "error": 0.0912}]}))
        table.append(RecipeRow(name, "ok", median, bpe, median_recovery_ci=ci))
    table.append(RecipeRow(ALIAS, "alias", alias_of="nvfp4_max-mamba_fp8-kv_fp8"))
    write_result(layout.ptq_metrics(BROKEN), RecipeFailed(recipe=BROKEN, status="failed", error=ERROR))
    table.append(RecipeRow(BROKEN, "failed", error=ERROR))
    write_result(layout.selection_metrics, samples.selection(
        SELECTED, table, runner_up="nvfp4_mse-mamba_fp8-kv_fp8", band=(0.95, 0.99),
        reason="The most compressed recipe at or above the band's floor. " * 10, could_compress_further=True))
    return layout


def test_recipe_rows_show_recoveries_in_percent_the_interval_and_mark_the_selected_and_alias_rows(layout):
    rows = {r["name"]: r for r in recipe_rows(layout, RECIPES)}
    columns = list(rows["bf16"])
    assert all([k for k in r if k != "error"] == columns for r in rows.values())  # one shape: Prefect's table
    chosen = rows[SELECTED]
    assert chosen["choice"] == SELECTED_MARK
    assert chosen["heldout_cloze rec. %"] == 99.2 and chosen["median rec. %"] == 99.0
    assert chosen["CI %"] == "97.50–100.30" and chosen["bits/elem"] == 7.6 and chosen["KL"] == 0.014
    assert rows[ALIAS]["choice"] == "alias of nvfp4_max-mamba_fp8-kv_fp8" and rows[ALIAS]["status"] == "alias"
    assert rows[ALIAS]["median rec. %"] == rows["nvfp4_max-mamba_fp8-kv_fp8"]["median rec. %"]
    assert rows[BROKEN]["status"] == "failed" and "\n" not in rows[BROKEN]["error"]
    assert [r["choice"] for r in rows.values()].count(SELECTED_MARK) == 1


def test_report_markdown_tables_render_with_a_failure_beside_them(layout):
    summary = read_summary(layout, PARAMS)
    markdown = report_markdown(summary)
    recipes, weight = tables(markdown)
    header = recipes[0]
    assert header[:3] == ["choice", "name", "status"] and "median rec. %" in header
    assert [len(r) for r in recipes] == [len(header)] * (1 + 1 + len(RECIPES))  # a pipe in an error splits nothing
    assert [r[1] for r in recipes[1:]] == ["bf16", *RECIPES]
    assert [len(r) for r in weight] == [4] * 4 and weight[0][0] == "name"
    assert "bad | pipe second line" in markdown  # the failure is listed, on one line, outside the tables
    assert "Runner-up: nvfp4_mse-mamba_fp8-kv_fp8" in markdown and "## Selection" in markdown


def test_run_description_leads_with_the_decision(layout):
    text = run_description(read_summary(layout, PARAMS), reason_file="selection_reason.txt")
    headline, recipes = tables(text)
    assert headline[1][:3] == ["selected PTQ", SELECTED, "99"]
    assert "selection_reason.txt" in text and len(recipes) == 1 + 1 + len(RECIPES)
    short = run_description(read_summary(layout, PARAMS), max_chars=1000)
    assert len(short) <= 1001 and len(tables(short)) == 1 and "report.md" in short


def test_recovery_plot_draws_band_intervals_legend_and_separate_labels(layout):
    from matplotlib.patches import Rectangle

    from qad_pipeline.reporting.run_plots import recovery_figure, recovery_vs_bpe

    fig = recovery_figure(layout, RECIPES)
    ax = fig.axes[0]
    band = [p for p in ax.patches if isinstance(p, Rectangle) and p.get_label().startswith("target band")]
    assert len(band) == 1
    assert band[0].get_y() == pytest.approx(95) and band[0].get_height() == pytest.approx(4)
    errorbars = [c for c in ax.containers if c.has_yerr]
    assert len(errorbars) == len(MEASURED)  # the alias is folded into the recipe it equals
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert any(SELECTED in t and "(selected)" in t for t in legend)
    assert any(ALIAS in t and "nvfp4_max-mamba_fp8-kv_fp8" in t for t in legend)
    # two recipes share 8.116 bits at nearly the same recovery: their labels must still not overlap
    renderer = fig.canvas.get_renderer()
    boxes = [t.get_window_extent(renderer) for t in ax.texts]
    assert len(boxes) == len(MEASURED)
    assert not any(a.overlaps(b) for i, a in enumerate(boxes) for b in boxes[i + 1:])
    out = recovery_vs_bpe(layout, RECIPES, layout.metrics / "plots" / "recovery_vs_bpe.png")
    assert Path(out).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("selection_sweep, budgets, shown", [
    ("knee", [5.0, 6.0], True),
    ("knee", [], False),  # no budgets: this run did not sweep, whatever an earlier sweep left on disk
    ("none", [5.0, 6.0], False),
])
def test_the_sweep_is_reported_exactly_when_the_run_swept(layout, selection_sweep, budgets, shown):
    from qad_pipeline.results.sweep_metrics import BPESweep, Knee, SweepPoint

    point = SweepPoint(name="r@5.0", kind="sweep", budget=5.0, searched_effective_bits=5.0, effective_bpe=5.2,
                       median_recovery=0.97, median_recovery_ci=(0.95, 0.99), kl_divergence=0.02,
                       layers_by_format={"nvfp4": 3})
    write_result(layout.bpe_sweep_metrics, BPESweep(
        recipe="r", points=[point], fixed=[], knee=Knee(name="r@5.0", budget=5.0, reason="the knee"),
        knee_epsilon=0.005, noise=0.02, monotone_within_noise=True, failed=[], search_s=1.0, seconds={}))
    params = load_params(PROJECT_PARAMS, {"ptq.recipes": RECIPES, "selection.sweep": selection_sweep,
                                          "sweep.budgets": budgets})
    summary = read_summary(layout, params)
    assert (summary.sweep is not None) == shown
    assert ("BPE sweep of r" in report_markdown(summary)) == shown
