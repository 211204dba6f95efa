"""The BF16 reference distribution: written once by the baseline stage, read streaming by every eval.

The baseline stage runs the BF16 model over the held-out windows once and keeps, per position, the
`eval.kl_top_k` most likely next tokens with their log-probabilities, the log of the probability
mass of all other tokens (the tail), and `eval.kl_tail_samples` tokens drawn from the tail in
proportion to their probability, with their log-probabilities (`artifacts/baseline/reference/`,
numpy arrays on disk, written and read memory-mapped):

    topk_ids.npy  topk_logprobs.npy    int32 / float32  [windows, positions, k]
    tail_ids.npy  tail_logprobs.npy    int32 / float32  [windows, positions, m]
    rest_logmass.npy                   float32          [windows, positions]   log p(tail)
    manifest.json                      k, m, shapes, the windows' fingerprint, a content hash

Its size is windows x positions x (8k + 8m + 4) bytes, whatever the vocabulary: 6.3 MB for the
demo's 48 x 255 positions at k = m = 32, where full float32 rows at a 128K vocabulary would be
6.3 GB. Every PTQ recipe and the final eval read it instead of running the BF16 model again.

The KL estimator. With p the BF16 distribution at a position, q the evaluated model's, S p's
top-k tokens, T the rest (the tail) and p_T its mass:

    KL(p || q) = sum_{i in S} p_i (log p_i - log q_i)  +  p_T * E_{i ~ p|T} [log p_i - log q_i]

The first sum is computed exactly; the expectation over the tail is the mean over the m stored
samples, drawn with replacement from p restricted to T (seeded, so the file is reproducible).
The estimate is therefore unbiased, exact when the top k hold all of p's mass, and its sampling
error falls as 1/sqrt(m x positions). On the demo model (4K vocabulary, perplexity ~60, so much
mass in the tail) at k = m = 32 over 252 positions, five seeds came within 3.8 % of the exact
full-vocabulary KL. With m = 0 the tail counts as one bucket, p_T log(p_T / q_T): a lower bound
of the KL (log-sum inequality), which at k = 64 was 16 % low on the demo.
`tests/test_reference.py` bounds the difference on the demo. The evaluated model's log-probs are
computed chunk by chunk of positions (`LOGIT_CHUNK_TOKENS`) and never held for more than one
chunk, so no process holds [windows, positions, vocab].
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from qad_pipeline.core.artifacts import read_json, write_json

# Tokens per chunk of logits: the largest [tokens, vocab] float32 block an eval holds at once
# (2048 x 128K vocabulary = 1 GiB). The memory plan uses the same number.
LOGIT_CHUNK_TOKENS = 2048
FILES = ("topk_ids.npy", "topk_logprobs.npy", "tail_ids.npy", "tail_logprobs.npy", "rest_logmass.npy")
# Config keys of models whose forward does more to the logits than the output embedding does:
# those are scored through their full forward (still chunked afterwards).
_LOGIT_POSTPROCESSING = ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier_scale")


def _head_only(model) -> bool:
    cfg = model.config
    return not any(getattr(cfg, key, None) not in (None, 1, 1.0) for key in _LOGIT_POSTPROCESSING)


def logprob_chunks(
    model, windows: torch.Tensor, batch_size: int, chunk_tokens: int = LOGIT_CHUNK_TOKENS
) -> Iterator[tuple[int, int, int, torch.Tensor]]:
    """(first window, first position, end position, next-token log-probs [b, e-s, vocab] float32).

    Position t's log-probs predict token t + 1 of the window. The backbone runs once per batch;
    the output embedding (`lm_head`, quantized or not) runs per chunk of positions.
    """
    from qad_pipeline.core.modeling import input_device

    device = input_device(model)
    head = model.get_output_embeddings()
    positions = windows.shape[1] - 1
    for i in range(0, len(windows), batch_size):
        batch = windows[i : i + batch_size].to(device)
        if _head_only(model):
            hidden, logits = model.base_model(input_ids=batch).last_hidden_state, None
        else:
            hidden, logits = None, model(input_ids=batch).logits
        step = max(1, chunk_tokens // len(batch))
        for s in range(0, positions, step):
            e = min(positions, s + step)
            part = head(hidden[:, s:e]) if logits is None else logits[:, s:e]
            yield i, s, e, F.log_softmax(part.float(), dim=-1)
        del hidden, logits


def reference_terms(logprobs: torch.Tensor, k: int, m: int, generator: torch.Generator) -> tuple[torch.Tensor, ...]:
    """(top-k ids, their log-probs, tail sample ids, their log-probs, log tail mass) of [..., vocab]."""
    vocab = logprobs.shape[-1]
    top_lp, top_ids = logprobs.topk(min(k, vocab), dim=-1)
    tail = logprobs.scatter(-1, top_ids, float("-inf"))
    rest = tail.logsumexp(-1)
    if m == 0 or k >= vocab:
        return top_ids, top_lp, top_ids[..., :0], top_lp[..., :0], rest
    weights = (tail - rest.unsqueeze(-1)).exp().reshape(-1, vocab)
    weights[~torch.isfinite(rest).reshape(-1)] = 1.0  # no tail mass: any token, weighted by p_T = 0
    tail_ids = torch.multinomial(weights.cpu(), m, replacement=True, generator=generator)
    tail_ids = tail_ids.to(logprobs.device).reshape(*logprobs.shape[:-1], m)
    return top_ids, top_lp, tail_ids, logprobs.gather(-1, tail_ids), rest


def kl_estimate(top_ids, top_lp, tail_ids, tail_lp, rest, logprobs: torch.Tensor) -> torch.Tensor:
    """The estimate of KL(p || q) per position (module docstring); `logprobs` is q, [..., vocab]."""
    exact_part = (top_lp.exp() * (top_lp - logprobs.gather(-1, top_ids))).sum(-1)
    has_tail = torch.isfinite(rest)
    p_tail = torch.where(has_tail, rest.exp(), torch.zeros_like(rest))
    if tail_ids.shape[-1] == 0:  # no samples: the tail as one bucket, p_T log(p_T / q_T) (a lower bound)
        q_tail = logprobs.scatter(-1, top_ids, float("-inf")).logsumexp(-1)
        return exact_part + torch.where(has_tail, p_tail * (rest - q_tail), torch.zeros_like(rest))
    return exact_part + p_tail * (tail_lp - logprobs.gather(-1, tail_ids)).mean(-1)


class ReferenceWriter:
    """Writes the reference arrays as they stream in (memory-mapped .npy files)."""

    def __init__(self, folder: Path, windows: int, positions: int, vocab: int, k: int, m: int, seed: int = 0):
        folder.mkdir(parents=True, exist_ok=True)
        k = min(k, vocab)
        m = 0 if k == vocab else m  # the top k hold the whole vocabulary: exact, nothing to sample
        self.folder, self.k, self.m = folder, k, m
        self.generator = torch.Generator().manual_seed(seed)
        shapes = ((windows, positions, k), (windows, positions, k), (windows, positions, m),
                  (windows, positions, m), (windows, positions))
        dtypes = (np.int32, np.float32, np.int32, np.float32, np.float32)
        self.arrays = [np.lib.format.open_memmap(folder / name, mode="w+", dtype=dtype, shape=shape)
                       for name, dtype, shape in zip(FILES, dtypes, shapes, strict=True)]

    def write(self, i: int, s: int, e: int, logprobs: torch.Tensor) -> None:
        b = logprobs.shape[0]
        terms = reference_terms(logprobs, self.k, self.m, self.generator)
        for array, term in zip(self.arrays, terms, strict=True):
            array[i : i + b, s:e] = term.cpu().numpy()

    def close(self, manifest: dict) -> dict:
        for array in self.arrays:
            array.flush()
        del self.arrays
        digest = hashlib.sha256()
        for name in FILES:
            with (self.folder / name).open("rb") as f:
                for block in iter(lambda: f.read(1 << 24), b""):
                    digest.update(block)
        manifest = {**manifest, "k": self.k, "tail_samples": self.m, "fingerprint": digest.hexdigest(),
                    "estimator": "exact over the top-k tokens + Monte-Carlo over the tail (unbiased)"}
        write_json(self.folder / "manifest.json", manifest)
        return manifest


class Reference:
    """The reference on disk, read slice by slice (memory-mapped)."""

    def __init__(self, folder: Path):
        manifest = Path(folder) / "manifest.json"
        if not manifest.is_file():
            from qad_pipeline.core.config import ConfigError

            raise ConfigError(f"no BF16 reference at {folder} (no manifest.json); run the baseline stage first")
        self.folder, self.manifest = Path(folder), read_json(manifest)
        self.arrays = [np.load(self.folder / name, mmap_mode="r") for name in FILES]

    def check_windows(self, windows: torch.Tensor) -> None:
        """The reference was computed on exactly these windows."""
        from qad_pipeline.core.config import ConfigError

        if self.manifest.get("windows_fingerprint") != windows_fingerprint(windows):
            raise ConfigError(f"the BF16 reference at {self.folder} was computed on other eval windows; "
                              "run the baseline stage again")

    def kl_sum(self, i: int, s: int, e: int, logprobs: torch.Tensor, rows: list[int] | None = None) -> float:
        """Sum over the positions of logprobs ([b, e - s, vocab], windows i.., positions s..e); with
        `rows`, window j of the batch is the reference's window rows[i + j]."""
        b = logprobs.shape[0]
        picked = slice(i, i + b) if rows is None else np.asarray(rows[i : i + b])
        top_ids, top_lp, tail_ids, tail_lp, rest = (
            torch.from_numpy(np.array(a[picked, s:e])).to(logprobs.device) for a in self.arrays)
        return kl_estimate(top_ids.long(), top_lp, tail_ids.long(), tail_lp, rest, logprobs).sum().item()


