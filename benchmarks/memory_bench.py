"""The memory plan against measured peaks: `python benchmarks/memory_bench.py [--work DIR] [--models demo llama ...]`.

For the bundled demo model, a ~100M-parameter Llama built from a config (benchmarks/models.py,
random weights) and the architecture matrix's families (tests/families.py: `llama-2l`, `gemma3`,
`qwen3`, `qwen3_moe`, `mistral`, `phi3`, two layers each), runs every stage process one after
another (`qad-pipeline stage ...`, as the flow does) and prints, per stage, the memory plan's host
estimate, the measured peak resident memory (the larger of the process's ru_maxrss from wait4 and the
summed RSS of its process tree, sampled every 0.1 s: the export's vLLM process runs beside it) and their
ratio. The goal is 0.7-1.3.

Both models run on the CPU with two recipes (a dynamic one and a static four-over-six one) and
settings small enough for a few minutes per stage that still exercise vocabulary x token memory.
`--work DIR` keeps the outputs (default: a temporary folder) and the measured peaks
(`<work>/<model>/peaks.json`); `--reuse` prints the table from those peaks with the current
formula instead of running the stages again; `--stages` runs some stages only.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

RECIPES = ["nvfp4_max-mamba_fp8-kv_fp8", "nvfp4_4o6-mamba_w4a16-kv_nvfp4"]
COMMON = [f"ptq.recipes=[{', '.join(RECIPES)}]", "hardware.device=cpu", "selection.band=[0.01, 1.0]",
          "eval.num_cloze=48", "eval.num_continuation=24", "eval.limit=16", "qad.steps=2", "qad.warmup_steps=1",
          "qad.checkpoint_every=100"]
MODELS = {
    # params.yaml's defaults otherwise: eval 32 x 256, calibration 32 x 256 (8 a batch), QAD 8 x 256
    # in float32 (compute_dtype auto on the CPU); the Llama's QAD runs under bfloat16 autocast
    "demo": [],
    "llama": ["calibration.num_samples=16", "calibration.seq_len=256", "ptq.calib_batch_size=16",
              "eval.seq_len=256", "eval.batch_size=8", "eval.ppl_samples=16", "qad.batch_size=4",
              "qad.seq_len=256", "qad.compute_dtype=bfloat16"],
}
FAMILY = "{}-2l"  # the matrix's Llama is `llama-2l` here: `llama` is the 100M one above
FAMILIES = ["llama", "gemma3", "qwen3", "qwen3_moe", "mistral", "phi3"]  # tests/families.py
STAGES = ["calibration", "baseline", *(f"ptq/{r}" for r in RECIPES), "selection", "qad", "final_eval", "export"]


# Linux carries a process's peak RSS across exec, so a child forked from this (large) process
# would report at least this process's RSS: a small launcher starts the stage and reports its
# ru_maxrss (KiB) from wait4: the largest single process of its tree. A stage that runs a second
# process beside it (the export's serving check: vLLM) holds both at once, which the plan sums: the
# launcher also samples the summed RSS of the stage's process tree every 0.1 s and reports the
# larger of the two.
LAUNCHER = """
import os, subprocess, sys, threading
import psutil
def tree_rss_kb(pid):
    try:
        root = psutil.Process(pid)
        processes = [root, *root.children(recursive=True)]
    except psutil.Error:
        return 0
    total = 0
    for process in processes:
        try:
            total += process.memory_info().rss
        except psutil.Error:  # ended since
            pass
    return total // 1024
with open(sys.argv[1], "w") as log:
    proc = subprocess.Popen(sys.argv[2:], stdout=log, stderr=subprocess.STDOUT)
    summed, ended = [0], threading.Event()
    def sample():
        while not ended.wait(0.1):
            summed[0] = max(summed[0], tree_rss_kb(proc.pid))
    threading.Thread(target=sample, daemon=True).start()
    _, status, usage = os.wait4(proc.pid, 0)
    ended.set()
