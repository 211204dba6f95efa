"""The vLLM side of `qad-pipeline verify-serving`: run by the serving environment's Python.

    <vllm-env>/bin/python serving/vllm_check.py EXPORT_DIR REQUEST.json OUT.json
    <vllm-env>/bin/python serving/vllm_check.py --serve-args "vllm serve DIR --quantization ..."

It imports only vLLM (and what vLLM brings), never the project: the project and vLLM pin different
transformers releases, so they live in two environments and talk through two JSON files.

REQUEST: {"level": "auto" | "full" | "config", "prompts": [[token ids], ...], "logprobs": K,
          "max_model_len": N, "views": ["w4a16", "w4a4"] (one engine after the other)}
OUT:     {view: {"config": {...}, "full": {...} | null, "full_error": str | null, "platform_limit": bool}}

config  what vLLM's own loader decides for this checkpoint, without loading weights: the
        quantization method it detects (`ModelConfig`), the KV-cache dtype that `auto` resolves to,
        the model class it would build, and for every linear layer of the checkpoint (names read
        from the safetensors headers, mapped to vLLM's names with the model class's own mapper)
        whether vLLM's quantization config quantizes it, with which algorithm, and whether that
        matches the format stored.
full    `vllm.LLM` loads the checkpoint and returns each prompt's top-K prompt log-probs.

view    w4a4: the checkpoint as stored. w4a16: a copy (links to the same weight files) whose NVFP4
        algorithm reads `W4A16_NVFP4`, so vLLM runs every NVFP4 layer with BF16 activations, as it
        does on a GPU without FP4 tensor cores (Hopper).
"""

from __future__ import annotations

import gc
import json
import os
import re
import struct
import sys
import tempfile
import traceback
from pathlib import Path

# what vLLM may call a stored format: a packed-FP4 weight must meet an NVFP4 algorithm, and so on
ALGO_FORMAT = {"NVFP4": "nvfp4", "W4A16_NVFP4": "nvfp4", "W4A8_NVFP4_FP8": "nvfp4", "FP8": "fp8"}
# the messages vLLM's CPU build gives for an architecture or layer it cannot run on this platform
PLATFORM_LIMITS = ("is supported only for", "not supported on CPU", "is not supported on the CPU",
                   "Unsupported on this platform")
# ... and the ones that are a limit only on the CPU: vLLM 0.32.0's NVFP4 fused-MoE backends are all
# CUDA/ROCm kernels (a Qwen3-MoE export is refused with this; on a GPU it would be a real failure)
CPU_LIMITS = ("No NvFp4 MoE backend supports the deployment configuration",)


