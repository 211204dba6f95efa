"""Models for the benchmarks and the GPU check, built from a config (random weights, no hub).

    python benchmarks/models.py OUT_DIR [--layers 8] [--hidden 768] [--vocab 32768]

`build_llama` writes a Llama-architecture causal LM of about 100M parameters with a 32K
vocabulary (untied `lm_head`) and the demo model's tokenizer (its 4K token ids are a subset of
the vocabulary, so every logit row still has the model's full width). Random initialisation is
enough for what it measures: memory, speed, and that every stage runs on the architecture.
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import torch

DEMO_MODEL = Path(__file__).resolve().parent.parent / "demo" / "model"


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
