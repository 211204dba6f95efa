"""AutoQuantize recipes: a bits budget instead of one fixed format, through `mtq.auto_quantize`.

An AutoQuantize recipe is a YAML file in the recipe folder, next to the fixed recipes, listed in
`ptq.recipes` like them (same fan-out, same selection, same QAD and export) and swept over budgets
by the BPE sweep (`tasks/sweep.py`). Its `metadata.recipe_type` is `auto_quantize`:

    metadata:
      recipe_type: auto_quantize
      description: ...
    auto_quantize:
      effective_bits: 5.0           # Model Optimizer's budget, over the searched layers
      formats: [NVFP4_FOUR_OVER_SIX_CFG, FP8_DEFAULT_CFG]   # candidates (mtq.config.choices); "none" is always one
      method: gradient              # gradient | kl_div: how each layer's sensitivity is scored
      num_calib_steps: 4            # calibration batches per candidate format
      num_score_steps: 4            # scoring batches
      kv_cache: FP8_KV_CFG          # fixed, not searched: a Model Optimizer KV-cache config, or null
      keep_bf16: ['<attention>*']  # never quantized (a `<role>`, qad_pipeline/nvfp4/roles.py, or names)

Model Optimizer scores every layer's sensitivity to each candidate once and solves for the budget;
its search state (`checkpoint`) holds each format's calibration and the scores, so a second budget
re-solves without calibrating or scoring again. Two bit counts are recorded: Model Optimizer's
(over the searched layers only, NVFP4 counted as 4 bits) and the project's (`sizes.size_report`,
over every weight with block and tensor scales, so embeddings and BF16 attention count too).
"""

from __future__ import annotations

import contextlib
import io
from pathlib import Path
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from qad_pipeline.core.config import ConfigError, read_yaml

RECIPE_TYPE = "auto_quantize"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class AutoQuantizeSpec(_Strict):
    effective_bits: float = Field(gt=0, le=16)
    formats: list[str] = Field(min_length=1)
    method: Literal["gradient", "kl_div"] = "gradient"
    num_calib_steps: int = Field(default=4, gt=0)
    num_score_steps: int = Field(default=4, gt=0)
    kv_cache: str | None = None
    keep_bf16: list[str] = []

    @field_validator("formats")
    @classmethod
    def _known_formats(cls, formats: list[str]) -> list[str]:
        choices = _format_choices()
        for name in formats:
            if name not in choices:
                raise ValueError(f"unknown format {name!r}: Model Optimizer knows {sorted(choices)}")
        return formats

    @field_validator("kv_cache")
    @classmethod
    def _known_kv(cls, name: str | None) -> str | None:
        kv = sorted(c for c in _format_choices() if "_KV_" in c)
        if name is not None and name not in kv:
            raise ValueError(f"unknown KV-cache config {name!r}: one of {kv}, or null")
        return name


class RecipeMetadata(_Strict):
    recipe_type: Literal["auto_quantize"]
    description: str = ""


class AutoQuantizeRecipe(_Strict):
    metadata: RecipeMetadata
    auto_quantize: AutoQuantizeSpec


def _format_choices() -> set[str]:
    import modelopt.torch.quantization as mtq

    return set(mtq.config.choices)


def _format_config(name: str) -> dict:
    import modelopt.torch.quantization as mtq

    return getattr(mtq.config, name)


def format_algorithm(name: str) -> str:
    """A candidate format's calibration method (`max`, `mse`, ...)."""
    algorithm = _format_config(name).get("algorithm", "max")
    return algorithm.get("method", "max") if isinstance(algorithm, dict) else str(algorithm)


def is_auto_quantize(recipe_path: Path) -> bool:
    """The recipe file declares `metadata.recipe_type: auto_quantize` (else it is a fixed recipe,
    and a file that is not YAML is reported as one, by Model Optimizer's recipe loader)."""
    try:
        data = read_yaml(recipe_path)
    except ConfigError:
        return False
    return isinstance(data, dict) and isinstance(data.get("metadata"), dict) \
        and data["metadata"].get("recipe_type") == RECIPE_TYPE


