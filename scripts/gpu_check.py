"""GPU check on a CUDA machine, through the shell script: bash scripts/gpu_check.sh

Directly (the wheels of scripts/gpu_wheels.txt importable): python scripts/gpu_check.py
[--device cpu --tiny] [--models demo llama] [--recipes NAME ...] [--work DIR] [--budget-s 510]
[--scale-s 150] [--skip-parity].

Runs the pipeline's stage cores in this one process, with no Prefect, MLflow or DVC, on the
device `--device` names (params.yaml's defaults with `hardware.device` set to it):

  env       versions; requirements of the carried wheels and of the project that this machine
            does not meet (printed, not fatal); the imports every stage needs
  parity    scripts/gpu_nvfp4_parity.py: the CPU NVFP4 kernels against Model Optimizer's
            Triton/CUDA ones, every mismatch classified (CUDA only)
  then for the demo model and a ~100M-parameter Llama built from a config (random weights):
  build, calibration, baseline, ptq:<recipe> for every recipe (an alias recipe says which it
  repeats), forward (BF16, fake-quantized, and with the weights folded as evaluations run: the
  same logits, each PTQ checkpoint restored), selection, the BPE sweep at two budgets derived
  from the model's smallest feasible one ("sweep budgets", sweep_search, sweep:<budget>,
  bpe_sweep), qad (a few steps: tokens/s and model-FLOPs utilisation against the GPU's dense
  BF16 peak), final_eval, qad_cached (the teacher_cache stage, then the same QAD reading it
  instead of a teacher), export (its serving check only where a vLLM environment exists: this
  machine has none unless QAD_VLLM_ENV points at one; it says so)
  last, qad_throughput: benchmarks/qad_throughput.py, QAD of a ~1B Llama at sequence 4096 (tokens/s,
  MFU, a profile of the step); `--scale-s` seconds are kept for it (on a CPU: its --quick run)

Each stage prints its wall time, its peak GPU memory and what it measured; a stage whose inputs
failed is skipped. When QAD fails, export runs on the PTQ student so that it is checked anyway.
The run stops starting stages after `--budget-s` seconds (the models' stages `--scale-s` earlier).
Exit code 0 only when every stage ran and passed; the summary is also written to
<work>/summary.json. Nothing in CI runs this.
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

PROJECT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))  # its harness beside it
from gpu_check_env import env_stage, parity_stage  # noqa: E402
from gpu_check_harness import Check, Result  # noqa: E402

# --tiny (the CPU dry run): the tests' settings (tests/conftest.py TINY) and a small Llama
TINY_LLAMA = {"layers": 2, "hidden": 256, "vocab": 8192}
QAD_STEPS = 20  # enough steps for a tokens/s figure past the first step's warm-up
# The BPE sweep's two points, as fractions of the range from the checked model's smallest feasible
# budget to 16 bits: fixed budgets are infeasible on some models (5.0 on the 100M Llama, whose
# smallest is 5.89 with its attention in BF16).
SWEEP_FRACTIONS = (0.05, 0.2)


def bf16_peak(device: str) -> float | None:
    """The dense BF16 FLOP/s of this machine's GPU, when qad_pipeline.core.targets knows it by name."""
    if device != "cuda":
        return None
    import torch

    from qad_pipeline.core.targets import GPUS

    name = torch.cuda.get_device_name()
    return next((flops for gpu, (_, flops) in GPUS.items() if gpu in name.upper()), None)


def import_project() -> None:
    """Make the project's packages (`qad_pipeline`, `tasks`, `flows`) importable from this checkout,
    installed or not: each is the folder of its name at the project root."""
    sys.path.insert(0, str(PROJECT))


# -- one model through the stages ---------------------------------------------------------------


