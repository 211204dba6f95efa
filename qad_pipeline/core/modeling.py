"""Loading the base model and its tokenizer, with the checks that must pass before heavy work.

`check_base_model` reads only the model's config (cheap, no weights) and fails with one clear line
when the path does not exist, a hub model cannot be had (offline and not cached, gated without
access, unreachable: `qad_pipeline.core.hub_access`), the model is not a causal LM, or a sequence length
exceeds the model's maximum; `check_model_files` reads a local folder's weight files' headers (no tensors) and
refuses a truncated file or one that does not match its index. `load_model` then loads the weights in the configured dtype, where the
`hardware` section says: every stage (baseline, PTQ, QAD, final eval, export) loads through it.

Placement (`hardware.device`, `hardware.device_map`, `hardware.max_memory`):

* `device: auto` is CUDA when this process sees a GPU (a GPU worker sees exactly the devices its
  `CUDA_VISIBLE_DEVICES` or its Kubernetes GPU request gives it), else the CPU; `cpu` and `cuda`
  force one (`cuda` without a visible GPU is an error before any weights load).
* `device_map: single` puts the whole model on the process's current GPU; `auto` lets
  accelerate's big-model loading spread it over the visible GPUs, then CPU RAM, within
  `max_memory` (the way Model Optimizer's own `hf_ptq` example loads large checkpoints).
* A model on the CPU gets the CPU emulation of Model Optimizer's NVFP4 kernels
  (`qad_pipeline.nvfp4.nvfp4_cpu`), also on a machine that has a GPU; a model on CUDA runs Model
  Optimizer's own CUDA/Triton kernels.

Inputs go to `input_device(model)`, the device of the input embeddings (the first device of a
model spread by `device_map: auto`; accelerate's hooks move activations between the others).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from qad_pipeline.core.artifacts import folder_sha256
from qad_pipeline.core.config import PROJECT_ROOT, BaseModelParams, ConfigError, HardwareParams, looks_local, resolve
from qad_pipeline.core.hub_access import check_hub_access

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def model_location(params: BaseModelParams) -> str:
    """A local folder (resolved against the project root) or a hub id, as given."""
    local = resolve(params.path)
    if local.exists():
        return str(local)
    if looks_local(params.path):
        raise ConfigError(
            f"base model path {params.path!r} does not exist "
            "(give an existing local folder or a hub id such as 'org/name')"
        )
    return params.path


SHIPPED_CONFIGS = PROJECT_ROOT / "profiles" / "configs"  # <org>/<name>/config.json of the profiles' hub models


def load_config(params: BaseModelParams):
    """The model's config (no weights): a local folder's, a hub model's (from the hub's cache
    first), or, for a hub model not in the cache whose config this project ships
    (SHIPPED_CONFIGS: the profiles' models, for planning offline), that copy."""
    location = model_location(params)
    shipped = SHIPPED_CONFIGS / params.path / "config.json"  # (an absolute local path would replace the folder)
    if location == params.path and not Path(location).exists() and shipped.is_file() and params.revision is None:
        try:
            return AutoConfig.from_pretrained(location, trust_remote_code=params.trust_remote_code,
                                              local_files_only=True)
        except (OSError, ValueError):
            return AutoConfig.from_pretrained(str(shipped.parent))
    try:
        return AutoConfig.from_pretrained(
            location, revision=params.revision, trust_remote_code=params.trust_remote_code
        )
    except (OSError, ValueError) as err:
        hint = ("; set base_model.trust_remote_code: true if you trust that code"
                if "trust_remote_code" in str(err) and not params.trust_remote_code else "")
        raise ConfigError(f"cannot read a model config from {location!r}: {err}".splitlines()[0].rstrip(" .") + hint
                          ) from None


def max_positions(config) -> int | None:
    for key in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = getattr(config, key, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def check_base_model(params: BaseModelParams, seq_lens: dict[str, int]) -> None:
    """Fail fast on a missing path, a hub model the stages could not download (`check_hub_access`),
    a model that is not a causal LM, or a too-long sequence."""
    if not Path(model_location(params)).exists():  # a hub id
        check_hub_access(params)
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


def check_model_files(params: BaseModelParams) -> None:
    """A local base model folder's weight files are whole (`check_weights`); hub ids are not read here."""
    folder = Path(model_location(params))
    if folder.is_dir():
        check_weights(folder)


def check_weights(folder: Path) -> None:
    """The safetensors weight files of a local model folder are whole and match their index.

    safetensors' own `safe_open` reads each file's header (memory-mapped, no tensor is loaded) and
    refuses a file whose size does not cover the data offsets the header lists (a truncated file);
    with `model.safetensors.index.json` every file it names must exist and hold the tensors it
    assigns to it. Folders with only PyTorch `.bin` weights are not checked (they are pickles).
    """
    from safetensors import SafetensorError, safe_open

    index_file = folder / "model.safetensors.index.json"
    weight_map: dict[str, str] = {}
    if index_file.is_file():
        try:
            weight_map = json.loads(index_file.read_text())["weight_map"]
        except (ValueError, KeyError, TypeError) as err:
            raise ConfigError(f"model index {index_file} is not a safetensors index with a weight_map ({err})") from None
    files = sorted(set(weight_map.values())) if weight_map else sorted(p.name for p in folder.glob("*.safetensors"))
    if not files:
        if not any(folder.glob("*.bin")):
            raise ConfigError(f"base model folder {folder} holds no weight files (*.safetensors or *.bin)")
        return
    for name in files:
        path = folder / name
        if not path.is_file():
            raise ConfigError(f"model weights {path} are missing: {index_file.name} lists them")
        try:
            with safe_open(str(path), framework="pt") as handle:
                keys = set(handle.keys())
        except (SafetensorError, OSError) as err:
            raise ConfigError(f"model weights {path} ({path.stat().st_size} bytes) are unreadable: {err} "
                              "(a truncated or corrupted file? download or copy it again)") from None
        missing = sorted(t for t, f in weight_map.items() if f == name and t not in keys)
        if missing:
            raise ConfigError(f"model weights {path} lack {len(missing)} tensor(s) that {index_file.name} assigns "
                              f"to them, e.g. {missing[0]!r}")


def load_tokenizer(params: BaseModelParams):
    tok = AutoTokenizer.from_pretrained(
        model_location(params), revision=params.revision, trust_remote_code=params.trust_remote_code
    )
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok


def resolve_device(hardware: HardwareParams) -> str:
    """'cuda' or 'cpu', from `hardware.device` and what this process can see."""
    if hardware.device == "cpu":
        return "cpu"
    if torch.cuda.is_available():
        return "cuda"
    if hardware.device == "cuda":
        raise ConfigError(
            "hardware.device = 'cuda' but this process sees no CUDA device "
            f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r}); use 'auto' or 'cpu'"
        )
    return "cpu"