def on_cpu() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def header(path: Path) -> dict:
    with open(path, "rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(size))


def stored_layers(folder: Path) -> dict[str, str]:
    """Each 2-D weight's module name -> the format stored: nvfp4 (packed uint8), fp8 or bf16."""
    tensors: dict[str, dict] = {}
    for file in sorted(folder.glob("*.safetensors")):
        tensors.update({k: v for k, v in header(file).items() if k != "__metadata__"})
    layers = {}
    for name, info in tensors.items():
        if not name.endswith(".weight") or len(info["shape"]) != 2:
            continue
        module = name.removesuffix(".weight")
        if "embed" in module.rsplit(".", 1)[-1] or "norm" in module:
            continue
        layers[module] = {"U8": "nvfp4", "F8_E4M3": "fp8"}.get(info["dtype"], "bf16")
    return layers


def config_check(folder: Path, max_model_len: int) -> dict:
    import vllm
    from vllm.config import LoadConfig, ModelConfig
    from vllm.model_executor.model_loader.weight_utils import get_quant_config
    from vllm.model_executor.models import ModelRegistry
    from vllm.utils.torch_utils import resolve_kv_cache_dtype_string

    model_config = ModelConfig(model=str(folder), dtype="bfloat16", max_model_len=max_model_len)
    method = model_config.quantization
    model_cls, arch = ModelRegistry.resolve_model_cls(model_config.architectures, model_config=model_config)
    problems, layers = [], {}
    if method is None:
        problems.append("vLLM detects no quantization method in the checkpoint")
        return {"vllm_version": vllm.__version__, "quantization": None, "architecture": arch,
                "kv_cache_dtype": resolve_kv_cache_dtype_string("auto", model_config),
                "layers": {}, "problems": problems, "passed": False}
    quant_config = get_quant_config(model_config, LoadConfig())
    # what the model class does to the config when vLLM builds it (SupportsQuant, or the loader)
    mapper = getattr(model_cls, "hf_to_vllm_mapper", None)
    mapper = mapper.get_rename_mapper() if mapper is not None else None
    if mapper is not None:
        quant_config.apply_vllm_mapper(mapper)
    packed = getattr(model_cls, "packed_modules_mapping", None)
    if packed:
        quant_config.packed_modules_mapping = {**(quant_config.packed_modules_mapping or {}), **packed}
    resolve = getattr(quant_config, "_resolve_quant_algo", None)  # MIXED_PRECISION: per layer
    uniform = getattr(quant_config, "quant_method", None) or getattr(quant_config, "quant_algo", None)
    for module, stored in stored_layers(folder).items():
        name = mapper.map_name(f"{module}.weight") if mapper is not None else f"{module}.weight"
        prefix = (name or f"{module}.weight").removesuffix(".weight")
        # routed experts are one vLLM module (RoutedExperts), asked for by its own prefix
        prefix = re.sub(r"\.experts\.\d+\.[^.]+$", ".experts", prefix)
        excluded = quant_config.is_layer_excluded(prefix)
        algo = None if excluded else (resolve(prefix) if resolve else (str(uniform).upper() if uniform else None))
        served = ALGO_FORMAT.get(algo, "bf16") if algo else "bf16"
        layers[module] = {"vllm_name": prefix, "stored": stored, "quant_algo": algo, "served_as": served}
        if served != stored:
            problems.append(f"{module}: stored as {stored}, vLLM would read it as {served} "
                            f"({'excluded' if excluded else algo or 'no algorithm'})")
    return {"vllm_version": vllm.__version__, "quantization": method, "architecture": arch,
            "kv_cache_dtype": resolve_kv_cache_dtype_string("auto", model_config),
            "layers": layers, "problems": problems, "passed": not problems}


def cpu_kv_cache_limit(kv_cache_dtype: str) -> str | None:
    """Why vLLM's CPU attention cannot hold this KV-cache dtype, or None (also on a GPU).

    vLLM's CPU platform does not check the dtype against its attention backend: an `nvfp4` KV cache
    is accepted on an AVX-512 CPU and then run by kernels that implement the FP8 formats only (the
    backend's own `supported_kv_cache_dtypes`), so what is served is not NVFP4. The backend's list
    decides here, before anything loads."""
    from vllm.platforms import current_platform
    from vllm.utils.torch_utils import is_quantized_kv_cache

    if not current_platform.is_cpu() or not is_quantized_kv_cache(kv_cache_dtype):
        return None
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    if CPUAttentionBackend.supports_kv_cache_dtype(kv_cache_dtype):
        return None
    return (f"vLLM's CPU attention backend runs KV caches in {', '.join(CPUAttentionBackend.supported_kv_cache_dtypes)}"
            f", not {kv_cache_dtype}")


def full_check(folder: Path, prompts: list[list[int]], k: int, max_model_len: int, kv_cache_dtype: str,
               weights_only: bool = False) -> dict:
    """vLLM's prompt log-probs. Where this machine cannot run the checkpoint's quantized KV cache
    (vLLM's CPU build needs AVX-512 or AMX for FP8 and has no NVFP4 KV-cache kernel), the weights are
    still checked, with a BF16 KV cache, and the result says so: the KV-cache format is then
    checked at the config level only. `weights_only` (the w4a16 view, which checks the weights
    against a student with its KV-cache quantizers off) serves the KV cache in BF16 everywhere."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    settings = dict(model=str(folder), dtype="bfloat16", max_model_len=max_model_len, max_logprobs=k, seed=0,
                    enforce_eager=True, max_num_seqs=len(prompts))
    kv_fallback = "the w4a16 view checks the weights: KV cache in BF16" if weights_only else \
        cpu_kv_cache_limit(kv_cache_dtype)
    if kv_fallback:
        settings["kv_cache_dtype"] = "bfloat16"
    try:
        llm = LLM(**settings)
    except NotImplementedError as err:
        if "KV cache" not in str(err):
            raise
        kv_fallback = str(err)
        llm = LLM(**{**settings, "kv_cache_dtype": "bfloat16"})
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts],
                        SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=k, detokenize=False),
                        use_tqdm=False)
    positions = []
    for out in outs:
        # entry t is the distribution of token t given tokens < t; the first one is None
        positions.append([[[int(t) for t in entry], [float(lp.logprob) for lp in entry.values()]]
                          for entry in out.prompt_logprobs[1:]])
    config = llm.llm_engine.vllm_config
    return {"prompt_logprobs": positions, "kv_cache_dtype": config.cache_config.cache_dtype,
            "quantization": config.model_config.quantization, "kv_cache_fallback": kv_fallback}


def serve_args(command: str) -> dict:
    """Parse a `vllm serve DIR ...` command with vLLM's own server argument parser and build its
    model config: vLLM raises on an option it does not know, a value it does not accept, or a
    `--quantization` that contradicts the checkpoint. Prints what vLLM would run."""
    import shlex

    from vllm.engine.arg_utils import EngineArgs
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser
    from vllm.utils.torch_utils import resolve_kv_cache_dtype_string

    words = shlex.split(command)
    if words[:2] != ["vllm", "serve"] or len(words) < 3:
        raise SystemExit(f"not a `vllm serve MODEL ...` command: {command}")
    args = make_arg_parser(FlexibleArgumentParser()).parse_args(["--model", words[2], *words[3:]])
    model_config = EngineArgs.from_cli_args(args).create_model_config()
    return {"quantization": model_config.quantization,
            "kv_cache_dtype": resolve_kv_cache_dtype_string(args.kv_cache_dtype, model_config)}


def as_w4a16(value):
    """A quantization config with every NVFP4 algorithm read as W4A16_NVFP4 (activations in BF16)."""
    if isinstance(value, list):
        return [as_w4a16(v) for v in value]
    if not isinstance(value, dict):
        return value
    out = {k: ("W4A16_NVFP4" if k == "quant_algo" and v == "NVFP4" else as_w4a16(v)) for k, v in value.items()}
    if (out.get("weights") or {}).get("num_bits") == 4:  # a compressed-tensors style group of NVFP4 weights
        out.pop("input_activations", None)
    return out


def w4a16_copy(folder: Path, dest: Path) -> Path:
    """`folder` served as W4A16: links to its files, its two quantization configs rewritten."""
    for file in folder.iterdir():
        if file.name not in ("hf_quant_config.json", "config.json"):
            os.symlink(file.resolve(), dest / file.name)
    for name, key in (("hf_quant_config.json", "quantization"), ("config.json", "quantization_config")):
        data = json.loads((folder / name).read_text())
        if key in data:
            data[key] = as_w4a16(data[key])
        (dest / name).write_text(json.dumps(data, indent=1))
    return dest


def main() -> int:
    if sys.argv[1] == "--serve-args":
        print(json.dumps(serve_args(sys.argv[2])))
        return 0
    folder, request_file, out_file = (Path(a) for a in sys.argv[1:4])
    request = json.loads(request_file.read_text())
    sides = {}
    for view in request["views"]:  # one engine after the other, in this process
        if view == "w4a16":
            with tempfile.TemporaryDirectory(prefix="qad-w4a16-") as tmp:
                sides[view] = check(w4a16_copy(folder, Path(tmp)), request, weights_only=True)
        else:
            sides[view] = check(folder, request)
        gc.collect()  # the view's engine, before the next one starts
    Path(out_file).write_text(json.dumps(sides))
    return 0


def check(folder: Path, request: dict, weights_only: bool = False) -> dict:
    out: dict = {"config": None, "full": None, "full_error": None, "platform_limit": False}
    out["config"] = config_check(folder, request["max_model_len"])
    if request["level"] in ("auto", "full") and out["config"]["quantization"] is not None:
        try:
            out["full"] = full_check(folder, request["prompts"], request["logprobs"], request["max_model_len"],
                                     out["config"]["kv_cache_dtype"], weights_only)
        except Exception as err:  # noqa: BLE001  (reported to the project side, which decides)
            text = "".join(traceback.format_exception_only(type(err), err)).strip()
            out["full_error"] = text[-2000:]
            out["platform_limit"] = any(m in text for m in PLATFORM_LIMITS) or (
                on_cpu() and any(m in text for m in CPU_LIMITS))
    return out


if __name__ == "__main__":
    sys.exit(main())