def sweep_params(params, recipe_dir: Path):
    """`params` with the BPE sweep's budgets derived from this model's smallest feasible budget
    (Model Optimizer's own feasibility check, `autoquant.minimum_budget`), its recipe's own budget
    set to the first of them: a copy of the recipe folder in `recipe_dir`, the copy read instead."""
    import shutil

    import yaml

    from qad_pipeline.nvfp4 import autoquant
    from qad_pipeline.core.config import budget_name

    source = params.recipe_path(params.sweep.recipe)
    low = autoquant.minimum_budget(autoquant.load_recipe(source), params.base_model)
    budgets = [round(low + f * (16 - low), 2) for f in SWEEP_FRACTIONS]
    shutil.copytree(source.parent, recipe_dir, dirs_exist_ok=True)
    recipe = yaml.safe_load(source.read_text())
    recipe["auto_quantize"]["effective_bits"] = budgets[0]
    (recipe_dir / source.name).write_text(yaml.safe_dump(recipe, sort_keys=False))
    sweeping = params.model_copy(update={
        "sweep": params.sweep.model_copy(update={"budgets": budgets}),
        "ptq": params.ptq.model_copy(update={"recipe_dir": str(recipe_dir.resolve())}),
    })
    return sweeping, (f"smallest feasible budget {low:g} bits on this model: sweep at "
                      f"{', '.join(budget_name(b) for b in budgets)}")


def forward_ms(model, batch) -> float:
    """Median forward time in ms: 10 timed passes after 2 warm-ups on CUDA, 3 after 1 on a CPU."""
    import torch

    sync = torch.cuda.synchronize if batch.is_cuda else (lambda: None)
    warmups, repeats = (2, 10) if batch.is_cuda else (1, 3)
    with torch.no_grad():
        for _ in range(warmups):
            model(input_ids=batch)
        times = []
        for _ in range(repeats):
            sync()
            t0 = time.perf_counter()
            model(input_ids=batch)
            sync()
            times.append((time.perf_counter() - t0) * 1000)
    return statistics.median(times)