def prepare_device(hardware: HardwareParams) -> str:
    """Resolve the device and, for the CPU, install the NVFP4 CPU kernels into Model Optimizer."""
    device = resolve_device(hardware)
    if device == "cpu":
        from qad_pipeline.nvfp4.nvfp4_cpu import install_cpu_kernels

        install_cpu_kernels(force=True)
    return device


def placement(hardware: HardwareParams) -> dict:
    """`from_pretrained` keyword arguments that put a model where `hardware` says."""
    device = prepare_device(hardware)
    if device == "cpu":
        return {}
    if hardware.device_map == "single":
        return {"device_map": {"": torch.cuda.current_device()}}
    caps = {(int(k) if k.isdigit() else k): v for k, v in (hardware.max_memory or {}).items()}
    return {"device_map": "auto", **({"max_memory": caps} if caps else {})}


def load_model(
    params: BaseModelParams, hardware: HardwareParams, folder: Path | None = None, dtype: torch.dtype | None = None
) -> PreTrainedModel:
    """The base model (or a saved stage checkpoint in `folder`, quantizer state included), placed.

    `dtype` overrides `base_model.dtype` (QAD trains its student's master weights in float32).
    """
    kwargs = {"revision": params.revision, "trust_remote_code": params.trust_remote_code}
    if folder is not None:
        import modelopt.torch.opt as mto

        mto.enable_huggingface_checkpointing()  # restores the quantizers and calibrated scales
        kwargs = {"trust_remote_code": params.trust_remote_code}
    model = AutoModelForCausalLM.from_pretrained(
        str(folder) if folder is not None else model_location(params),
        dtype=dtype or DTYPES[params.dtype],
        **kwargs,
        **placement(hardware),
    )
    model.config.use_cache = False
    return model.eval()


def input_device(model) -> torch.device:
    """Where a model's input ids go: its input embeddings' device (the first of a spread model)."""
    return model.get_input_embeddings().weight.device


def checkpoint_identity(params: BaseModelParams) -> dict:
    """Where the base model came from and, for a local folder, a hash of its files' contents."""
    location = model_location(params)
    ident = {"path": params.path, "revision": params.revision}
    folder = Path(location)
    if folder.is_dir():
        ident["sha256"] = folder_sha256(folder)
    return ident


def tied_embeddings(model) -> bool:
    """The output embedding (`lm_head`) is the input embedding's own tensor (`tie_word_embeddings`)."""
    head, embed = model.get_output_embeddings(), model.get_input_embeddings()
    return head is not None and embed is not None and head.weight is embed.weight


def save_quantized(model, tokenizer, folder: Path) -> None:
    """Save with quantizer state so `load_model` + Model Optimizer restore it without recalibrating."""
    import modelopt.torch.opt as mto

    mto.enable_huggingface_checkpointing()
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
