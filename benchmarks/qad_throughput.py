"""QAD throughput: `python benchmarks/qad_throughput.py --device cuda [--out FILE] [--modes live,cached,baseline]`.

`--device cuda`: a Llama-3.2-1B-shaped model (benchmarks/models.py `llama_1b_config`; untied, 1.50B
parameters; `--tied`: 1.24B, as released), random weights, built on the GPU. Teacher: it in BF16;
student: a float32 copy quantized with the default recipe (ptq.recipes' first: NVFP4 W4A4, lm_head
W4A16; max calibration on two random rows; `tasks/ptq.py: quantize_model`). Sequence 4096, packed
(random tokens, no padding), BF16 autocast; micro-batch: the most rows the GPU holds (measured from a
step at 1 and at 2 rows), capped by `--max-rows`, or `--rows`. Each mode runs the real QAD step
(`tasks/qad.py: train_step`, its loss read one step late as `run_qad` reads it): `--warmup` steps (the
last under CUDA's sync debug mode: host syncs), `--steps` timed steps, `--profile-steps` under
torch.profiler (ms per step by `qad.*` range and by kernel group, top kernels).

Modes (`--modes`, comma-separated): live (NVFP4 student, live teacher), cached (NVFP4 student, the
teacher_cache stage's writer run first for the windows it draws; `--cache-tail-samples` 0 by default:
the writer samples the tail on the host, ~0.5 s per 2,048 positions at a 128K vocabulary, and the step
differs only by a logsumexp for a gather), baseline (the student without quantizers: plain BF16
distillation, live teacher); suffix `:full` = the KD loss from the full logits, `:compile` =
torch.compile on each decoder block (in place: those modes run last), `:lsq` = learned block scales.

MFU = (6 N_s + 2 N_t + A) x tokens/s / peak (`qad_pipeline/core/targets.py` GPUS; H200 989 TFLOP/s dense
BF16). N: the weights of every matmul (decoder linears, output embedding; the input embedding is a
lookup), N_t = 0 with the cached teacher. A, causal attention per token: 2 x seq x heads x head_dim x
layers per forward (QK^T and AV over half the positions on average), x3 for the student (forward and
backward), x1 for a live teacher.

`--device cpu`: a tiny model (2 layers, hidden 256, vocabulary 32K, 4 x 256 tokens): one QAD step of
the real loop against a bare loop (teacher forward, student forward and backward with a plain KL,
AdamW; same fake-quantized student, same batches), medians of `--repeats` interleaved steps; also
with learned block scales. `--quick`: the cuda mode's whole path on a tiny model on the CPU (a smoke run).
"""

from __future__ import annotations

import argparse
import copy
import gc
import itertools
import json
import os
import statistics
import sys
import tempfile
import time
import warnings
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]
os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")  # before CUDA starts

import numpy as np  # noqa: E402
import torch  # noqa: E402

import qad_pipeline  # noqa: E402,F401  (on a CPU: Model Optimizer's NVFP4 kernels emulated)
from qad_pipeline.core.config import load_params  # noqa: E402
from qad_pipeline.training.distributed import World  # noqa: E402
from qad_pipeline.training.training_text import batch_indices  # noqa: E402
from models import llama_1b_config, quiet, teacher_and_student, tiny_config  # noqa: E402 (benchmarks/models.py)
from tasks.qad import QADStep, compile_blocks, host_copy, lr_lambda, train_step  # noqa: E402
from qad_pipeline.nvfp4 import learned_scales  # noqa: E402

KERNEL_GROUPS = (("fake quantization", ("fp4", "quant", "e2m1", "e4m3", "amax")),
                 ("matmul", ("gemm", "cutlass", "nvjet", "sm90", "xmma", "cublas", "matmul")),
                 ("attention", ("flash", "fmha", "attention", "sdpa", "cudnn")))


def matmul_params(model) -> int:
    """Weights of every Linear (the output embedding included; the input embedding's lookup not)."""
    return sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))


def flops_per_token(config, seq: int, n_student: int, n_teacher: int) -> dict:
    attention = 2 * seq * config.num_attention_heads * config.head_dim * config.num_hidden_layers  # one forward
    parts = {"student_6N": 6 * n_student, "teacher_2N": 2 * n_teacher,
             "attention": 3 * attention + (attention if n_teacher else 0)}
    return {**parts, "total": sum(parts.values())}