def load_recipe(recipe_path: Path) -> AutoQuantizeSpec:
    """An AutoQuantize recipe's settings; a `ConfigError` naming the file and the bad key."""
    try:
        return AutoQuantizeRecipe.model_validate(read_yaml(recipe_path)).auto_quantize
    except ValidationError as err:
        first = err.errors()[0]
        loc = ".".join(str(p) for p in first["loc"])
        what = "unknown key" if first["type"] == "extra_forbidden" else first["msg"]
        raise ConfigError(f"recipe {recipe_path}: {loc}: {what}") from None


def minimum_bits(spec: AutoQuantizeSpec) -> float:
    """The smallest budget the candidate formats allow: every searched layer in the most compressed
    one, by Model Optimizer's own cost of a format (`estimate_quant_compression`)."""
    from modelopt.torch.quantization.algorithms import estimate_quant_compression
    from modelopt.torch.quantization.config import QuantizeConfig

    return min(16 * estimate_quant_compression(QuantizeConfig(**_format_config(f))) for f in spec.formats)


_MINIMUMS: dict[tuple[str, str], float] = {}  # per process: preflight and the stage ask the same


def minimum_budget(spec: AutoQuantizeSpec, base_model=None) -> float:
    """The smallest budget this model allows: Model Optimizer's own feasibility check, run on the
    model built on the meta device (no weight is read, nothing is calibrated). It counts the layers
    that cannot take a candidate (kept in BF16, convolutions) at 16 bits, so it is above the
    formats' bound (`minimum_bits`). Without a model, the formats' bound. Computed once per
    process for a recipe and a model."""
    bound = minimum_bits(spec)
    if base_model is None:
        return bound
    key = (spec.model_dump_json(exclude={"effective_bits"}), base_model.model_dump_json())
    if key not in _MINIMUMS:
        _MINIMUMS[key] = _feasibility_minimum(spec, base_model, bound)
    return _MINIMUMS[key]


def _feasibility_minimum(spec: AutoQuantizeSpec, base_model, bound: float) -> float:
    import re

    from transformers import AutoModelForCausalLM

    from qad_pipeline.core.modeling import load_config, tied_embeddings

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(load_config(base_model), trust_remote_code=base_model.trust_remote_code)
    try:
        search(model, spec, torch.zeros((1, 1), dtype=torch.long, device="meta"), 1, budget=bound,
               tied_lm_head=tied_embeddings(model))
    except ValueError as err:  # "... The minimum achievable effective bits is 4.6302."
        found = re.search(r"minimum achievable effective bits is ([0-9.]+\d)", str(err))
        if found:
            return float(found.group(1))
    except Exception:  # noqa: BLE001  (feasible at the bound: the search went on to calibrate on meta tensors)
        pass
    return bound


def check_budget(spec: AutoQuantizeSpec, budget: float, what: str, low: float) -> None:
    """Refuse a budget outside [low, 16] before any weight loads, naming the minimum possible."""
    if not low <= budget <= 16:
        raise ConfigError(f"{what}: effective_bits {budget} is outside what the formats {spec.formats} allow on "
                          f"this model: the minimum possible is {low:g} (every searchable layer in the most "
                          "compressed format, the others in BF16), the maximum 16 (nothing quantized)")


def check_recipe(recipe_path: Path, budgets: list[float] = (), base_model=None) -> AutoQuantizeSpec:
    """Validate an AutoQuantize recipe as `search` will use it, and each budget it will run at
    (against this base model's minimum when `base_model` is given, else the formats' bound)."""
    from qad_pipeline.nvfp4.roles import ROLES, unknown_roles

    spec = load_recipe(recipe_path)
    unknown = unknown_roles([{"quantizer_name": p} for p in spec.keep_bf16])
    if unknown:
        raise ConfigError(f"recipe {recipe_path}: keep_bf16: <{unknown[0]}> is not a role; roles are {', '.join(ROLES)}")
    low = minimum_budget(spec, base_model)
    for budget in [spec.effective_bits, *budgets]:
        check_budget(spec, budget, f"recipe {recipe_path}", low)
    return spec


