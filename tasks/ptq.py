"""Post-training quantization with one recipe: `qad-pipeline stage ptq RECIPE`.

Loads the BF16 base model where `hardware` says, quantizes and calibrates it with Model
Optimizer (`mtq.quantize` with the recipe file's own config, calibration samples from the
calibration stage), then evaluates it — KL divergence against the BF16 reference that the
baseline stage wrote once (the BF16 model never runs over the eval windows here) — and writes:

    <out>/checkpoint/   the fake-quantized model, saved with its quantizers and calibrated
                        scales (Model Optimizer's Hugging Face checkpointing), for QAD
    <out>/scores.json   status, per-task scores, KL, effective bits per element, size, each
                        quantized weight's reconstruction error (`weight_errors`)
    <out>/items.json    per-item eval values, for the recovery's confidence interval

With `ptq.layerwise` (true, or auto when the model does not fit the GPUs the recipe gets),
Model Optimizer calibrates one decoder layer at a time and checkpoints each finished layer under
`<out-root>/artifacts/ptq_layerwise/<recipe>/<key>/` (kept when the process is killed, removed
once the outputs are written); run again, it resumes after the last finished layer, and scores.json
records `layerwise: {layers, resumed_from_layer, checkpoints}` (`qad_pipeline/nvfp4/layerwise.py`).
The MSE and four-over-six scale searches take each weight `ptq.mse_chunk_rows` rows at a time
(`qad_pipeline/nvfp4/mse_chunks.py`): the same scales, memory bounded by the chunk.

With `race.enabled` (racing the recipes), it scores only round 1's items (scores, items and KL
cover them); the `race` stage (tasks/race.py) scores the later rounds of those still in contention.

A recipe that resolves to the same quantizers as an earlier one in `ptq.recipes` on this model
(`qad_pipeline.nvfp4.recipes.recipe_aliases`, checked on the meta device before any weight loads) is not run again: its
scores.json says `"status": "alias"` and names the recipe it repeats.

Each recipe runs in its own process (the flow starts one per recipe), so a recipe that crashes
or runs out of memory takes only itself down.
"""

from __future__ import annotations

import contextlib
import io
import shutil
import time
from pathlib import Path

import torch

from qad_pipeline.nvfp4 import layerwise
from qad_pipeline.nvfp4.mse_chunks import chunked_mse
from qad_pipeline.core.artifacts import read_json, staged_dir, write_json
from qad_pipeline.core.calibration_data import load_calibration
from qad_pipeline.core.config import Params
from qad_pipeline.scoring.evaluation import evaluate_model
from qad_pipeline.core.layout import Layout
from qad_pipeline.core.modeling import input_device, load_model, load_tokenizer, save_quantized, tied_embeddings
from qad_pipeline.nvfp4.recipes import mutates_weights, quantize_config, recipe_aliases
from qad_pipeline.results.base import dump_result, write_result
from qad_pipeline.results.scores import AutoQuantizeResult, LayerwiseCalibration, PTQAlias, PTQScores
from qad_pipeline.nvfp4.sizes import kv_cache_format, quantizer_format, size_report
from qad_pipeline.nvfp4.recipe_algorithms import recipe_algorithm, weight_scale_algorithm


def calibration_loop(samples: torch.Tensor, batch_size: int):
    """Model Optimizer's forward_loop: run the calibration samples through the model."""

    def forward_loop(model) -> None:
        device = input_device(model)
        with torch.no_grad():
            for i in range(0, len(samples), batch_size):
                model(input_ids=samples[i : i + batch_size].to(device))

    return forward_loop


def quantize_model(model, recipe_path: Path, samples: torch.Tensor, batch_size: int,
                   by_layer: bool = False, checkpoint_dir: Path | None = None):
    """`mtq.quantize` with the recipe's config; with `by_layer`, through Model Optimizer's layerwise
    calibration (checkpointing each layer into `checkpoint_dir`, and resuming from what it holds),
    then the weights outside the decoder layers (`qad_pipeline.nvfp4.layerwise`)."""
    import modelopt.torch.quantization as mtq

    config, forward_loop = quantize_config(model, recipe_path), calibration_loop(samples, batch_size)
    if not by_layer:
        return mtq.quantize(model, config, forward_loop)
    checked = []

    def checked_loop(m) -> None:  # the first call comes before any layer is calibrated
        if not checked:
            layerwise.check_outside_layers(m, recipe_path.stem)
            checked.append(True)
        forward_loop(m)

    model = mtq.quantize(model, layerwise.with_layerwise(config, checkpoint_dir), checked_loop)
    layerwise.calibrate_outside_layers(model, layerwise.plain_algorithm(config))
    return model