def qad_params(rows: int, seq: int, steps: int, teacher: str, tail_samples: int = 32):
    return load_params(overrides=[f"qad.batch_size={rows}", "qad.grad_accum=1", f"qad.seq_len={seq}",
                                  f"qad.steps={steps}", "qad.warmup_steps=0", f"qad.teacher={teacher}",
                                  "qad.temperature=1.0", f"qad.teacher_tail_samples={tail_samples}"])


def make_step(params, student, teacher, cache, device: torch.device, chunked: bool) -> QADStep:
    """A QADStep as run_qad builds it on one process (AdamW fused on a GPU)."""
    q = params.qad
    optimizer = torch.optim.AdamW([p for p in student.parameters() if p.requires_grad], lr=q.lr,
                                  weight_decay=q.weight_decay, fused=device.type == "cuda" or None)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(q))
    return QADStep(q, student, optimizer, scheduler, device, teacher if cache is None else None, device, cache,
                   World(), False, "bfloat16" if device.type == "cuda" else "float32", chunked)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_steps(step: QADStep, windows, stream, n: int) -> list[float]:
    """`n` optimizer steps, each loss waited for one step late (as run_qad reads it); the losses."""
    pending = []
    for i in range(n):
        pending.append(host_copy(train_step(step, windows, stream)))
        if i and pending[-2][1] is not None:
            pending[-2][1].synchronize()  # the previous step's copy, not this step's work
    for _, event in pending[-1:]:
        if event is not None:
            event.synchronize()
    return [value[0].item() for value, _ in pending]  # [loss, gradient norm]


