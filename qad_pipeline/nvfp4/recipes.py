"""PTQ recipe files: read, validated and compared through Model Optimizer's own recipe loader.

A recipe is data (a YAML file in `ptq.recipe_dir`, named once in `ptq.recipes`). The preflight
validates every listed file before any stage starts (`check_recipe`); the PTQ stage reads its
config for the model at hand (`quantize_config`); two recipes that resolve to the same quantizers
on this model are aliases (`recipe_aliases`), run once.
"""

from __future__ import annotations

import contextlib
import io
from pathlib import Path

import torch
import yaml

from qad_pipeline.core.config import ConfigError, Params, yaml_error
from qad_pipeline.core.modeling import tied_embeddings
from qad_pipeline.nvfp4.roles import ROLES, expand_roles, unknown_roles


def load_quantize_config(recipe_path: Path):
    """The recipe's quantize section, through Model Optimizer's own recipe loader."""
    from modelopt.recipe import load_recipe

    recipe = load_recipe(recipe_path)
    quantize = getattr(recipe, "quantize", None)
    if quantize is None:
        raise ValueError(f"{recipe_path} is not a PTQ recipe (no 'quantize' section)")
    return quantize


def mutates_weights(recipe_path: Path) -> bool:
    """The recipe's algorithm changes the weights themselves (GPTQ's error compensation), as Model
    Optimizer's own config class declares (`_mutates_weights`); an AutoQuantize recipe does not."""
    from modelopt.torch.quantization.mode import CalibrateModeRegistry, get_modelike_from_algo_cfg

    from qad_pipeline.nvfp4 import autoquant, layerwise

    if autoquant.is_auto_quantize(recipe_path):
        return False
    [(mode, _)] = get_modelike_from_algo_cfg(layerwise.plain_algorithm(load_quantize_config(recipe_path).model_dump()))
    return bool(CalibrateModeRegistry[mode].config_class._mutates_weights)


def check_recipe(recipe_path: Path, base_model=None) -> None:
    """Load and validate one recipe file as `run_ptq` will, before any work: a `ConfigError` naming the
    file and its problem (invalid YAML, not a PTQ recipe, a format or field Model Optimizer rejects).

    The algorithm name is not checked here: Model Optimizer resolves it only inside `mtq.quantize`.
    """
    from pydantic import ValidationError

    from qad_pipeline.nvfp4 import autoquant

    if autoquant.is_auto_quantize(recipe_path):  # its budget against this model's minimum, with one
        autoquant.check_recipe(recipe_path, base_model=base_model)
        return
    try:
        with contextlib.redirect_stdout(io.StringIO()):  # load_recipe prints "[load_recipe] loading: ..."
            unknown = unknown_roles(load_quantize_config(recipe_path).model_dump()["quant_cfg"])
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
    if unknown:
        raise ConfigError(f"recipe {recipe_path}: <{unknown[0]}> in a quantizer_name is not a role; "
                          f"roles are {', '.join(ROLES)}")


def quantize_config(model, recipe_path: Path) -> dict:
    """The recipe's Model Optimizer config for this model: its `<role>` rules resolved on the
    model's own modules (`qad_pipeline.nvfp4.roles`).

    A tied `lm_head` stays tied, in the embedding's dtype: it is the embedding table, which no
    serving engine reads in NVFP4, and quantizing it alone unties it in the export (an NVFP4
    `lm_head` beside a BF16 embedding: both stored, more bytes than the one tied BF16 tensor).
    """
    config = load_quantize_config(recipe_path).model_dump()
    if tied_embeddings(model):
        config["quant_cfg"] = [*config["quant_cfg"], {"quantizer_name": "<lm_head>*", "enable": False}]
    config["quant_cfg"] = expand_roles(config["quant_cfg"], model)
    return config


def quantizer_signature(params: Params, recipe: str) -> str:
    """What `recipe` does to this base model, as a hash: its calibration algorithm and every
    quantizer's resolved settings, with Model Optimizer's quantizers inserted into the model built
    on the meta device (no weight is read, nothing is calibrated). Two recipes with the same
    signature produce the same model: on a model without Mamba layers, recipes that differ only
    in their Mamba format do."""
    import hashlib
    import json

    from modelopt.torch.opt.conversion import apply_mode
    from modelopt.torch.quantization.nn import TensorQuantizer
    from transformers import AutoModelForCausalLM

    from qad_pipeline.core.modeling import load_config

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(load_config(params.base_model),
                                                 trust_remote_code=params.base_model.trust_remote_code)
    config = quantize_config(model, params.recipe_path(recipe))
    apply_mode(model, mode=[("quantize", config)])
    quantizers = {name: repr(m) for name, m in model.named_modules() if isinstance(m, TensorQuantizer)}
    blob = json.dumps([config.get("algorithm"), quantizers], sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()


def recipe_aliases(params: Params, upto: str | None = None) -> dict[str, str]:
    """{recipe: the earlier recipe in ptq.recipes it is the same as on this model}, aliases only.

    `upto` stops after that recipe (its own PTQ run needs only the recipes before it). A recipe
    Model Optimizer cannot apply is nobody's alias: its own PTQ run reports the error.
    """
    from qad_pipeline.nvfp4.autoquant import is_auto_quantize

    first: dict[str, str] = {}
    aliases = {}
    for recipe in params.ptq.recipes:
        try:  # an AutoQuantize recipe's layers are known only once it has searched: nobody's alias
            signature = None if is_auto_quantize(params.recipe_path(recipe)) else quantizer_signature(params, recipe)
        except Exception:  # noqa: BLE001  (a broken recipe fails in its own run, with its own message)
            signature = None
        if signature is not None and signature in first:
            aliases[recipe] = first[signature]
        elif signature is not None:
            first[signature] = recipe
        if recipe == upto:
            break
    return aliases