def share_fused_scales(model) -> None:
    """Give the layers a server fuses into one GEMM (q/k/v, gate/up: the linears that read the same
    input) one global weight scale and one input scale, the largest of theirs, as Model Optimizer's
    export does (`requantize_resmooth_fused_llm_layers`, the same call) and as vLLM needs (it keeps
    one global scale per fused layer).

    Done right after calibration, so the model that is evaluated, selected and distilled is the
    one the export writes. Left to the export alone, it re-derived the FP8 block scales of every
    layer whose global scale was not the largest of its group: on SmolLM2-135M with the max recipe
    86 % of `up_proj`'s weights took other FP4 values than the evaluated model's, and the export
    was KL 0.037 nats/token away from the model the pipeline measured (0.0021 with this call)."""
    from modelopt.torch.export.unified_export_hf import requantize_resmooth_fused_llm_layers

    with contextlib.redirect_stdout(io.StringIO()):  # it prints each fused group on some models
        requantize_resmooth_fused_llm_layers(model)


def quantized_weights(model):
    """(name, weight, its enabled weight quantizer) for every quantized weight: Model Optimizer's
    `iter_weights_for_calibration` pairs, one per linear layer and one per expert of fused MoE
    weights (named `<module>[<expert>]`)."""
    for name, module in model.named_modules():
        if not hasattr(module, "iter_weights_for_calibration"):
            continue
        pairs = [(w, q) for w, q in module.iter_weights_for_calibration() if q is not None and q.is_enabled]
        for index, (weight, quantizer) in enumerate(pairs):
            yield (f"{name}[{index}]" if len(pairs) > 1 else name), weight, quantizer


def original_weights(model) -> dict[str, torch.Tensor]:
    """{linear layer: a host copy of its weight} before a weight-changing algorithm runs, so that
    `weight_errors` measures the quantized weight against the base model's, not against the weight
    the algorithm rewrote (GPTQ writes its rounded weights back: ~0 error against themselves)."""
    return {name: m.weight.detach().to("cpu", copy=True) for name, m in model.named_modules()
            if isinstance(m, torch.nn.Linear) and m.weight.ndim == 2}


def weight_errors(model, worst: int = 5, originals: dict[str, torch.Tensor] | None = None) -> dict:
    """Each quantized weight's relative reconstruction error ||Q(W) - W0|| / ||W0|| (Frobenius)
    under its own calibrated quantizer (`quantized_weights`), W0 the weight before quantization
    (`originals`, where the algorithm changed it; else the weight itself). Returns the median and
    mean over layers, every layer's error and the `worst` layers.
    """
    import statistics

    layers = {}
    with torch.no_grad():
        for name, weight, quantizer in quantized_weights(model):
            w = weight.float().contiguous()
            w0 = originals[name].to(w.device).float() if originals and name in originals else w
            error = torch.linalg.vector_norm(quantizer(w) - w0) / torch.linalg.vector_norm(w0).clamp_min(1e-30)
            layers[name] = float(error)
    if not layers:
        return {"median": None, "mean": None, "layers": {}, "worst": []}
    ranked = sorted(layers.items(), key=lambda kv: -kv[1])[:worst]
    return {"median": statistics.median(layers.values()), "mean": statistics.fmean(layers.values()),
            "layers": layers, "worst": [{"layer": n, "error": e} for n, e in ranked]}


def recipe_settings(model, recipe_path: Path) -> dict:
    """The recipe's choices as they landed on this model, for side-by-side comparison:
    calibration algorithm, weight-scale method, the Mamba projections' format, the KV cache's
    (an AutoQuantize recipe: `auto_quantize/<scoring>` and its candidate formats)."""
    from qad_pipeline.nvfp4 import autoquant

    if autoquant.is_auto_quantize(recipe_path):
        chosen = autoquant.settings(autoquant.load_recipe(recipe_path))
    else:
        four_over_six = any(isinstance(q.block_sizes, dict) and q.block_sizes.get("four_over_six")
                            for _, _, q in quantized_weights(model))
        weight_scale = weight_scale_algorithm(recipe_path)["method"]  # activation headroom: its weights' own
        chosen = {"algorithm": str(recipe_algorithm(recipe_path)["method"]),
                  "weight_scale": "four_over_six" if four_over_six else str(weight_scale)}
    mamba_formats = set()
    for m in model.modules():
        if "Mamba" not in type(m).__name__:
            continue
        for proj in (getattr(m, "in_proj", None), getattr(m, "out_proj", None)):
            if proj is not None and hasattr(proj, "weight_quantizer"):
                weights = quantizer_format(proj.weight_quantizer, proj.weight.dtype)
                acts = quantizer_format(getattr(proj, "input_quantizer", None), torch.bfloat16)
                mamba_formats.add(f"{weights.name} W{weights.element_bits}A{acts.element_bits}")
    return {
        **chosen,
        "mamba_format": "+".join(sorted(mamba_formats)) or "none (no Mamba layers)",
        "kv_cache": kv_cache_format(model),
    }


