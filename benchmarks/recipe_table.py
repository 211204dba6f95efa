"""The PTQ recipes side by side on a real model: `python benchmarks/recipe_table.py [--out-root DIR] [RECIPE ...]`.

Runs `qad-pipeline stage` for calibration, the baseline, each recipe (default: every recipe file in
recipes/ but the AutoQuantize one) and the selection, one process after another with the
params.yaml defaults, on SmolLM2-135M-Instruct (benchmarks/real_model.py; `selection.band=[0.5,
0.99]`, as the README's run), then prints one row per recipe: median recovery with its 95 %
interval, KL to BF16, the median weight error, the quantization time and the whole stage's, the
stage's peak RSS against the memory plan's estimate, and what the selection picked and why.
`--set section.key=value` (repeatable) adds overrides, e.g. `ptq.layerwise=true`. `--export
RECIPE ...` then exports those recipes' checkpoints one after another (`export.source=ptq/<recipe>`,
the export checks and the serving check in vLLM, `qad-pipeline setup-vllm`) and prints each
check's verdict and the served views' KL. `--qad NAME[:KEY=VALUE,...] ...` then trains QAD once per
variant from the selected recipe (the default step budget; e.g. `plain lsq:qad.learn_scales=lsq
cached:qad.teacher=cached`), evaluates and exports each (`export.source=qad`, the same checks) and
prints its recovery beside the student's. Stages already done under the out-root are kept
(remove it to start over).
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from qad_pipeline.core.artifacts import read_json
from qad_pipeline.core.config import PROJECT_PARAMS, PROJECT_ROOT, load_params
from qad_pipeline.core.layout import Layout
from qad_pipeline.plan import memory


def stage(root: Path, overrides: list[str], *args: str, check: bool = True) -> tuple[float, str | None]:
    """Run `qad-pipeline stage ARGS`: (seconds, None), or (seconds, its error line) when it failed
    and `check` is off (a failed check of an export is a row of the table)."""
    command = [sys.executable, "-m", "qad_pipeline", "stage", *args, "--params", str(PROJECT_PARAMS),
               "--out-root", str(root)]
    for item in overrides:
        command += ["--set", item]
    started = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0 and check:
        raise SystemExit(f"stage {' '.join(args)} failed:\n{done.stdout[-2000:]}{done.stderr[-3000:]}")
    error = next((line for line in reversed(done.stderr.splitlines()) if line.startswith("error:")), "failed")
    return time.perf_counter() - started, (error if done.returncode != 0 else None)


def main() -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from real_model import build_real_model

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("recipes", nargs="*")
    ap.add_argument("--out-root", type=Path, default=Path("runs/recipe-table"))
    ap.add_argument("--set", dest="extra", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--export", nargs="+", default=[], metavar="RECIPE")
    ap.add_argument("--qad", nargs="+", default=[], metavar="NAME[:KEY=VALUE,...]")
    args = ap.parse_args()
    recipes = args.recipes or sorted(p.stem for p in (PROJECT_ROOT / "recipes").glob("nvfp4_*.yaml"))
    model = build_real_model()
    overrides = [f"base_model.path={model}", "selection.band=[0.5, 0.99]", f"ptq.recipes=[{', '.join(recipes)}]",
                 *args.extra]
    root, layout = args.out_root.resolve(), Layout(args.out_root.resolve())
    params = memory.settled_here(load_params(overrides=overrides))
    planned = {e.stage: e for e in memory.plan(params)}
    walls = {}
    for name, *item in [("calibration",), ("baseline",), *[("ptq", r) for r in recipes]]:
        done = (layout.ptq(item[0]) / "scores.json") if item else None
        if done is not None and done.is_file():
            continue
        if not item and (name == "baseline" and layout.baseline_metrics.is_file()
                         or name == "calibration" and (layout.data / "manifest.json").is_file()):
            continue
        walls[(name, *item)], _ = stage(root, overrides, name, *item)
        print(f"{name} {' '.join(item)}: {walls[(name, *item)]:.0f} s", flush=True)
    stage(root, overrides, "selection")
    selection = read_json(root / "metrics" / "selection.json")
    rows = {r["name"]: r for r in selection["table"]}
    print(f"\n== {len(recipes)} recipes on SmolLM2-135M-Instruct ({' '.join(overrides[1:2] + args.extra)}) ==")
    print(f"{'recipe':<34} {'recovery [95 % CI]':>24} {'KL':>7} {'w.err':>6} {'quant s':>8} {'stage s':>8} "
          f"{'peak MB':>8} {'plan MB':>8} {'peak/plan':>9}")
    for recipe in recipes:
        scores, row = read_json(layout.ptq(recipe) / "scores.json"), rows[recipe]
        if row["status"] != "ok":
            print(f"{recipe:<34} {row['status']}: {row.get('error')}")
            continue
        low, high = row["median_recovery_ci"]
        plan_mb = planned[f"ptq/{recipe}"].host_bytes / 2**20
        timing = scores["timing_s"]
        print(f"{recipe:<34} {100 * row['median_recovery']:6.2f} % [{100 * low:6.2f}-{100 * high:6.2f}] "
              f"{row['kl_divergence']:7.4f} {row['weight_error_median']:6.4f} {timing.get('quantize', 0):8.0f} "
              f"{timing.get('total', 0):8.0f} {scores['peak_rss_mb']:8.0f} {plan_mb:8.0f} {scores['peak_rss_mb'] / plan_mb:9.2f}")
    print(f"selected: {selection['selected']}; {selection['reason']}")
    for recipe in args.export:
        export(root, layout, overrides, f"ptq/{recipe}", recipe)
    for variant in args.qad:
        name, _, settings = variant.partition(":")
        settings = [s for s in settings.split(",") if s]
        if "qad.teacher=cached" in settings:
            stage(root, [*overrides, *settings], "teacher_cache")
        seconds, _ = stage(root, [*overrides, *settings], "qad")
        stage(root, [*overrides, *settings], "final_eval")
        metrics, training = read_json(root / "metrics" / "qad.json"), read_json(layout.qad / "loss.json")
        (root / "metrics" / f"qad-{name}.json").write_text((root / "metrics" / "qad.json").read_text())
        low, high = metrics["median_recovery_ci"]
        print(f"qad {name} ({' '.join(settings) or 'defaults'}) from {metrics['recipe']}: "
              f"{100 * metrics['median_recovery']:.2f} % [{100 * low:.2f}-{100 * high:.2f}], KL "
              f"{metrics['kl_divergence']:.4f} (PTQ {100 * metrics['ptq_median_recovery']:.2f} %); {metrics['steps']} steps "
              f"in {training['seconds']:.0f} s (stage {seconds:.0f} s), KD loss {training['first_loss']:.5f} -> "
              f"{training['final_loss']:.5f}, learned scales: {training.get('learned_scales', 0)} quantizers", flush=True)
        export(root, layout, [*overrides, *settings], "qad", f"qad-{name}")


def export(root: Path, layout: Layout, overrides: list[str], source: str, name: str) -> None:
    """Export `source` (ptq/<recipe> or qad) with its checks and the serving check; print each verdict."""
    shutil.rmtree(layout.export, ignore_errors=True)  # the previous export: one at a time here
    seconds, error = stage(root, [*overrides, f"export.source={source}"], "export", check=False)
    if error:  # verification failed: nothing was put in place, the reason is the error line
        print(f"export {name}: FAILED in {seconds:.0f} s: {error}", flush=True)
        return
    result = read_json(root / "metrics" / "export.json")
    (root / "metrics" / f"export-{name}.json").write_text((root / "metrics" / "export.json").read_text())
    serving = result.get("serving_check") or {}
    views = (result["checks"].get("serving") or {}).get("views") or {}
    kl = ", ".join(f"{v} KL {views[v]['kl_divergence']:.4f} top-1 {views[v]['top1_agreement'] or 0:.3f}"
                   for v in sorted(views) if views[v])
    checks = ", ".join(f"{n} {c['passed']}" for n, c in result["checks"].items())
    print(f"export {name}: passed {result['passed']} in {seconds:.0f} s; checks {checks}; serving level "
          f"{serving.get('level')}: {kl}", flush=True)


if __name__ == "__main__":
    main()
