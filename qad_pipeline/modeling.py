"""Loading the base model and its tokenizer, with the checks that must pass before heavy work.

`check_base_model` reads only the model's config (cheap, no weights) and fails with one clear line
when the path does not exist, the model is not a causal LM, or a sequence length exceeds the
model's maximum. `load_model` then loads the weights in the configured dtype.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from qad_pipeline.artifacts import folder_sha256
from qad_pipeline.config import BaseModelParams, ConfigError, resolve

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def model_location(params: BaseModelParams) -> str:
    """A local folder (resolved against the project root) or a hub id, as given."""
    local = resolve(params.path)
    if local.exists():
        return str(local)
    looks_local = params.path.startswith((".", "/", "~")) or params.path.count("/") != 1
    if looks_local:
        raise ConfigError(
            f"base model path {params.path!r} does not exist "
            "(give an existing local folder or a hub id such as 'org/name')"
        )
    return params.path


def load_config(params: BaseModelParams):
    location = model_location(params)
    try:
        return AutoConfig.from_pretrained(
            location, revision=params.revision, trust_remote_code=params.trust_remote_code
        )
    except (OSError, ValueError) as err:
        raise ConfigError(f"cannot read a model config from {location!r}: {err}".splitlines()[0]) from None


def max_positions(config) -> int | None:
    for key in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = getattr(config, key, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def check_base_model(params: BaseModelParams, seq_lens: dict[str, int]) -> None:
    """Fail fast on a missing path, a model that is not a causal LM, or a too-long sequence."""
    config = load_config(params)
    archs = getattr(config, "architectures", None) or []
    if archs:  # what the checkpoint holds, e.g. BertModel, even where the model type has an LM head
        causal = any(a.endswith(("ForCausalLM", "LMHeadModel")) for a in archs)
    else:
        causal = config.model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    if not causal:
        raise ConfigError(
            f"base model {params.path!r} is not a causal LM (model_type={config.model_type!r}, "
            f"architectures={archs}); the pipeline needs an AutoModelForCausalLM checkpoint"
        )
    limit = max_positions(config)
    for name, value in seq_lens.items():
        if limit is not None and value > limit:
            raise ConfigError(f"{name} = {value} exceeds the model's maximum sequence length {limit}")


def load_tokenizer(params: BaseModelParams):
    tok = AutoTokenizer.from_pretrained(
        model_location(params), revision=params.revision, trust_remote_code=params.trust_remote_code
    )
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok


def load_model(params: BaseModelParams) -> PreTrainedModel:
    model = AutoModelForCausalLM.from_pretrained(
        model_location(params),
        revision=params.revision,
        trust_remote_code=params.trust_remote_code,
        dtype=DTYPES[params.dtype],
    )
    model.config.use_cache = False
    return model.eval()


def checkpoint_identity(params: BaseModelParams) -> dict:
    """Where the base model came from and, for a local folder, a hash of its files' contents."""
    location = model_location(params)
    ident = {"path": params.path, "revision": params.revision}
    folder = Path(location)
    if folder.is_dir():
        ident["sha256"] = folder_sha256(folder)
    return ident

