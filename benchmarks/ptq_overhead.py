"""PTQ stage versus a bare script: `python benchmarks/ptq_overhead.py [--recipe NAME] [--repeats 3]`.

Times `qad-pipeline stage ptq <recipe>` against a bare script that does the same work with Model
Optimizer and lm-eval directly, each in its own process, one after the other (alternating, so a
busy machine slows both alike), on the demo model with the params.yaml defaults. Goal: the
ratio of the medians (pipeline / bare) is at most 1.10.

The bare script (`--bare`, run as a subprocess) uses none of the pipeline's code except, on a
machine without CUDA, the CPU NVFP4 kernels (`qad_pipeline.nvfp4.nvfp4_cpu`, without which Model
Optimizer cannot fake-quantize there at all):

  load the base model and tokenizer with transformers; `mtq.quantize` with the recipe's config
  (`modelopt.recipe.load_recipe(path).quantize`) over the calibration stage's samples; lm-eval's
  `simple_evaluate` on the project's tasks (eval_tasks/*.yaml pointed at the calibration stage's
  held-out jsonl); perplexity and KL over the same held-out windows against the baseline's
  reference arrays, read with numpy (the same estimator: exact over the top k, Monte-Carlo over
  the tail samples); `save_pretrained` with Model Optimizer's quantizer state.

Both read the calibration and baseline outputs prepared once in a temporary out-root
(`qad-pipeline stage calibration`, `qad-pipeline stage baseline`; `--root DIR` reuses a prepared
one). It prints each run's wall time and phases, both medians, the ratio, and the two runs'
scores side by side (they must agree: same work).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PROJECT = Path(__file__).resolve().parent.parent
GOAL = 1.10


# -- the bare script ----------------------------------------------------------------------------


def bare(root: Path, recipe: str, out: Path) -> dict:
    """Load, quantize, evaluate and save one recipe with transformers, Model Optimizer and lm-eval."""
    t_start = time.perf_counter()
    import numpy as np
    import torch
    import yaml
    from datasets import load_from_disk
    from transformers import AutoModelForCausalLM, AutoTokenizer

    params = yaml.safe_load((PROJECT / "params.yaml").read_text())
    base, ev = PROJECT / params["base_model"]["path"], params["eval"]
    data = root / "artifacts" / "calibration"
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":  # Model Optimizer's NVFP4 kernels need CUDA or Triton; the CPU emulation
        from qad_pipeline.nvfp4.nvfp4_cpu import install_cpu_kernels

        install_cpu_kernels(force=True)
    import modelopt.torch.opt as mto
    import modelopt.torch.quantization as mtq
    from modelopt.recipe import load_recipe
    phases = {"imports": time.perf_counter() - t_start}

    t0 = time.perf_counter()
    placed = {"device_map": {"": torch.cuda.current_device()}} if device == "cuda" else {}
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.bfloat16, **placed).eval()
    model.config.use_cache = False
    tokenizer = AutoTokenizer.from_pretrained(base)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    phases["load"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    samples = torch.tensor(load_from_disk(str(data / "calibration"))["input_ids"])
    batch = params["ptq"]["calib_batch_size"]

    def forward_loop(m):
        with torch.no_grad():
            for i in range(0, len(samples), batch):
                m(input_ids=samples[i : i + batch].to(device))

    mtq.quantize(model, load_recipe(PROJECT / params["ptq"]["recipe_dir"] / f"{recipe}.yaml").quantize, forward_loop)
    phases["quantize"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    windows = torch.tensor(load_from_disk(str(data / "eval" / "ppl"))["input_ids"])
    ref = root / "artifacts" / "baseline" / "reference"
    names = ("topk_ids", "topk_logprobs", "tail_ids", "tail_logprobs", "rest_logmass")
    top_ids, top_lp, tail_ids, tail_lp, rest = (np.load(ref / f"{name}.npy", mmap_mode="r") for name in names)
    nll = kl = 0.0
    count = 0

    def rows(array, i, n):
        return torch.from_numpy(np.array(array[i : i + n])).to(device)

    with torch.no_grad():
        for i in range(0, len(windows), ev["batch_size"]):
            w = windows[i : i + ev["batch_size"]].to(device)
            lp = torch.log_softmax(model(input_ids=w).logits[:, :-1].float(), dim=-1)
            nll -= lp.gather(-1, w[:, 1:, None]).sum().item()
            count += w[:, 1:].numel()
            # KL(p || q): exact over the reference's top k, Monte-Carlo over its tail samples
            # (or, with none stored, the tail as one bucket)
            ids, p_lp, p_rest = rows(top_ids, i, len(w)).long(), rows(top_lp, i, len(w)), rows(rest, i, len(w))
            t_ids, t_lp = rows(tail_ids, i, len(w)).long(), rows(tail_lp, i, len(w))
            exact = (p_lp.exp() * (p_lp - lp.gather(-1, ids))).sum(-1)
            p_tail = torch.where(torch.isfinite(p_rest), p_rest.exp(), torch.zeros_like(p_rest))
            if t_ids.shape[-1]:
                tail = p_tail * (t_lp - lp.gather(-1, t_ids)).mean(-1)
            else:
                tail = torch.where(p_tail > 0, p_tail * (p_rest - lp.scatter(-1, ids, float("-inf")).logsumexp(-1)),
                                   torch.zeros_like(p_rest))
            kl += (exact + tail).sum().item()
    phases["ppl_kl"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    specs = []
    for name in ev["tasks"]:
        cfg = yaml.safe_load((PROJECT / ev["task_dir"] / f"{name}.yaml").read_text())
        cfg["dataset_kwargs"] = {"data_files": {cfg.get("test_split", "test"): str(data / "eval" / f"{name}.jsonl")}}
        specs.append(cfg)
    lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=ev["batch_size"], device=str(model.device))
    out_eval = simple_evaluate(model=lm, tasks=specs, task_manager=TaskManager(include_defaults=False),
                               limit=ev["limit"], log_samples=False, bootstrap_iters=0, verbosity="WARNING")
    phases["lm_eval"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    mto.enable_huggingface_checkpointing()
    model.save_pretrained(out / "checkpoint")
    tokenizer.save_pretrained(out / "checkpoint")
    phases["save"] = time.perf_counter() - t0

    scores = {name: {k.split(",")[0]: v for k, v in res.items() if "," in k and "_stderr" not in k}
              for name, res in out_eval["results"].items()}
    result = {"phases_s": phases, "perplexity": math.exp(nll / count), "kl_divergence": kl / count, "tasks": scores,
              "in_process_s": time.perf_counter() - t_start}
    (out / "bare.json").write_text(json.dumps(result, indent=2))
    return result


# -- the comparison -----------------------------------------------------------------------------


def sh(cmd: list[str], log: Path) -> float:
    """Run `cmd` in the project folder, output to `log`; its wall time in seconds (fails loudly)."""
    started = time.perf_counter()
    with log.open("w") as fh:
        code = subprocess.run(cmd, cwd=PROJECT, stdout=fh, stderr=subprocess.STDOUT).returncode
    elapsed = time.perf_counter() - started
    if code != 0:
        tail = "\n".join(log.read_text().splitlines()[-15:])
        raise SystemExit(f"{' '.join(cmd)} failed (exit {code}) after {elapsed:.0f} s; last lines of {log}:\n{tail}")
    return elapsed


def prepare(root: Path) -> None:
    stage = [sys.executable, "-m", "qad_pipeline", "stage"]
    for name in ("calibration", "baseline"):
        print(f"preparing: qad-pipeline stage {name} --out-root {root} ...", flush=True)
        print(f"  {sh([*stage, name, '--out-root', str(root)], root / f'{name}.log'):.1f} s", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--recipe", default=None, help="recipe name [default: the first of ptq.recipes]")
    ap.add_argument("--repeats", type=int, default=3, help="runs of each, alternating")
    ap.add_argument("--root", type=Path, default=None, help="out-root with calibration + baseline already run")
    ap.add_argument("--bare", action="store_true", help="run the bare script once (used by the comparison)")
    ap.add_argument("--out", type=Path, default=None, help="with --bare: where it writes its checkpoint")
    args = ap.parse_args()

    import yaml

    recipe = args.recipe or yaml.safe_load((PROJECT / "params.yaml").read_text())["ptq"]["recipes"][0]
    if args.bare:
        out = args.out or args.root / "bare" / recipe
        out.mkdir(parents=True, exist_ok=True)
        print(json.dumps(bare(args.root, recipe, out)["phases_s"]))
        return

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    root = args.root or Path(tempfile.mkdtemp(prefix="qad-ptq-overhead-"))
    if args.root is None:
        prepare(root)
    pipeline_cmd = [sys.executable, "-m", "qad_pipeline", "stage", "ptq", recipe, "--out-root", str(root)]
    bare_out = root / "bare" / recipe
    bare_cmd = [sys.executable, str(Path(__file__).resolve()), "--bare", "--root", str(root), "--recipe", recipe,
                "--out", str(bare_out)]
    times: dict[str, list[float]] = {"pipeline": [], "bare": []}
    print(f"\n== PTQ of {recipe} on the demo model (params.yaml defaults), {args.repeats} runs each, alternating ==",
          flush=True)
    for i in range(args.repeats):
        for name, cmd in (("pipeline", pipeline_cmd), ("bare", bare_cmd)) if i % 2 == 0 else \
                (("bare", bare_cmd), ("pipeline", pipeline_cmd)):
            wall = sh(cmd, root / f"{name}-{i}.log")
            times[name].append(wall)
            if name == "pipeline":
                t = json.loads((root / "artifacts" / "ptq" / recipe / "scores.json").read_text())["timing_s"]
                detail = f"in-process: quantize {t['quantize']:.1f}, eval {t['eval']:.1f}, total {t['total']:.1f}"
            else:
                b = json.loads((bare_out / "bare.json").read_text())
                detail = "in-process: " + ", ".join(f"{k} {v:.1f}" for k, v in b["phases_s"].items())
            print(f"run {i + 1} {name:<8} {wall:8.1f} s   ({detail})", flush=True)

    pipe, base = statistics.median(times["pipeline"]), statistics.median(times["bare"])
    ratio = pipe / base
    print(f"\nmedian wall time: pipeline {pipe:.1f} s, bare {base:.1f} s; "
          f"ratio pipeline / bare = {ratio:.3f} (goal <= {GOAL:.2f}: {'met' if ratio <= GOAL else 'NOT met'})")

    scores = json.loads((root / "artifacts" / "ptq" / recipe / "scores.json").read_text())
    b = json.loads((bare_out / "bare.json").read_text())
    print("\n== same work: the last runs' scores ==")
    print(f"{'':<36} {'pipeline':>12} {'bare':>12}")
    print(f"{'perplexity':<36} {scores['tasks']['perplexity']['value']:12.5f} {b['perplexity']:12.5f}")
    print(f"{'kl_divergence':<36} {scores['kl_divergence']:12.6f} {b['kl_divergence']:12.6f}")
    for task, res in scores["tasks"].items():
        for metric, value in res.get("all", {}).items():
            print(f"{task + ' ' + metric:<36} {value:12.5f} {b['tasks'].get(task, {}).get(metric, float('nan')):12.5f}")
    print(f"\nlogs and outputs: {root}")


if __name__ == "__main__":
    main()