def auto_quantize_model(model, recipe_path: Path, samples: torch.Tensor, batch_size: int, base_model,
                        budget: float | None = None, search_state: Path | None = None) -> AutoQuantizeResult:
    """Quantize `model` in place with an AutoQuantize recipe at `budget` (the recipe's own by default).

    `search_state` is a search state file written by the sweep's search stage: each format's
    calibration and the sensitivity scores are taken from it and only the solve runs. It is copied
    first: Model Optimizer writes into the state file it is given, and that file is another
    stage's output.
    """
    import tempfile

    from qad_pipeline.nvfp4 import autoquant

    spec = autoquant.load_recipe(recipe_path)
    budget = spec.effective_bits if budget is None else budget
    minimum = autoquant.minimum_budget(spec, base_model)
    autoquant.check_budget(spec, budget, f"recipe {recipe_path}", minimum)
    t0 = time.time()
    with tempfile.TemporaryDirectory(prefix="autoquant-") as tmp:
        state_file = None
        if search_state is not None:
            state_file = Path(tmp) / search_state.name
            shutil.copyfile(search_state, state_file)
        state = autoquant.search(model, spec, samples, batch_size, budget, checkpoint=state_file,
                                 tied_lm_head=tied_embeddings(model))
    return AutoQuantizeResult(
        budget=budget, searched_effective_bits=autoquant.searched_bits(state), minimum_bits=minimum,
        method=spec.method, formats=list(spec.formats), kv_cache=spec.kv_cache,
        layers=autoquant.layer_map(state), reused_search=search_state is not None, search_s=time.time() - t0)