print(max(usage.ru_maxrss, summed[0]))
sys.exit(os.waitstatus_to_exitcode(status))
"""


def measure(stage: str, overrides: list[str], root: Path) -> tuple[float, float]:
    """(peak RSS in MiB, seconds) of one `qad-pipeline stage` process."""
    cmd = [sys.executable, "-m", "qad_pipeline", "stage", *stage.split("/"), "--params", str(ROOT / "params.yaml"),
           "--out-root", str(root)]
    for item in overrides:
        cmd += ["--set", item]
    log = root / "logs" / f"{stage.replace('/', '-')}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    started = time.time()
    done = subprocess.run([sys.executable, "-c", LAUNCHER, str(log), *cmd], capture_output=True, text=True, cwd=ROOT)
    if done.returncode != 0:
        tail = "\n".join(log.read_text().strip().splitlines()[-5:])
        raise RuntimeError(f"stage {stage} failed (log {log}):\n{tail}")
    return int(done.stdout.split()[-1]) / 1024, time.time() - started


def build_family(family: str, folder: Path, tokenizer_dir: Path) -> Path:
    """The matrix's two-layer model of `family` (tests/families.py), saved with the demo's tokenizer."""
    from transformers import AutoTokenizer

    sys.path.insert(0, str(ROOT))
    from tests.families import FAMILIES

    if not (folder / "config.json").is_file():
        FAMILIES[family].build().save_pretrained(folder)
        AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(folder)
    return folder


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", type=Path, default=None, help="keep the outputs here")
    names = [*MODELS, *(FAMILY.format(f) if f == "llama" else f for f in FAMILIES)]
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=names)
    ap.add_argument("--stages", nargs="+", default=STAGES, choices=STAGES)
    ap.add_argument("--reuse", action="store_true", help="the peaks measured before in --work")
    args = ap.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="memory-bench-"))

    from models import DEMO_MODEL, build_llama

    from qad_pipeline.plan import capacity, memory
    from qad_pipeline.core.config import load_params

    rows = []
    for name in args.models:
        if name in MODELS:
            path = DEMO_MODEL if name == "demo" else build_llama(work / "llama-model")
        else:
            path = build_family(name.removesuffix("-2l"), work / f"{name}-model", DEMO_MODEL)
        overrides = [f"base_model.path={path}", *COMMON, *MODELS.get(name, [])]
        params = load_params(ROOT / "params.yaml", overrides)
        cap = capacity.Capacity("cpu", 1 << 50)  # the estimates themselves, whatever this machine has free
        estimates = {e.stage: e for e in memory.plan(params, cap)}
        shape = memory.model_shape(params.base_model)
        print(f"{name}: {shape.params / 1e6:.1f}M parameters, vocabulary {shape.vocab}", flush=True)
        saved = work / name / "peaks.json"
        peaks = json.loads(saved.read_text()) if saved.is_file() else {}
        for stage in args.stages:
            if not (args.reuse and stage in peaks):
                peaks[stage] = measure(stage, overrides, work / name)
                saved.write_text(json.dumps(peaks, indent=2))
            measured, seconds = peaks[stage]
            est = estimates[stage]
            rows.append((name, stage, est.phase, est.host_bytes / memory.MiB, measured, seconds))
            print(f"  {stage:38s} estimated {rows[-1][3]:7.0f} MiB  measured {measured:7.0f} MiB  "
                  f"ratio {rows[-1][3] / measured:.2f}  ({seconds:.0f} s)", flush=True)

    print(f"\n{'model':6s} | {'stage':36s} | {'peak phase':12s} | {'estimated host MiB':>18s} | "
          f"{'measured peak MiB':>17s} | ratio")
    for model, stage, phase, est, measured, _ in rows:
        flag = "" if 0.7 <= est / measured <= 1.3 else "  outside ±30 %"
        print(f"{model:6s} | {stage:36s} | {phase:12s} | {est:18.0f} | {measured:17.0f} | {est / measured:.2f}{flag}")
    print(f"\noutputs and logs: {work}")


if __name__ == "__main__":
    main()