def run_model(check: Check, tag: str, model_path: Path | None, overrides: list[str], work: Path, tiny: bool) -> None:
    """Every stage on one base model, into the out-root <work>/<tag>."""
    import torch

    from qad_pipeline.core.config import DEFAULT_PARAMS, load_params
    from qad_pipeline.core.layout import Layout
    from qad_pipeline.plan.memory import settled_here
    from qad_pipeline.results.base import read_result
    from qad_pipeline.results.export_metrics import ExportMetrics

    if model_path is None:  # the ~100M Llama, built from a config
        folder = work / "llama-100m"

        def build():
            spec = importlib.util.spec_from_file_location("bench_models", PROJECT / "benchmarks" / "models.py")
            models = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(models)
            models.build_llama(folder, **(TINY_LLAMA if tiny else {}))
            from safetensors import safe_open

            with safe_open(str(folder / "model.safetensors"), "pt") as f:
                n = sum(math.prod(f.get_slice(key).get_shape()) for key in f.keys())  # noqa: SIM118
            return folder, f"{n / 1e6:.1f}M parameters at {folder}"

        model_path = check.run(tag, "build", build)
        if model_path is None:
            return
    # each `auto` (QAD's batch and GPUs, the eval batch) as `qad-pipeline stage` settles it on this machine
    params = settled_here(load_params(DEFAULT_PARAMS, [*overrides, f"base_model.path={model_path}"]))
    layout = Layout(work / tag)
    recipes = params.ptq.recipes

    def calibration():
        from qad_pipeline.core.modeling import load_tokenizer
        from tasks.calibration import build_calibration

        m = build_calibration(params, load_tokenizer(params.base_model), layout.data)
        return m, (f"{m['calibration']['samples']} x {m['calibration']['seq_len']} tokens, "
                   f"{m['eval']['ppl_samples']} eval windows")

    calibrated = check.run(tag, "calibration", calibration) is not None

    def baseline():
        from tasks.baseline import run_baseline

        m = run_baseline(params, layout.data, layout.baseline_metrics, layout.reference)
        scores = ", ".join(f"{t} {s['value']:.4g}" for t, s in m["tasks"].items())
        return m, scores

    based = check.run(tag, "baseline", baseline, calibrated) is not None

    ptq_ok = []
    for recipe in recipes:
        def ptq(recipe=recipe):
            from tasks.ptq import run_ptq

            r = run_ptq(params, recipe, layout.data, layout.reference, layout.ptq(recipe))
            if r.get("status") == "alias":  # e.g. a Mamba setting on a model without Mamba layers
                return r, f"the same model as {r['alias_of']} on this model: not run again"
            t = r["timing_s"]
            return r, (f"{r['effective_bpe']:.3f} bpe, KL {r['kl_divergence']:.4g}, "
                       f"ppl {r['tasks']['perplexity']['value']:.4g}, "
                       f"quantize {t['quantize']:.1f} s, eval {t['eval']:.1f} s")

        done = check.run(tag, f"ptq:{recipe}", ptq, based)
        if done is not None and done.get("status") != "alias":  # an alias has no checkpoint of its own
            ptq_ok.append(recipe)

    def forward():
        from qad_pipeline.core.calibration_data import load_calibration
        from qad_pipeline.core.modeling import input_device, load_model
        from qad_pipeline.nvfp4.weight_folding import folded_weights

        samples = torch.from_numpy(load_calibration(layout.data))[: params.ptq.calib_batch_size]
        model = load_model(params.base_model, params.hardware)
        batch = samples.to(input_device(model))
        bf16 = forward_ms(model, batch)
        del model
        parts, exact = [f"bf16 {bf16:.2f} ms"], True
        for recipe in ptq_ok:  # fake-quant per forward, then with the weights folded as evaluations run (goal <= x1.5)
            model = load_model(params.base_model, params.hardware, folder=layout.ptq(recipe) / "checkpoint")
            with torch.no_grad():
                ms, unfolded = forward_ms(model, batch), model(input_ids=batch).logits.float()
                with folded_weights(model):  # the same logits, bit for bit, or the stage fails
                    folded = forward_ms(model, batch)
                    diff = (model(input_ids=batch).logits - unfolded).abs().max().item()
            del model, unfolded
            exact = exact and diff == 0
            parts.append(f"{recipe} x{ms / bf16:.2f}, folded x{folded / bf16:.2f}"
                         + (f" (folded logits off by {diff:.3g})" if diff else ""))
        note = f"batch {tuple(batch.shape)}: " + ", ".join(parts)
        if not exact:
            raise RuntimeError(f"folded weights changed the logits: {note}")
        return True, note

    check.run(tag, "forward (fake-quant vs bf16)", forward, bool(ptq_ok))

    def selection():
        from tasks.selection import run_selection

        s = run_selection(params, layout)
        return s.selected, f"selected {s.selected}"

    selected = check.run(tag, "selection", selection, bool(ptq_ok))
    student = selected or (ptq_ok[0] if ptq_ok else None)

    def stage(name: str, item: str | None = None, params=params):
        from qad_pipeline.core.stages import STAGES

        return lambda: (True, STAGES[name].run(params, layout, item) or "done")

    sweeping = check.run(tag, "sweep budgets", lambda: sweep_params(params, work / tag / "recipes"))
    searched = sweeping is not None and check.run(tag, "sweep_search", stage("sweep_search", params=sweeping),
                                                  calibrated) is not None
    points = [budget for budget in (sweeping.sweep.points if sweeping else [])
              if check.run(tag, f"sweep:{budget}", stage("sweep", budget, sweeping), searched, based) is not None]
    check.run(tag, "bpe_sweep", stage("bpe_sweep", params=sweeping), bool(points))

    def qad():
        from tasks.qad import run_qad

        from qad_pipeline.plan.memory_model import model_shape

        r = run_qad(params, layout.ptq(student) / "checkpoint", layout.data, layout.qad, layout.qad_checkpoints)
        tokens_s = r["steps_per_second"] * r["tokens_per_step"]
        chosen = "" if selected else " (none selected: the first PTQ result)"
        # a QAD token: the teacher's forward (2 Na) and the student's forward and backward (6 Na)
        peak = bf16_peak(params.hardware.device)
        mfu = (f"MFU {tokens_s * 8 * model_shape(params.base_model).active_matrix_params / peak:.1%} of "
               f"{peak / 1e12:.0f} TFLOP/s" if peak else "MFU n/a (no known GPU peak)")
        return r, (f"student {student}{chosen}, {r['steps']} steps, {tokens_s:.0f} tokens/s (first step included), "
                   f"{mfu}, KD loss {r['first_loss']:.4g} -> {r['final_loss']:.4g}")

    trained = check.run(tag, "qad", qad, student is not None) is not None
    check.run(tag, "final_eval", stage("final_eval"), trained)

    def qad_cached():  # the cached teacher: the teacher_cache stage, then QAD reading it (no teacher loaded)
        from tasks.qad import run_qad
        from tasks.teacher_cache import main as write_teacher_cache
        cached = params.model_copy(update={"qad": params.qad.model_copy(update={"teacher": "cached"})})
        written = write_teacher_cache(cached, layout)
        r = run_qad(cached, layout.ptq(student) / "checkpoint", layout.data, layout.root / "artifacts" / "qad_cached",
                    layout.root / "artifacts" / "qad_cached_checkpoints", teacher_cache=layout.teacher_cache)
        tokens_s = r["steps_per_second"] * r["tokens_per_step"]
        return r, f"{written}; QAD {tokens_s:.0f} tokens/s, KD loss {r['first_loss']:.4g} -> {r['final_loss']:.4g}"

    check.run(tag, "qad_cached", qad_cached, student is not None)

    def export():
        from qad_pipeline.checks.vllm_setup import vllm_env
        from tasks.export import run_export

        source = "QAD student"
        extra = [] if (vllm_env() / "bin" / "python").is_file() else ["export.serving_check=skip"]
        serving = ("serving check skipped: no vLLM environment here (QAD_VLLM_ENV)" if extra
                   else f"serving check in {vllm_env()}")
        exporting = load_params(DEFAULT_PARAMS, [*overrides, f"base_model.path={model_path}", *extra])
        if not trained:  # export the PTQ student instead, so that export is checked on this device anyway
            exporting = load_params(DEFAULT_PARAMS, [*overrides, f"base_model.path={model_path}", *extra,
                                                     f"export.source=ptq/{student}"])
            source = f"PTQ student {student} (QAD failed)"
        m = run_export(exporting, layout)
        reload = m["checks"]["reload"]
        return m, (f"{source}: {m['size_bytes'] / 1e6:.2f} MB, x{m['size_ratio']:.2f} vs bf16, "
                   f"{m['effective_bpe']:.3f} bpe, reload KL {reload['kl_divergence']:.2e}; {serving}")

    check.run(tag, "export", export, student is not None)
    exported = read_result(layout.export_metrics, ExportMetrics, missing_ok=True)
    if exported is not None and not exported.passed:
        print(f"    export checks: {exported.checks}")


