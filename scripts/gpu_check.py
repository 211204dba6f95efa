"""GPU check on a CUDA machine, through the shell script: bash scripts/gpu_check.sh

Directly (the wheels of scripts/gpu_wheels.txt importable): python scripts/gpu_check.py
[--device cpu --tiny] [--models demo llama] [--recipes NAME ...] [--work DIR] [--budget-s 450].

Runs the pipeline's stage cores in this one process, with no Prefect, MLflow or DVC, on the
device `--device` names (params.yaml's defaults with `hardware.device` set to it):

  env       versions; requirements of the carried wheels and of the project that this machine
            does not meet (printed, not fatal); the imports every stage needs
  parity    scripts/gpu_nvfp4_parity.py: the CPU NVFP4 kernels against Model Optimizer's
            Triton/CUDA ones (CUDA only)
  then for the demo model and a ~100M-parameter Llama built from a config (random weights):
  build, calibration, baseline, ptq:<recipe> for every recipe, forward (fake-quantized vs BF16
  forward time, each PTQ checkpoint restored), selection, the BPE sweep at two budgets
  (sweep_search, sweep:<budget>, bpe_sweep), qad (a few steps: tokens/s and model-FLOPs
  utilisation against the GPU's dense BF16 peak), final_eval, qad_cached (the teacher_cache stage,
  then the same QAD reading it instead of a teacher), export (its serving check only where
  a vLLM environment exists: this machine has none unless QAD_VLLM_ENV points at one; it says so)

Each stage prints its wall time, its peak GPU memory and what it measured; a stage whose inputs
failed is skipped. When QAD fails, export runs on the PTQ student so that it is checked anyway.
The run stops starting stages after `--budget-s` seconds. Exit code 0 only when every stage ran
and passed; the summary is also written to <work>/summary.json. Nothing in CI runs this.
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PROJECT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))  # its harness beside it
from gpu_check_harness import Check, Result  # noqa: E402

# --tiny (the CPU dry run): the tests' settings (tests/conftest.py TINY) and a small Llama
TINY_LLAMA = {"layers": 2, "hidden": 256, "vocab": 8192}
QAD_STEPS = 20  # enough steps for a tokens/s figure past the first step's warm-up
SWEEP_BUDGETS = "[5.0, 6.5]"  # two points of the BPE sweep


def bf16_peak(device: str) -> float | None:
    """The dense BF16 FLOP/s of this machine's GPU, when qad_pipeline.targets knows it by name."""
    if device != "cuda":
        return None
    import torch

    from qad_pipeline.targets import GPUS

    name = torch.cuda.get_device_name()
    return next((flops for gpu, (_, flops) in GPUS.items() if gpu in name.upper()), None)


def import_project() -> None:
    """Make the project's packages (`qad_pipeline`, `tasks`, `flows`) importable from this checkout,
    installed or not: each is the folder of its name at the project root."""
    sys.path.insert(0, str(PROJECT))


# -- env ----------------------------------------------------------------------------------------


def unmet_requirements(dists: list[str]) -> list[str]:
    """Requirements (extras left out) of `dists` that the installed packages do not meet."""
    from importlib import metadata

    from packaging.requirements import Requirement

    problems = []
    for dist in dists:
        try:
            requires = metadata.requires(dist) or []
        except metadata.PackageNotFoundError:
            problems.append(f"{dist}: not installed")
            continue
        for line in requires:
            req = Requirement(line)
            if req.marker is not None and not req.marker.evaluate({"extra": ""}):
                continue
            try:
                have = metadata.version(req.name)
            except metadata.PackageNotFoundError:
                problems.append(f"{dist} needs {req}: missing")
                continue
            if req.specifier and not req.specifier.contains(have, prereleases=True):
                problems.append(f"{dist} needs {req}: {have} installed")
    return problems


def wheel_names() -> list[str]:
    lines = (PROJECT / "scripts" / "gpu_wheels.txt").read_text().splitlines()
    return [line.split("#")[0].split("==")[0].strip() for line in lines if line.split("#")[0].strip()]


