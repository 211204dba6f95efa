"""Post-training quantization with one recipe: `qad-pipeline stage ptq RECIPE`.

Loads the BF16 base model where `hardware` says, quantizes and calibrates it with Model
Optimizer (`mtq.quantize` with the recipe file's own config, calibration samples from the
calibration stage), then evaluates it — KL divergence against the BF16 reference that the
baseline stage wrote once (the BF16 model never runs over the eval windows here) — and writes:

    <out>/checkpoint/   the fake-quantized model, saved with its quantizers and calibrated
                        scales (Model Optimizer's Hugging Face checkpointing), for QAD
    <out>/scores.json   status, per-task scores, KL, effective bits per element, size

Each recipe runs in its own process (the flow starts one per recipe), so a recipe that crashes
or runs out of memory takes only itself down.
"""

from __future__ import annotations

import contextlib
import io
import time
from pathlib import Path

import torch
import yaml

from qad_pipeline.artifacts import staged_dir, write_json
from qad_pipeline.config import ConfigError, Params, yaml_error
from qad_pipeline.modeling import input_device, load_model, load_tokenizer
from qad_pipeline.sizes import kv_cache_format, size_report
from qad_pipeline.tasks.calibration import load_calibration
from qad_pipeline.tasks.evaluate import evaluate_model

def load_quantize_config(recipe_path: Path):
    """The recipe's quantize section, through Model Optimizer's own recipe loader."""
    from modelopt.recipe import load_recipe

    recipe = load_recipe(recipe_path)
    quantize = getattr(recipe, "quantize", None)
    if quantize is None:
        raise ValueError(f"{recipe_path} is not a PTQ recipe (no 'quantize' section)")
    return quantize


def check_recipe(recipe_path: Path) -> None:
    """Load and validate one recipe file as `run_ptq` will, before any work: a `ConfigError` naming the
    file and its problem (invalid YAML, not a PTQ recipe, a format or field Model Optimizer rejects).

    The algorithm name is not checked here: Model Optimizer resolves it only inside `mtq.quantize`.
    """
    from pydantic import ValidationError

    try:
        with contextlib.redirect_stdout(io.StringIO()):  # load_recipe prints "[load_recipe] loading: ..."
            load_quantize_config(recipe_path)
    except yaml.YAMLError as err:
        raise ConfigError(yaml_error(err, f"recipe {recipe_path}")) from None
    except (ValueError, TypeError) as err:
        cause = err.__cause__
        if isinstance(cause, ValidationError):  # the config does not match Model Optimizer's schema
            first = cause.errors()[0]
            loc = ".".join(str(p) for p in first["loc"] if not str(p).startswith(("function-", "list[")))
            problem = f"{loc or 'recipe'}: {first['msg']}"
        else:
            problem = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise ConfigError(f"recipe {recipe_path}: not a valid Model Optimizer PTQ recipe: {problem}") from None


def calibration_loop(samples: torch.Tensor, batch_size: int):
    """Model Optimizer's forward_loop: run the calibration samples through the model."""

    def forward_loop(model) -> None:
        device = input_device(model)
        with torch.no_grad():
            for i in range(0, len(samples), batch_size):
                model(input_ids=samples[i : i + batch_size].to(device))

    return forward_loop


def quantize_model(model, recipe_path: Path, samples: torch.Tensor, batch_size: int):
    import modelopt.torch.quantization as mtq

    return mtq.quantize(model, load_quantize_config(recipe_path), calibration_loop(samples, batch_size))


def save_quantized(model, tokenizer, folder: Path) -> None:
    """Save with quantizer state so `load_model` + Model Optimizer restore it without recalibrating."""
    import modelopt.torch.opt as mto

    mto.enable_huggingface_checkpointing()
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def run_ptq(params: Params, recipe: str, data_dir: Path, reference_dir: Path, out_dir: Path) -> dict:
    """Stage core: quantize the base model with `recipe`, evaluate it, save it and its scores."""
    from qad_pipeline.reference import Reference

    started = time.time()
    Reference(reference_dir)  # fail before loading anything when the baseline has not run
    model, tokenizer = load_model(params.base_model, params.hardware), load_tokenizer(params.base_model)

    samples = torch.from_numpy(load_calibration(data_dir))
    t0 = time.time()
    quantize_model(model, params.recipe_path(recipe), samples, params.ptq.calib_batch_size)
    quantize_s = time.time() - t0
    sizes = size_report(model)

    t0 = time.time()
    scores = evaluate_model(model, tokenizer, params.eval, data_dir, reference=reference_dir)
    eval_s = time.time() - t0
    result = {
        "recipe": recipe,
        "status": "ok",
        **scores,
        "effective_bpe": sizes["effective_bpe"],
        "size_bytes": sizes["size_bytes"],
        "bf16_size_bytes": sizes["bf16_size_bytes"],
        "kv_cache": kv_cache_format(model),
        "elements_by_format": sizes["elements_by_format"],
        "layer_formats": sizes["layer_formats"],
        "timing_s": {"quantize": quantize_s, "eval": eval_s, "total": time.time() - started},
        "started_at": started,
        "finished_at": time.time(),
        "peak_rss_mb": _peak_rss_mb(),
        "peak_device_mb": _peak_device_mb(),
    }
    with staged_dir(out_dir) as tmp:
        save_quantized(model, tokenizer, tmp / "checkpoint")
        write_json(tmp / "scores.json", result)
    return result


def _peak_device_mb() -> float | None:
    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return None
    return sum(torch.cuda.max_memory_allocated(d) for d in range(torch.cuda.device_count())) / 2**20


def _peak_rss_mb() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