def scale_stage(work: Path, device: str, seconds: float):
    """benchmarks/qad_throughput.py in a subprocess: QAD of a ~1B Llama at sequence 4096 on this GPU
    (live and cached teacher, and the BF16 student without fake quantization), tokens/s and MFU; on a
    CPU its `--quick` smoke run. Its lines and JSON go to <work>/qad_throughput.{log,json}."""
    import json
    import subprocess

    out, log = work / "qad_throughput.json", work / "qad_throughput.log"
    command = [sys.executable, str(PROJECT / "benchmarks" / "qad_throughput.py"), "--out", str(out),
               "--budget-s", f"{max(seconds, 1):.0f}", *(["--device", "cuda"] if device == "cuda" else ["--quick"])]
    with log.open("w") as fh:
        code = subprocess.run(command, cwd=PROJECT, stdout=fh, stderr=subprocess.STDOUT).returncode
    lines = log.read_text().splitlines()
    shown = [line for line in lines if line.startswith(("qad_throughput:", "micro-batch", "fake quantization"))
             or (line.startswith("[") and ("tokens/s" in line or "host syncs" in line or "ranges_ms" in line))]
    print("\n".join(f"    {line}" for line in shown))
    if code != 0 or not out.is_file():
        raise RuntimeError(f"qad_throughput.py exit {code}: {lines[-1] if lines else 'no output'} (log: {log})")
    modes = json.loads(out.read_text())["modes"]
    if not modes:
        raise RuntimeError(f"qad_throughput.py ran no mode (log: {log})")
    return modes, "; ".join(f"{m['mode']} {m['tokens_per_s']:,.0f} tokens/s"
                            + (f", MFU {m['mfu']:.1%}" if m.get("mfu") is not None else "") for m in modes)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--tiny", action="store_true", help="the tests' small settings (for a dry run on a CPU)")
    ap.add_argument("--models", nargs="+", choices=["demo", "llama"], default=["demo", "llama"])
    ap.add_argument("--work", type=Path, default=None, help="out-roots, logs and summary.json [default: a temp folder]")
    ap.add_argument("--budget-s", type=float, default=510.0, help="start no stage after this many seconds")
    ap.add_argument("--recipes", nargs="+", default=None, help="only these of ptq.recipes [default: all]")
    ap.add_argument("--skip-parity", action="store_true")
    ap.add_argument("--scale-s", type=float, default=150.0,
                    help="seconds kept for the ~1B QAD benchmark at the end (0: not run)")
    args = ap.parse_args()

    for key in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE", "TQDM_DISABLE",
                "HF_DATASETS_DISABLE_PROGRESS_BARS", "HF_HUB_DISABLE_PROGRESS_BARS"):
        os.environ.setdefault(key, "1")
    work = args.work or Path(tempfile.mkdtemp(prefix="qad-gpu-check-"))
    work.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(work / "torch_extensions"))  # parity's builds, reused
    import_project()

    check = Check(args.device == "cuda", args.budget_s - args.scale_s)  # the models' stages stop in time for it
    print(f"GPU check: device {args.device}, models {args.models}, work {work}, budget {args.budget_s:.0f} s",
          flush=True)
    try:
        env_ok = check.run("-", "env", lambda: env_stage(args.device)) is not None
        if args.device != "cuda" or args.skip_parity:
            check.record(Result("-", "parity", "n/a", note="needs CUDA" if args.device != "cuda" else "--skip-parity"))
        else:
            check.run("-", "parity", lambda: parity_stage(work), env_ok)
        overrides = [f"hardware.device={args.device}", f"qad.steps={QAD_STEPS}",
                     f"qad.checkpoint_every={QAD_STEPS // 2}", "qad.warmup_steps=2"]
        if args.tiny:
            from tests.conftest import TINY

            overrides = [*TINY, f"hardware.device={args.device}"]
        if args.recipes:
            overrides.append(f"ptq.recipes=[{', '.join(args.recipes)}]")
        for tag in args.models:
            if env_ok:
                run_model(check, tag, PROJECT / "demo" / "model" if tag == "demo" else None, overrides, work, args.tiny)
            else:
                check.skip(tag, "all stages", "env failed")
        if args.scale_s > 0:
            check.budget_s = args.budget_s  # the benchmark starts whatever the models left; it stops itself
            # its last mode starts a minute before the budget ends
            check.run("1b", "qad_throughput", lambda: scale_stage(work, args.device, args.budget_s - check.elapsed() - 60),
                      env_ok)
    except KeyboardInterrupt:  # the shell script's hard time limit
        check.record(Result("-", "interrupted", "FAIL", note=f"stopped by the time limit (SIGINT) in {check.current}"))
        check.summary(work / "summary.json")
        return 124
    return check.summary(work / "summary.json")


if __name__ == "__main__":
    sys.exit(main())