def env_stage(device: str):
    from importlib import metadata

    import tomllib
    import torch

    lines = [f"python {sys.version.split()[0]}, torch {torch.__version__} (CUDA {torch.version.cuda})"]
    if device == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError("torch sees no CUDA device")
        cap = torch.cuda.get_device_capability()
        lines.append(f"{torch.cuda.get_device_name()} (sm_{cap[0]}{cap[1]}), "
                     f"{torch.cuda.get_device_properties(0).total_memory / 2**30:.0f} GiB")
    for name in ("transformers", "nvidia-modelopt", "lm_eval", "datasets", "accelerate", "triton", "pydantic"):
        try:
            lines.append(f"{name} {metadata.version(name)}")
        except metadata.PackageNotFoundError:
            lines.append(f"{name} MISSING")
    import datasets  # noqa: F401
    import lm_eval  # noqa: F401
    import modelopt.torch.quantization as mtq  # noqa: F401
    from modelopt.torch.quantization import tensor_quant

    import tasks.export  # noqa: F401
    import tasks.qad  # noqa: F401
    from qad_pipeline import nvfp4_cpu

    if device == "cuda":
        if nvfp4_cpu.is_installed():
            raise RuntimeError("the CPU NVFP4 emulation is installed on a CUDA machine")
        if not tensor_quant.triton_kernel.IS_AVAILABLE:
            raise RuntimeError("Model Optimizer's Triton kernels are not available")
        lines.append("Model Optimizer's Triton NVFP4 kernels available; CPU emulation not installed")
    pyproject = tomllib.loads((PROJECT / "pyproject.toml").read_text())
    wanted = pyproject["project"]["dependencies"]
    from packaging.requirements import Requirement

    project_unmet = []
    for line in wanted:
        req = Requirement(line)
        try:
            have = metadata.version(req.name)
        except metadata.PackageNotFoundError:
            project_unmet.append(f"{req.name} (missing)")
            continue
        if req.specifier and not req.specifier.contains(have, prereleases=True):
            project_unmet.append(f"{req.name} {have} (wants {req.specifier})")
    carried = unmet_requirements(wheel_names())
    print("\n".join(f"    {line}" for line in lines))
    print("    project requirements not met here (the check runs without them):", ", ".join(project_unmet) or "none")
    print("    carried wheels' requirements not met here:" + ("".join(f"\n      {p}" for p in carried) or " none"))
    return True, "; ".join(lines[:2])


# -- parity -------------------------------------------------------------------------------------


def parity_stage(work: Path):
    log = work / "parity.log"
    with log.open("w") as fh:
        code = subprocess.run([sys.executable, str(PROJECT / "scripts" / "gpu_nvfp4_parity.py")], cwd=PROJECT,
                              stdout=fh, stderr=subprocess.STDOUT).returncode
    lines = log.read_text().splitlines()
    shown = [line for line in lines if "MISMATCH" in line][:20] + lines[-3:]
    print("\n".join(f"    {line}" for line in shown))
    summary = next((line for line in reversed(lines) if " cases, " in line), lines[-1] if lines else "no output")
    if code != 0:
        raise RuntimeError(f"gpu_nvfp4_parity.py exit {code}: {summary} (full output: {log})")
    return True, summary


