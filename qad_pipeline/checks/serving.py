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
  (`judge_view`). Where the student's own noise reaches the unquantized model's figure (W4A4 on a
  real model: noise-limited), the noise line alone, and the served model as far from the
  unquantized model as the student is (`QUANTIZED_BAND`) instead of the cap and the closer
  condition. On SmolLM2-135M with W4A4 NVFP4 MLPs the noise is ~0.002 nats/token with weights only
  and ~0.2-0.25 with NVFP4 activations: two faithful implementations of a W4A4 model differ by
  about as much as the activation quantization itself, position by position, so the w4a4 view
  tells whether the activations are quantized as strongly as the student's, not which rounding
  each took; the weights are held to the tight w4a16 view, the activation scales to the lint. A
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
import subprocess
import time
from pathlib import Path

from qad_pipeline.core.config import PROJECT_ROOT, ConfigError, StageError
from qad_pipeline.checks.serving_reference import (CLOSER_SHARE, KL_FLOOR, NOISE_FACTOR, QUANTIZATION_SHARE, REFERENCE_FILE,
                                            UNQUANTIZED, VIEWS, read_reference)
from qad_pipeline.checks.serving_verdict import DECIDED_MARGIN, TOP1_MIN, judge_view, summary_line
from qad_pipeline.checks.vllm_setup import run_vllm_script, vllm_process_env, vllm_python

CHECK_SCRIPT = PROJECT_ROOT / "serving" / "vllm_check.py"
LEVELS = ("auto", "full", "config")


class ServingCheckFailed(StageError):
    pass



def run_vllm_side(folder: Path, prompts: list[list[int]], level: str, logprobs: int, env: Path | None = None,
                  timeout: int = 900, views: tuple[str, ...] = ("w4a4",)) -> dict[str, dict]:
    """One vLLM process: the config check, and the full check of each of `views` (w4a16: vLLM serves a
    copy whose NVFP4 layers read W4A16_NVFP4; w4a4: the checkpoint as stored), one engine after the
    other. {view: its side's result}."""
    request = {"level": level, "prompts": prompts, "logprobs": logprobs, "views": list(views),
               "max_model_len": max(len(p) for p in prompts) + 8}
    return run_vllm_script(CHECK_SCRIPT, folder, request, "the vLLM side of the serving check failed",
                           ServingCheckFailed, env, timeout)


def run_vllm_sides(folder: Path, prompts: list[list[int]], level: str, logprobs: int, env: Path | None,
                   views: list[str]) -> dict[str, dict]:
    """Every view's side. Without a GPU, one vLLM process serves them one after the other (its start,
    ~20 s of a ~25 s side on these CPUs, paid once); on a GPU each view gets its own process, so that
    the first engine's GPU memory is back to the device before the second starts."""
    import torch

    if not torch.cuda.is_available():
        return run_vllm_side(folder, prompts, level, logprobs, env, views=tuple(views))
    return {view: run_vllm_side(folder, prompts, level, logprobs, env, views=(view,))[view] for view in views}


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
    sides = run_vllm_sides(folder, prompts, level, k, env, views)
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