def disabled_layers(spec: AutoQuantizeSpec, tied_lm_head: bool, model) -> list[str]:
    """Layers never searched: the recipe's `keep_bf16`, the model's routers (by role,
    `qad_pipeline.nvfp4.roles`) and what Model Optimizer's default disabled quantizers name
    (convolutions, routers, MTP), and a tied output projection (it is the embedding table)."""
    from qad_pipeline.nvfp4.roles import expand_names

    fixed = ["<router>*", "*mixer.conv1d*", "*mlp.gate.*", "*router*", "*block_sparse_moe.gate*", "mtp.*"]
    return expand_names([*spec.keep_bf16, *fixed, *(["<lm_head>*"] if tied_lm_head else [])], model)


def batches(samples: torch.Tensor, batch_size: int) -> list[torch.Tensor]:
    return [samples[i: i + batch_size] for i in range(0, len(samples), batch_size)]


def search(model, spec: AutoQuantizeSpec, samples: torch.Tensor, batch_size: int, budget: float | None = None,
           checkpoint: Path | None = None, tied_lm_head: bool = False) -> dict:
    """Quantize `model` in place with `mtq.auto_quantize` at `budget` (the recipe's by default).

    With `checkpoint` (Model Optimizer's search state file) that exists, each format's calibration
    and the sensitivity scores are restored from it and only the solve runs; otherwise they are
    computed and written there. Returns Model Optimizer's search state.
    """
    import modelopt.torch.quantization as mtq

    from qad_pipeline.core.modeling import input_device

    device = input_device(model)
    data = [b.to(device) for b in batches(samples, batch_size)]

    def forward_step(model, batch):
        if spec.method == "kl_div":
            return model(input_ids=batch).logits
        return model(input_ids=batch, labels=batch)

    fixed = [{"quantizer_name": "*", "enable": False}]
    if spec.kv_cache:
        fixed += list(_format_config(spec.kv_cache)["quant_cfg"])
    with contextlib.redirect_stdout(io.StringIO()):  # its per-layer tables; the result records them
        _, state = mtq.auto_quantize(
            model,
            constraints={"effective_bits": budget if budget is not None else spec.effective_bits},
            fixed_quantization_config={"quant_cfg": fixed, "algorithm": "max"},
            module_search_spaces=[{"module_name_patterns": ["*"], "quantization_formats": list(spec.formats)}],
            data_loader=data,
            forward_step=forward_step,
            loss_func=(lambda output, batch: output.loss) if spec.method == "gradient" else None,
            disabled_layers=disabled_layers(spec, tied_lm_head, model),
            num_calib_steps=min(spec.num_calib_steps, len(data)),
            num_score_steps=min(spec.num_score_steps, len(data)),
            method=spec.method,
            checkpoint=str(checkpoint) if checkpoint is not None else None,
        )
    return state


def _format_name(recipe) -> str:
    return "none" if recipe.config is None or str(recipe).startswith("NONE") else str(recipe).split("(")[0]


def layer_map(state: dict) -> dict[str, dict[str, Any]]:
    """Per layer group Model Optimizer weighs (its modules named): the chosen format, and each
    candidate's sensitivity score and cost, from its search state. A group with "none" as its only
    candidate (kept in BF16, a convolution) is there too: its cost counts in the effective bits."""
    layers = {}
    for group, recipe in state["best"]["recipe"].items():
        stats = state["candidate_stats"][group]
        layers[group.removesuffix(".quant_recipe")] = {
            "format": _format_name(recipe),
            "modules": list(stats["module_names"]),
            "scores": {_format_name(f): float(s) for f, s in zip(stats["formats"], stats["scores"])},
            "costs": {_format_name(f): float(c) for f, c in zip(stats["formats"], stats["costs"])},
        }
    return layers


def bits_of(layers: dict[str, dict[str, Any]]) -> float:
    """Model Optimizer's effective bits of a layer map: the chosen formats' costs over the costs
    of leaving every group in BF16, times 16 (what `searched_bits` reports, recomputed)."""
    chosen = sum(layer["costs"][layer["format"]] for layer in layers.values())
    return 16 * chosen / sum(layer["costs"]["none"] for layer in layers.values())


def searched_bits(state: dict) -> float:
    """Model Optimizer's effective bits of the solution, over the searched layers."""
    return float(state["best"]["constraints"]["effective_bits"])


def settings(spec: AutoQuantizeSpec) -> dict[str, str]:
    """The recipe axis for side-by-side comparison (`results.RecipeSettings`)."""
    return {"algorithm": f"auto_quantize/{spec.method}", "weight_scale": "+".join(spec.formats)}
