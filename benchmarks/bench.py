"""Benchmark the pipeline: `python benchmarks/bench.py [--out-root DIR]`.

Prints, on the bundled demo model with the params.yaml defaults:
  * the wall time of each stage of one whole pipeline run (recipes in parallel);
  * the baseline + five recipes phase in parallel versus one recipe after another;
  * the peak resident memory of each PTQ worker process;
  * the forward time of the fake-quantized model versus the BF16 model;
  * QAD steps per second and the exported checkpoint's size ratio versus BF16;
  * the time of a no-op `dvc repro` (nothing changed) in a DVC project of the pipeline;
  * the five recipes' wall time as `ptq-recipe` flow runs on two process workers versus one,
    against a real local Prefect server (`prefect deployment run qad-pipeline/default`);
  * `llama`: the whole DAG with params.yaml's defaults (`ptq.max_parallel: auto` included) on a
    ~100M-parameter Llama with a 32K vocabulary built from a config (benchmarks/models.py), with
    each stage's wall time and measured peak memory against the memory plan's estimate;
  * `real`: the whole DAG with the defaults on a real pretrained model, SmolLM2-135M-Instruct
    (benchmarks/real_model.py; `selection.band=[0.5, 0.99]`: a 135M model loses far more than 5 %
    to W4A4), then every PTQ recipe's checkpoint exported through the same checks
    (`export.source=ptq/<recipe>`): per recipe and for the QAD student, the export checks' figures.

`--parts flow dvc workers llama real` picks parts (default: all but real). `--llama-set section.key=value`
(repeatable) adds overrides to the `llama` run, e.g. `eval.limit=50` to fit a 2-core machine's
session (the item count per task changes the eval's length, not its peak memory).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/devstack.py: the local stack

from qad_pipeline.core.artifacts import read_json
from qad_pipeline.core.config import PROJECT_PARAMS, load_params
from qad_pipeline.core.layout import Layout
from qad_pipeline.results.base import read_result
from qad_pipeline.results.scores import PTQResult, PTQScores


def run_flow(root: Path, overrides: list[str]) -> dict:
    from flows.pipeline import qad_pipeline

    return qad_pipeline(params_file=str(PROJECT_PARAMS), overrides=overrides, out_root=str(root))


def forward_ms(model, batch: torch.Tensor, repeats: int = 5) -> float:
    times = []
    with torch.no_grad():
        model(input_ids=batch)  # warm-up
        for _ in range(repeats):
            t0 = time.perf_counter()
            model(input_ids=batch)
            times.append((time.perf_counter() - t0) * 1000)
    return statistics.median(times)


def forward_times(params, layout: Layout) -> dict[str, float]:
    import qad_pipeline  # noqa: F401
    from qad_pipeline.core.calibration_data import load_calibration
    from qad_pipeline.core.modeling import load_model
    from tasks.ptq import quantize_model

    samples = torch.from_numpy(load_calibration(layout.data))
    batch = samples[: params.ptq.calib_batch_size]
    out = {"bf16": forward_ms(load_model(params.base_model, params.hardware), batch)}
    for recipe in (params.ptq.recipes[0], params.ptq.recipes[-1]):
        model = load_model(params.base_model, params.hardware)
        quantize_model(model, params.recipe_path(recipe), samples, params.ptq.calib_batch_size)
        out[recipe] = forward_ms(model, batch)
    return out


def dvc_noop(root: Path, repeats: int = 3) -> None:
    """A DVC project with the tests' small settings (the no-op time depends on the number of stages
    and files, not on the settings), one full `dvc repro`, then `repeats` timed no-op ones."""
    from tests.devstack import make_dvc_project, sh

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from tests.conftest import TINY

    repo = make_dvc_project(root / "dvc-project", [*TINY], root / "dvc-remote")
    started = time.perf_counter()
    sh(repo, "dvc", "repro")
    full = time.perf_counter() - started
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        out = sh(repo, "dvc", "repro").stdout
        times.append(time.perf_counter() - started)
        assert "Running stage" not in out, out
    print("\n== dvc repro (small settings, 5 recipes, 11 stages) ==")
    print(f"full run: {full:8.1f} s (stages one after another)")
    print(f"no-op:    {statistics.median(times):8.2f} s (median of {repeats}; nothing re-ran)")


def recipes_on_workers(root: Path, workers: int, recipes: list[str]) -> tuple[float, float]:
    """One `qad-pipeline/default` deployment run (PTQ half) with `workers` GPU process workers:
    (wall time from the first recipe run's start to the last one's end, whole run) in seconds."""
    from tests.devstack import LocalPrefect

    threads = str(max(1, (os.cpu_count() or 1) // workers))
    with LocalPrefect(root / f"prefect-{workers}") as stack:
        stack.worker("qad-control", "control", limit=2)
        for gpu in range(workers):
            stack.worker("qad-gpu", f"gpu-{gpu}", {"CUDA_VISIBLE_DEVICES": str(gpu), "OMP_NUM_THREADS": threads})
        stack.deploy()
        run = stack.wait(stack.run("qad-pipeline/default", {
            "out_root": str(root / f"workers-{workers}"),
            "overrides": ["selection.policy=ptq_final", "export.source=none"]}), timeout=3600)
        assert run.state.is_completed(), run.state.message
        children = [r for r in stack.flow_runs("ptq-recipe") if r.state.is_completed()]
        assert len(children) == len(recipes), [r.name for r in children]
        wall = max(r.end_time for r in children) - min(r.start_time for r in children)
        return wall.total_seconds(), (run.end_time - run.start_time).total_seconds()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out-root", type=Path, default=None)
    ap.add_argument("--parts", nargs="+", choices=["flow", "dvc", "workers", "llama", "real"],
                    default=["flow", "dvc", "workers", "llama"])
    ap.add_argument("--llama-set", action="append", default=[], metavar="KEY=VALUE",
                    help="an extra override for the llama run (repeatable)")
    args = ap.parse_args()
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "300")  # a busy machine
    root = args.out_root or Path(tempfile.mkdtemp(prefix="qad-bench-"))
    params = load_params()
    if "flow" in args.parts:
        flow_figures(root, params)
    if "dvc" in args.parts:
        dvc_noop(root)
    if "workers" in args.parts:
        n = len(params.ptq.recipes)
        print(f"\n== {n} PTQ recipes as ptq-recipe flow runs on process workers (demo defaults) ==")
        for workers in (1, 2):
            wall, whole = recipes_on_workers(root, workers, params.ptq.recipes)
            print(f"{workers} worker(s): recipes {wall:8.1f} s   whole run (to selection) {whole:8.1f} s")
    if "llama" in args.parts:
        llama_dag(root, args.llama_set)
    if "real" in args.parts:
        real_model_exports(root)


def llama_dag(root: Path, extra: list[str]) -> None:
    """The whole DAG on a ~100M Llama with the defaults; measured peaks (logs/*.usage.json) vs the plan."""
    from qad_pipeline.plan import memory

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from models import build_llama

    model = build_llama(root / "llama-100m")
    overrides = [f"base_model.path={model}", "selection.band=[0.01, 1.0]", *extra]  # random weights: any recipe
    params = load_params(overrides=overrides)
    estimates = {e.stage: e for e in memory.plan(params)}
    parallel = memory.recipe_parallelism(params)
    started = time.perf_counter()
    summary = run_flow(root / "llama", overrides)
    wall = time.perf_counter() - started
    layout = Layout(root / "llama")
    print(f"\n== whole DAG, {model.name} (params.yaml defaults{', ' + ' '.join(extra) if extra else ''}, "
          f"{parallel} recipes at once): {wall:.0f} s ==")
    print(f"{'stage':<42} {'seconds':>8} {'plan MB':>9} {'peak MB':>9} {'peak/plan':>9}")
    for usage_file in sorted(layout.logs.glob("*.usage.json")):
        usage = read_json(usage_file)
        key = usage["stage"].replace("ptq-", "ptq/", 1) if usage["stage"].startswith("ptq-") else usage["stage"]
        est = estimates.get(key)
        planned = est.host_bytes / 2**20 if est else float("nan")
        print(f"{usage['stage']:<42} {usage['seconds']:8.1f} {planned:9.0f} {usage['peak_rss_mb']:9.0f} "
              f"{usage['peak_rss_mb'] / planned:9.2f}")
    print(f"failed: {summary['failed'] or 'none'}; selected: {summary['selection']['selected']}")


def real_model_exports(root: Path) -> None:
    """The whole DAG on SmolLM2-135M with the defaults, then each PTQ recipe's export; one table."""
    from qad_pipeline.results.export_metrics import ExportMetrics
    from qad_pipeline.results.scores import PTQAlias
    from tasks.export import run_export

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from real_model import build_real_model

    model = build_real_model()
    overrides = [f"base_model.path={model}", "selection.band=[0.5, 0.99]"]
    started = time.perf_counter()
    summary = run_flow(root / "real", overrides)
    print(f"\n== whole DAG, SmolLM2-135M-Instruct (params.yaml defaults, {' '.join(overrides[1:])}): "
          f"{time.perf_counter() - started:.0f} s; selected {summary['selection']['selected']} ==")
    rows = {"qad": summary.get("export")}
    for recipe in load_params(overrides=overrides).ptq.recipes:
        if isinstance(read_result(Layout(root / "real").ptq(recipe) / "scores.json", PTQResult, missing_ok=True),
                      PTQAlias):
            continue
        each = root / f"real-export-{recipe}"  # its own out-root: the run's data and checkpoints, linked
        (each / "artifacts").mkdir(parents=True, exist_ok=True)
        for folder in ("calibration", "ptq"):
            if not (each / "artifacts" / folder).exists():
                (each / "artifacts" / folder).symlink_to(root / "real" / "artifacts" / folder)
        try:
            rows[f"ptq/{recipe}"] = run_export(load_params(overrides=[*overrides, f"export.source=ptq/{recipe}"]),
                                               Layout(each))
        except Exception as err:  # noqa: BLE001  (a failed check is a row of the table)
            rows[f"ptq/{recipe}"] = read_result(Layout(each).export_metrics, ExportMetrics, missing_ok=True)
            rows[f"ptq/{recipe}"] = rows[f"ptq/{recipe}"].model_dump() if rows[f"ptq/{recipe}"] else {"error": str(err)}
    print(f"{'exported':<42} {'reload KL (max)':>17} {'w4a16 KL (max)':>17} {'top-1':>6} {'w4a4 KL (max)':>17} "
          f"{'top-1':>6} {'passed':>6}")
    for name, export in rows.items():
        if not export or "checks" not in export:
            print(f"{name:<42} {(export or {}).get('error', 'no export')[:80]}")
            continue
        reload, views = export["checks"]["reload"], export["checks"].get("serving", {}).get("views", {})

        def figure(view: dict) -> str:
            return f"{view['kl_divergence']:.4f} ({view['kl_divergence_max']:.4f}) {view['top1_agreement'] or 0:6.3f}" \
                if view else f"{'-':>17} {'-':>6}"

        print(f"{name:<42} {reload['kl_divergence']:.4f} ({reload['tolerance']:.4f}) {figure(views.get('w4a16')):>24} "
              f"{figure(views.get('w4a4')):>24} {str(export['passed']):>6}")


def flow_figures(root: Path, params) -> None:
    n = len(params.ptq.recipes)
    parallel = run_flow(root / "parallel", [f"ptq.max_parallel={n}"])
    # The second run only needs the PTQ half: policy ptq_final, nothing exported, ends the flow at selection.
    sequential = run_flow(root / "sequential", ["ptq.max_parallel=1", "selection.policy=ptq_final", "export.source=none"])

    print(f"\n== stage wall times, one run with {n} recipes in parallel (s) ==")
    for stage, s in parallel["seconds"].items():
        print(f"{stage:<45} {s:8.1f}")
    par, seq = parallel["seconds"]["up to selection (wall)"], sequential["seconds"]["up to selection (wall)"]
    print(f"\n== calibration, baseline, {n} PTQ recipes and selection ==")
    print(f"in parallel (max_parallel={n}): {par:8.1f} s")
    print(f"one after another (max_parallel=1): {seq:8.1f} s   speed-up x{seq / par:.2f} on {os.cpu_count()} CPUs")

    print("\n== PTQ worker peak memory (RSS, MB) ==")
    layout = Layout(root / "parallel")
    for recipe in params.ptq.recipes:
        scores = read_result(layout.ptq(recipe) / "scores.json", PTQResult, missing_ok=True)
        if isinstance(scores, PTQScores):  # an alias recipe did not run: no peak of its own
            print(f"{recipe:<45} {scores.peak_rss_mb:8.0f}")

    print(f"\n== forward pass, batch {params.ptq.calib_batch_size} x {params.calibration.seq_len} tokens (ms, median of 5) ==")
    times = forward_times(params, layout)
    for name, ms in times.items():
        print(f"{name:<45} {ms:8.1f}   x{ms / times['bf16']:.2f} vs bf16")

    if "qad" in parallel:
        q, e = parallel["qad"], parallel["export"]
        from qad_pipeline.plan.memory import settled_here

        ran = settled_here(params).qad  # `auto` as the run settled it on this machine
        tokens = ran.batch_size * ran.grad_accum * ran.seq_len
        print("\n== QAD and export ==")
        print(f"QAD: {q['steps_per_second']:.3f} steps/s ({q['steps_per_second'] * tokens:.0f} tokens/s, "
              f"teacher + fake-quantized student, {tokens} tokens a step)")
        print(f"export: {e['size_bytes'] / 1e6:.2f} MB vs {e['bf16_size_bytes'] / 1e6:.2f} MB BF16, "
              f"size ratio x{e['size_ratio']:.2f}, {e['effective_bpe']:.3f} bits per element")


if __name__ == "__main__":
    main()