# -- one model through the stages ---------------------------------------------------------------


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

    from qad_pipeline.config import DEFAULT_PARAMS, load_params
    from qad_pipeline.layout import Layout
    from qad_pipeline.results.base import read_result
    from qad_pipeline.results.export import ExportMetrics

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
    params = load_params(DEFAULT_PARAMS, [*overrides, f"base_model.path={model_path}"])
    layout = Layout(work / tag)
    recipes = params.ptq.recipes

    def calibration():
        from qad_pipeline.modeling import load_tokenizer
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
            t = r["timing_s"]
            return r, (f"{r['effective_bpe']:.3f} bpe, KL {r['kl_divergence']:.4g}, "
                       f"ppl {r['tasks']['perplexity']['value']:.4g}, "
                       f"quantize {t['quantize']:.1f} s, eval {t['eval']:.1f} s")

        if check.run(tag, f"ptq:{recipe}", ptq, based) is not None:
            ptq_ok.append(recipe)

    def forward():
        from qad_pipeline.calibration_data import load_calibration
        from qad_pipeline.modeling import input_device, load_model

        samples = torch.from_numpy(load_calibration(layout.data))[: params.ptq.calib_batch_size]
        model = load_model(params.base_model, params.hardware)
        batch = samples.to(input_device(model))
        bf16 = forward_ms(model, batch)
        del model
        parts = [f"bf16 {bf16:.2f} ms"]
        for recipe in ptq_ok:
            model = load_model(params.base_model, params.hardware, folder=layout.ptq(recipe) / "checkpoint")
            ms = forward_ms(model, batch)
            del model
            parts.append(f"{recipe} x{ms / bf16:.2f}")
        return True, f"batch {tuple(batch.shape)}: " + ", ".join(parts)

    check.run(tag, "forward (fake-quant vs bf16)", forward, bool(ptq_ok))

    def selection():
        from tasks.selection import run_selection

        s = run_selection(params, layout)
        return s.selected, f"selected {s.selected}"

    selected = check.run(tag, "selection", selection, bool(ptq_ok))
    student = selected or (ptq_ok[0] if ptq_ok else None)

    def stage(name: str, item: str | None = None):
        from qad_pipeline.stages import STAGES

        return lambda: (True, STAGES[name].run(params, layout, item) or "done")

    searched = check.run(tag, "sweep_search", stage("sweep_search"), calibrated) is not None
    points = [budget for budget in params.sweep.points
              if check.run(tag, f"sweep:{budget}", stage("sweep", budget), searched, based) is not None]
    check.run(tag, "bpe_sweep", stage("bpe_sweep"), bool(points))

    def qad():
        from tasks.qad import run_qad

        from qad_pipeline.memory_model import model_shape

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
        from qad_pipeline.serving import vllm_env
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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--tiny", action="store_true", help="the tests' small settings (for a dry run on a CPU)")
    ap.add_argument("--models", nargs="+", choices=["demo", "llama"], default=["demo", "llama"])
    ap.add_argument("--work", type=Path, default=None, help="out-roots, logs and summary.json [default: a temp folder]")
    ap.add_argument("--budget-s", type=float, default=450.0, help="start no stage after this many seconds")
    ap.add_argument("--recipes", nargs="+", default=None, help="only these of ptq.recipes [default: all]")
    ap.add_argument("--skip-parity", action="store_true")
    args = ap.parse_args()

    for key in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE", "TQDM_DISABLE",
                "HF_DATASETS_DISABLE_PROGRESS_BARS", "HF_HUB_DISABLE_PROGRESS_BARS"):
        os.environ.setdefault(key, "1")
    work = args.work or Path(tempfile.mkdtemp(prefix="qad-gpu-check-"))
    work.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(work / "torch_extensions"))  # parity's builds, reused
    import_project()

    check = Check(args.device == "cuda", args.budget_s)
    print(f"GPU check: device {args.device}, models {args.models}, work {work}, budget {args.budget_s:.0f} s",
          flush=True)
    try:
        env_ok = check.run("-", "env", lambda: env_stage(args.device)) is not None
        if args.device != "cuda" or args.skip_parity:
            check.record(Result("-", "parity", "n/a", note="needs CUDA" if args.device != "cuda" else "--skip-parity"))
        else:
            check.run("-", "parity", lambda: parity_stage(work), env_ok)
        overrides = [f"hardware.device={args.device}", f"qad.steps={QAD_STEPS}",
                     f"qad.checkpoint_every={QAD_STEPS // 2}", "qad.warmup_steps=2", f"sweep.budgets={SWEEP_BUDGETS}"]
        if args.tiny:
            from tests.conftest import TINY

            overrides = [*TINY, f"hardware.device={args.device}", f"sweep.budgets={SWEEP_BUDGETS}"]
        if args.recipes:
            overrides.append(f"ptq.recipes=[{', '.join(args.recipes)}]")
        for tag in args.models:
            if env_ok:
                run_model(check, tag, PROJECT / "demo" / "model" if tag == "demo" else None, overrides, work, args.tiny)
            else:
                check.skip(tag, "all stages", "env failed")
    except KeyboardInterrupt:  # the shell script's hard time limit
        check.record(Result("-", "interrupted", "FAIL", note=f"stopped by the time limit (SIGINT) in {check.current}"))
        check.summary(work / "summary.json")
        return 124
    return check.summary(work / "summary.json")


if __name__ == "__main__":
    sys.exit(main())
