"""Models for the benchmarks and the GPU check, built from a config (random weights, no hub).

    python benchmarks/models.py OUT_DIR [--layers 8] [--hidden 768] [--vocab 32768]

`build_llama` writes a Llama-architecture causal LM of about 100M parameters with a 32K
vocabulary (untied `lm_head`) and the demo model's tokenizer (its 4K token ids are a subset of
the vocabulary, so every logit row still has the model's full width). Random initialisation is
enough for what it measures: memory, speed, and that every stage runs on the architecture.
`llama_1b_config`, `tiny_config` and `teacher_and_student` build in memory (benchmarks/qad_throughput.py).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import io
import shutil
from pathlib import Path

import torch

DEMO_MODEL = Path(__file__).resolve().parent.parent / "demo" / "model"
DEFAULT_RECIPE = DEMO_MODEL.parent.parent / "recipes" / "nvfp4_max-mamba_fp8-kv_fp8.yaml"  # ptq.recipes' first


def build_llama(out_dir: Path, layers: int = 8, hidden: int = 768, vocab: int = 32768, seed: int = 0) -> Path:
    """A ~100M-parameter LlamaForCausalLM in bfloat16 at `out_dir` (returned)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    out_dir = Path(out_dir)
    if (out_dir / "config.json").is_file():
        return out_dir
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 8 // 3 // 64 * 64,
        num_hidden_layers=layers, num_attention_heads=hidden // 64, num_key_value_heads=max(1, hidden // 256),
        max_position_embeddings=4096, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(out_dir)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(DEMO_MODEL / name, out_dir / name)
    return out_dir


def llama_1b_config(tied: bool = False, vocab: int = 128256):
    """Llama-3.2-1B's shape (hidden 2048, 16 layers, MLP 8192, 32 heads, 8 KV heads, 128K vocabulary,
    RoPE theta 500K): 1.24B parameters tied as released; untied (the default here, an NVFP4 `lm_head` as
    in the larger Llamas) 1.50B."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
        num_key_value_heads=8, head_dim=64, max_position_embeddings=131072, rope_theta=500000.0,
        tie_word_embeddings=tied, bos_token_id=1, eos_token_id=2, pad_token_id=0, use_cache=False,
    )


def tiny_config(vocab: int = 32768, hidden: int = 256):
    """A two-layer Llama for CPU runs of the benchmarks."""
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 8 // 3 // 64 * 64,
                       num_hidden_layers=2, num_attention_heads=hidden // 64, num_key_value_heads=2,
                       tie_word_embeddings=False, use_cache=False)


def teacher_and_student(config, device: torch.device, seq: int):
    """(teacher, student) on `device`, random weights: the teacher in BF16 (float32 on a CPU), the student a
    float32 copy quantized with the default PTQ recipe, calibrated on two random rows of `seq` tokens."""
    from transformers import LlamaForCausalLM

    from tasks.ptq import quantize_model

    torch.manual_seed(0)
    with device:
        teacher = LlamaForCausalLM(config).to(torch.bfloat16 if device.type == "cuda" else torch.float32)
    teacher.eval().requires_grad_(False)
    student = copy.deepcopy(teacher).float().requires_grad_(True).train()
    samples = torch.randint(0, config.vocab_size, (2, seq))
    with quiet():
        student = quantize_model(student, DEFAULT_RECIPE, samples, batch_size=1)
    return teacher, student


@contextlib.contextmanager
def quiet():
    """Model Optimizer's and the cache writer's own lines (and progress bars) off the benchmark's output."""
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        yield


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out_dir", type=Path)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--vocab", type=int, default=32768)
    args = ap.parse_args()
    folder = build_llama(args.out_dir, args.layers, args.hidden, args.vocab)
    from transformers import AutoConfig

    n = sum(p.numel() for p in __import__("transformers").AutoModelForCausalLM.from_config(
        AutoConfig.from_pretrained(folder)).parameters())
    print(f"{folder}: {n / 1e6:.1f}M parameters")


if __name__ == "__main__":
    main()