def run_ptq(params: Params, recipe: str, data_dir: Path, reference_dir: Path, out_dir: Path,
            budget: float | None = None, search_state: Path | None = None, name: str | None = None,
            layerwise_root: Path | None = None, eval_items: dict[str, list[int]] | None = None) -> dict:
    """Stage core: quantize the base model with `recipe`, evaluate it, save it and its scores.

    For an AutoQuantize recipe, `budget` replaces the recipe's own and `search_state` is a search
    the sweep made once (`auto_quantize_model`); `name` is what the scores call the result (the
    recipe's name by default, `<recipe>@<budget>` for a sweep point). `layerwise_root` is where a
    layerwise calibration (`ptq.layerwise`) keeps its per-layer checkpoints (under a key of the
    recipe and calibration), removed once the outputs are written; None: it keeps none.
    `eval_items` (racing): the item ids of each task to score (round 1's; `evaluate_model`).
    """
    from qad_pipeline.nvfp4 import autoquant
    from qad_pipeline.scoring.reference import Reference

    started = time.time()
    name = name or recipe
    recipe_path = params.recipe_path(recipe)
    Reference(reference_dir)  # fail before loading anything when the baseline has not run
    canonical = recipe_aliases(params, upto=recipe).get(recipe) if name == recipe else None
    if canonical is not None:  # the same model as an earlier recipe: run once, report as its alias
        alias = PTQAlias(recipe=recipe, status="alias", alias_of=canonical, started_at=started,
                         finished_at=time.time())
        with staged_dir(out_dir) as tmp:
            write_result(tmp / "scores.json", alias)
        return dump_result(alias)
    model, tokenizer = load_model(params.base_model, params.hardware), load_tokenizer(params.base_model)

    samples = torch.from_numpy(load_calibration(data_dir))
    t0 = time.time()
    searched = by_layer = folder = None
    is_auto_quantize = autoquant.is_auto_quantize(recipe_path)
    setting = params.ptq.layerwise if search_state is None else False  # a sweep point calibrates nothing
    if layerwise.enabled(setting, model, recipe, is_auto_quantize):
        if layerwise_root is not None:
            folder = layerwise.checkpoint_dir(layerwise_root, layerwise.checkpoint_key(params, recipe_path, data_dir))
        by_layer = LayerwiseCalibration(layers=len(layerwise.decoder_layers(model)),
                                        resumed_from_layer=layerwise.resume_point(folder) if folder else 0,
                                        checkpoints=folder is not None)
        if by_layer.resumed_from_layer:
            print(f"ptq {name}: resuming layerwise calibration at layer {by_layer.resumed_from_layer} "
                  f"of {by_layer.layers} from {folder}", flush=True)
    originals = original_weights(model) if mutates_weights(recipe_path) else None
    with chunked_mse(params.ptq.mse_chunk_rows):  # the MSE scale search a chunk of rows at a time, same result
        if is_auto_quantize:
            searched = auto_quantize_model(model, recipe_path, samples, params.ptq.calib_batch_size, params.base_model,
                                           budget, search_state)
        else:
            quantize_model(model, recipe_path, samples, params.ptq.calib_batch_size, by_layer is not None, folder)
    share_fused_scales(model)
    quantize_s = time.time() - t0
    sizes = size_report(model)
    weight_error = weight_errors(model, originals=originals)
    del originals
    _return_freed_heap()  # what calibration and the scale or GPTQ search freed, before the evaluation's logits

    t0 = time.time()
    scores = evaluate_model(model, tokenizer, params.eval, data_dir, reference=reference_dir, items=eval_items)
    items = scores.pop("items")
    eval_s = time.time() - t0
    result = PTQScores(
        recipe=name,
        status="ok",
        **scores,
        effective_bpe=sizes["effective_bpe"],
        size_bytes=sizes["size_bytes"],
        bf16_size_bytes=sizes["bf16_size_bytes"],
        kv_cache=kv_cache_format(model),
        elements_by_format=sizes["elements_by_format"],
        layer_formats=sizes["layer_formats"],
        weight_error=weight_error,
        settings=recipe_settings(model, recipe_path),
        **({"layerwise": by_layer} if by_layer is not None else {}),
        timing_s={"quantize": quantize_s, "eval": eval_s, "total": time.time() - started},
        started_at=started,
        finished_at=time.time(),
        peak_rss_mb=_peak_rss_mb(),
        peak_device_mb=_peak_device_mb(),
        **({"auto_quantize": searched} if searched is not None else {}),
    )
    with staged_dir(out_dir) as tmp:
        save_quantized(model, tokenizer, tmp / "checkpoint")
        write_result(tmp / "scores.json", result)
        write_json(tmp / "items.json", items)
    if layerwise_root is not None:
        shutil.rmtree(layerwise_root, ignore_errors=True)  # done: the next run calibrates afresh
    return dump_result(result)


def first_round(params: Params, layout: Layout) -> dict[str, list[int]] | None:
    """With `race.enabled`, the items a recipe scores here: round 1's (`qad_pipeline.scoring.racing`); the
    race stage scores the later rounds of the recipes still in contention."""
    if not params.race.enabled:
        return None
    from qad_pipeline.scoring.racing import round_ids

    return round_ids(read_json(layout.items("baseline")), params.race.fractions, params.race.seed)[0]


def _peak_device_mb() -> float | None:
    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return None
    return sum(torch.cuda.max_memory_allocated(d) for d in range(torch.cuda.device_count())) / 2**20


def _return_freed_heap() -> None:
    """glibc's `malloc_trim(0)`: the free memory of the heap and its arenas back to the system.

    glibc keeps what a process frees (its threshold for mapping a large block on its own rises with
    each one freed), so after quantization (GPTQ's Hessians and working copies, the originals of
    the weight error) the process stays that large and the evaluation's logits come on top: GPTQ on
    SmolLM2-135M peaked at 3,140 MB without this and 2,848 MB with it. A no-op without glibc."""
    import ctypes

    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _peak_rss_mb() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main(params: Params, layout: Layout, recipe: str | None = None) -> str:
    """One PTQ recipe: `qad-pipeline stage ptq <recipe>`."""
    result = run_ptq(params, recipe, layout.data, layout.reference, layout.ptq(recipe),
                     layerwise_root=layout.ptq_layerwise(recipe), eval_items=first_round(params, layout))
    if result.get("status") == "alias":
        return f"ptq {recipe}: the same model as {result['alias_of']} on this base model; not run again"
    searched, by_layer = result.get("auto_quantize"), result.get("layerwise")
    budget = (f" (AutoQuantize at {searched['budget']} bits: {searched['searched_effective_bits']:.3f} over the "
              "searched layers)") if searched else ""
    if by_layer:
        start = by_layer["resumed_from_layer"]
        budget += f" (calibrated layerwise{f', resumed at layer {start}' if start else ''})"
    return f"ptq {recipe}: {result['effective_bpe']:.3f} bits per element{budget}"