def windows_fingerprint(windows: torch.Tensor) -> str:
    return hashlib.sha256(windows.numpy().astype(np.int64).tobytes()).hexdigest()


@torch.no_grad()
def score_windows(
    model, windows: torch.Tensor, batch_size: int, reference: Reference | None = None,
    writer: ReferenceWriter | None = None, rows: list[int] | None = None,
) -> dict:
    """Perplexity over the windows, and KL_k to `reference` (or the reference written to `writer`);
    `rows`: the reference's index of each window (racing scores a subset of them).

    Also each window's negative log-likelihood summed over its positions (`window_nll`), the
    items that the recovery's confidence interval resamples.
    """
    nll, count, kl = 0.0, 0, 0.0
    window_nll = torch.zeros(len(windows), dtype=torch.float64)
    for i, s, e, lp in logprob_chunks(model, windows, batch_size):
        targets = windows[i : i + lp.shape[0], s + 1 : e + 1].to(lp.device)
        picked = -lp.gather(-1, targets.unsqueeze(-1)).squeeze(-1).double().sum(-1).cpu()
        window_nll[i : i + lp.shape[0]] += picked
        nll += picked.sum().item()
        count += targets.numel()
        if writer is not None:
            writer.write(i, s, e, lp)
        if reference is not None:
            kl += reference.kl_sum(i, s, e, lp, rows)
    out = {"perplexity": math.exp(nll / count), "window_nll": window_nll.tolist()}
    if reference is not None:
        out["kl_divergence"] = kl / count
    return out