def host_syncs(step: QADStep, windows, stream) -> dict:
    """One step under CUDA's sync debug mode: the synchronizing operations, by where Python called them."""
    if step.student_device.type != "cuda":
        run_steps(step, windows, stream, 1)
        return {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            run_steps(step, windows, stream, 1)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return dict(Counter(f"{Path(w.filename).name}:{w.lineno}" for w in caught if "synchroniz" in str(w.message)))


def profile(step: QADStep, windows, stream, n: int) -> dict:
    """Milliseconds per step by record_function range (tasks/qad.py's `qad.*`) and by kernel group."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity

    cuda = step.student_device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with torch.profiler.profile(activities=activities) as prof:
        run_steps(step, windows, stream, n)
        synchronize(step.student_device)
    ranges, kernels, runtime = Counter(), Counter(), Counter()
    for e in prof.events():
        on_device = e.device_type == DeviceType.CUDA
        if e.name.startswith("qad."):
            ranges[f"{e.name} ({'gpu' if on_device else 'cpu'})"] += e.time_range.elapsed_us() / 1e3 / n
        elif on_device:
            kernels[e.name] += e.time_range.elapsed_us() / 1e3 / n
        elif e.name.startswith("cuda") and "ynchronize" in e.name or e.name == "cudaMemcpy":
            runtime[e.name] += 1 / n
    groups = Counter()
    for name, ms in kernels.items():
        group = next((g for g, keys in KERNEL_GROUPS if any(k in name.lower() for k in keys)), "other kernels")
        groups[group] += ms
    top = [(name[:90], round(ms, 2)) for name, ms in kernels.most_common(12)]
    return {"ranges_ms": {k: round(v, 2) for k, v in sorted(ranges.items())},
            "kernel_groups_ms": {k: round(v, 2) for k, v in groups.most_common()},
            "top_kernels_ms": top, "sync_calls_per_step": dict(runtime)}


def peak_memory(device: torch.device) -> int | None:
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None


def reset_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def choose_rows(args, teacher, student, windows, device) -> tuple[int, dict]:
    """The most rows of `args.seq` tokens a live step fits in 88 % of the GPU's memory, measured."""
    if args.rows:
        return args.rows, {"chosen_by": "--rows"}
    peaks = {}
    for rows in (1, 1, 2):  # the first step allocates AdamW's state
        step = make_step(qad_params(rows, args.seq, 3, "live"), student, teacher, None, device, True)
        reset_memory(device)
        run_steps(step, windows, itertools.repeat(np.arange(rows)), 1)
        peaks[rows] = peak_memory(device)
        del step
    if device.type != "cuda":
        return args.min_rows, {"chosen_by": "no GPU memory to measure: --min-rows"}
    per_row, total = peaks[2] - peaks[1], torch.cuda.get_device_properties(device).total_memory
    fixed = peaks[1] - per_row
    fits = int((0.88 * total - fixed) // max(per_row, 1))
    rows = max(args.min_rows, min(args.max_rows, fits))
    return rows, {"chosen_by": "measured", "gib_per_row": per_row / 2**30, "gib_fixed": fixed / 2**30,
                  "rows_that_fit": fits, "gpu_gib": total / 2**30}


def run_mode(mode: str, args, models: dict, windows, device, rows: int, peak_flops: float | None) -> dict:
    name, _, option = mode.partition(":")
    student = models["baseline" if name == "baseline" else "student"]
    steps = args.warmup + args.steps + args.profile_steps
    cache = None
    if name == "cached":
        cache, written_s = write_cache(models["teacher"], windows,
                                       qad_params(rows, args.seq, steps, "cached", args.cache_tail_samples))
    if option == "compile":
        for model in (student, models["teacher"]):
            compile_blocks(model)
    if option == "lsq" and learned_scales.enable(student := copy.deepcopy(student), "lsq") == 0:
        raise RuntimeError("no NVFP4 weight quantizer to learn scales for")  # a copy: the others keep the plain student
    params = qad_params(rows, args.seq, steps, "cached" if cache else "live", args.cache_tail_samples)
    step = make_step(params, student, models["teacher"], cache, device, chunked=option != "full")
    stream = batch_indices(len(windows), rows, params.qad.seed)
    reset_memory(device)
    started = time.perf_counter()
    run_steps(step, windows, stream, max(0, args.warmup - 1))
    syncs = host_syncs(step, windows, stream) if args.warmup else {}
    warm_s = time.perf_counter() - started
    synchronize(device)
    started = time.perf_counter()
    losses = run_steps(step, windows, stream, args.steps)
    synchronize(device)
    seconds = time.perf_counter() - started
    breakdown = profile(step, windows, stream, args.profile_steps) if args.profile_steps else {}
    tokens_s = args.steps * rows * args.seq / seconds
    flops = flops_per_token(models["config"], args.seq, matmul_params(student), 0 if cache else models["n_teacher"])
    result = {"mode": mode, "tokens_per_s": tokens_s, "step_s": seconds / args.steps, "warmup_s": warm_s,
              "mfu": tokens_s * flops["total"] / peak_flops if peak_flops else None, "flops_per_token": flops,
              "peak_memory_gib": (peak_memory(device) or 0) / 2**30 or None, "losses": losses,
              "host_syncs_in_one_step": syncs, **breakdown}
    if cache is not None:
        result["cache_write_s"] = written_s
    del step
    reset_memory(device)
    return result


def write_cache(teacher, windows, params):
    """The teacher_cache stage's files for the windows the cached mode draws (its own writer)."""
    from qad_pipeline.training.cached_teacher import TeacherCache
    from qad_pipeline.training.cached_teacher import write_cache as writer

    folder = Path(tempfile.mkdtemp(prefix="qad-throughput-cache-"))
    started = time.perf_counter()
    with quiet():
        writer(teacher, windows, params, folder, batch_size=params.qad.batch_size)
    return TeacherCache(folder, params, windows), time.perf_counter() - started


def report(result: dict, rows: int, seq: int) -> None:
    f = result["flops_per_token"]
    mfu = f"MFU {result['mfu']:.1%}" if result["mfu"] is not None else "MFU n/a (no GPU peak)"
    print(f"[{result['mode']}] {result['tokens_per_s']:,.0f} tokens/s ({rows} x {seq} tokens per step, "
        f"{result['step_s']:.3f} s/step), {mfu}; FLOPs/token = 6N_s {f['student_6N'] / 1e9:.2f}G + 2N_t "
        f"{f['teacher_2N'] / 1e9:.2f}G + attention {f['attention'] / 1e9:.2f}G = {f['total'] / 1e9:.2f}G")
    print(f"[{result['mode']}] peak memory {result['peak_memory_gib'] or 0:.1f} GiB; losses "
        f"{', '.join(f'{x:.4g}' for x in result['losses'])}; warm-up {result['warmup_s']:.1f} s"
        + (f"; cache written in {result['cache_write_s']:.1f} s" if "cache_write_s" in result else ""))
    print(f"[{result['mode']}] host syncs in one step (sync debug mode): {result['host_syncs_in_one_step'] or 'none'}")
    for key in ("ranges_ms", "kernel_groups_ms", "sync_calls_per_step"):
        if key in result:
            print(f"[{result['mode']}] {key}: {result[key]}")
    for name, ms in result.get("top_kernels_ms", []):
        print(f"[{result['mode']}]   {ms:9.2f} ms  {name}")


def explain_block(student, config, seq: int, device) -> dict:
    """torch._dynamo.explain on one quantized decoder block: graphs and breaks (before compiling)."""
    block = student.model.layers[0]
    hidden = torch.randn(1, seq, config.hidden_size, device=device, requires_grad=True)
    positions = torch.arange(seq, device=device)[None]
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
        out = torch._dynamo.explain(block)(hidden, attention_mask=None, position_ids=positions,
                                           position_embeddings=student.model.rotary_emb(hidden, positions))
    torch._dynamo.reset()
    return {"graphs": out.graph_count, "graph_breaks": out.graph_break_count,
            "reasons": [str(r.reason)[:200] for r in out.break_reasons[:5]]}


def throughput(args) -> dict:
    """The cuda mode (and --quick on the CPU)."""
    from qad_pipeline.core.targets import GPUS

    device = torch.device(args.device)
    config = llama_1b_config(args.tied) if not args.quick else tiny_config(vocab=4096, hidden=128)
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    peak_flops = next((flops for key, (_, flops) in GPUS.items() if key in gpu.upper()), None)
    started = time.perf_counter()
    teacher, student = teacher_and_student(config, device, args.seq)
    summary = {"gpu": gpu, "peak_flops": peak_flops, "torch": torch.__version__, "seq": args.seq,
               "attention": teacher.config._attn_implementation, "tied": bool(config.tie_word_embeddings),
               "n_student": matmul_params(student), "n_teacher": matmul_params(teacher),
               "params_total": sum(p.numel() for p in teacher.parameters()), "build_s": time.perf_counter() - started}
    print(f"qad_throughput: {gpu}, torch {torch.__version__}, attention {summary['attention']}, "
        f"{summary['params_total'] / 1e9:.2f}B parameters ({'tied' if summary['tied'] else 'untied'}), matmul "
        f"weights N = {summary['n_student'] / 1e9:.3f}B, peak {peak_flops or 0:.3g} FLOP/s; built and quantized in "
        f"{summary['build_s']:.1f} s")
    windows = np.random.default_rng(0).integers(0, config.vocab_size, size=(256, args.seq)).astype(np.int64)
    rows, how = choose_rows(args, teacher, student, windows, device)
    summary.update(rows=rows, tokens_per_micro_batch=rows * args.seq, rows_choice=how)
    print(f"micro-batch: {rows} x {args.seq} = {rows * args.seq:,} tokens ({how})")
    models = {"teacher": teacher, "student": student, "config": config, "n_teacher": summary["n_teacher"]}
    modes = [m for m in args.modes.split(",") if m]
    if any(m.endswith(":compile") for m in modes):
        summary["dynamo_explain_block"] = explain_block(student, config, args.seq, device)
        print(f"torch._dynamo.explain, one NVFP4 decoder block: {summary['dynamo_explain_block']}")
    summary["modes"] = []
    # compiled in place: last; cached (its cache written first) after the others
    for mode in sorted(modes, key=lambda m: (m.endswith(":compile"), m.startswith("cached"))):
        if time.perf_counter() - started > args.budget_s:
            print(f"[{mode}] skipped: the benchmark has run {args.budget_s:.0f} s (--budget-s)")
            continue
        if mode.startswith("baseline") and "baseline" not in models:
            models["baseline"] = copy.deepcopy(teacher).float().requires_grad_(True).train()
        try:
            result = run_mode(mode, args, models, windows, device, rows, peak_flops)
        except torch.cuda.OutOfMemoryError as err:
            result = {"mode": mode, "error": f"out of memory: {str(err).splitlines()[0][:200]}"}
            print(f"[{mode}] {result['error']}")
        else:
            report(result, rows, args.seq)
        reset_memory(device)
        summary["modes"].append(result)
        write_summary(args.out, summary)
    by = {r["mode"]: r for r in summary["modes"] if "error" not in r}
    if "live" in by and "baseline" in by:
        summary["fake_quant_overhead"] = by["baseline"]["tokens_per_s"] / by["live"]["tokens_per_s"]
        print(f"fake quantization costs x{summary['fake_quant_overhead']:.2f} the BF16 student's step (live teacher)")
    summary["total_s"] = time.perf_counter() - started
    print(f"total {summary['total_s']:.0f} s")
    return summary


def cpu_ratio(args) -> dict:
    """One QAD step of the real loop against a bare loop on the same tiny model and batch."""
    import torch.nn.functional as F

    device, seq, rows = torch.device("cpu"), 256, 4
    teacher, student = teacher_and_student(config := tiny_config(), device, seq)
    windows = np.random.default_rng(0).integers(0, config.vocab_size, size=(64, seq)).astype(np.int64)
    learning = copy.deepcopy(student)  # with learned block scales
    learned_scales.enable(learning, "lsq")
    steps = {key: make_step(qad_params(rows, seq, 100, "live"), model, teacher, None, device, key != "full")
             for key, model in (("chunked", student), ("full", student), ("lsq", learning))}
    bare_optimizer = torch.optim.AdamW(student.parameters(), lr=1e-5)

    def bare(batch):
        with torch.no_grad():
            target = teacher(input_ids=batch).logits
        logits = student(input_ids=batch).logits
        F.kl_div(F.log_softmax(logits, -1), F.log_softmax(target, -1), log_target=True,
                 reduction="batchmean").backward()
        bare_optimizer.step()
        bare_optimizer.zero_grad(set_to_none=True)

    names = {"chunked": "qad", "full": "qad_full_logits", "lsq": "qad_lsq"}
    times = {name: [] for name in [*names.values(), "bare"]}
    stream = batch_indices(len(windows), rows, 0)
    for i in range(args.repeats + 1):  # the first round warms up
        for key, run in [*((names[k], lambda k=k: run_steps(steps[k], windows, stream, 1)) for k in names),
                         ("bare", lambda: bare(torch.from_numpy(windows[next(stream)])))]:
            started = time.perf_counter()
            run()
            times[key] += [time.perf_counter() - started] if i else []
    medians = {key: statistics.median(v) for key, v in times.items()}
    result = {"threads": torch.get_num_threads(), "rows": rows, "seq": seq, "vocab": config.vocab_size,
              "median_s": medians, "ratio": medians["qad"] / medians["bare"],
              "ratio_full_logits": medians["qad_full_logits"] / medians["bare"],
              "ratio_lsq": medians["qad_lsq"] / medians["bare"], "repeats": args.repeats}
    print(f"cpu: one QAD step {medians['qad']:.3f} s, bare loop {medians['bare']:.3f} s: ratio {result['ratio']:.3f} "
        f"(full-logits loss: {result['ratio_full_logits']:.3f}; learned scales: {result['ratio_lsq']:.3f}); "
        f"median of {args.repeats}, {rows} x {seq} tokens, {torch.get_num_threads()} threads")
    return result


def write_summary(out: Path | None, summary: dict) -> None:
    if out is not None:
        out.write_text(json.dumps(summary, indent=1, default=str))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--quick", action="store_true", help="the cuda mode's path on a tiny model on the CPU")
    ap.add_argument("--modes", default="live,cached,baseline")
    for flag, default, what in (("rows", 0, "micro-batch rows (0: the most that fit, measured)"),
                                ("min-rows", 4, None), ("max-rows", 8, None), ("seq", 4096, None),
                                ("warmup", 2, None), ("steps", 4, "timed steps"), ("profile-steps", 1, None),
                                ("repeats", 5, "--device cpu: interleaved steps per loop")):
        ap.add_argument(f"--{flag}", type=int, default=default, help=what)
    ap.add_argument("--budget-s", type=float, default=240.0, help="start no mode after this many seconds")
    ap.add_argument("--cache-tail-samples", type=int, default=0,  # the writer samples the tail on the host
                    help="qad.teacher_tail_samples of the cache (32: ~0.5 s more per 2,048 positions to write)")
    ap.add_argument("--tied", action="store_true", help="tie lm_head to the embedding (Llama-3.2-1B as released)")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    sys.stdout.reconfigure(line_buffering=True)
    if args.quick:
        args.device, args.seq, args.min_rows = "cpu", min(args.seq, 128), 2
        args.modes = args.modes if args.modes != "live,cached,baseline" else "live,cached,baseline,live:full"
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device here (--device cpu, or --quick for a CPU smoke run)")
    summary = throughput(args) if args.device == "cuda" or args.quick else cpu_ratio(args)
    write_summary(args.out, summary)


if __name__ == "__main__":
    main()
