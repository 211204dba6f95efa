"""The BF16 reference distribution: written once by the baseline stage, read streaming by every eval.

The baseline stage runs the BF16 model over the held-out windows once and keeps, per position, the
`eval.kl_top_k` most likely next tokens with their log-probabilities plus the log of the
probability mass of all other tokens (`artifacts/baseline/reference/`, numpy arrays on disk):

    topk_ids.npy       int32    [windows, positions, k]
    topk_logprobs.npy  float32  [windows, positions, k]
    rest_logmass.npy   float32  [windows, positions]      log(1 - sum of the top-k probabilities)
    manifest.json      k, shapes, the windows' fingerprint, the model's identity, a content hash

Its size is windows x positions x (8k + 4) bytes, whatever the vocabulary (6.3 MB for the demo's
48 x 255 positions at k = 64, where full float32 rows at a 128K vocabulary would be 6.3 GB). Every
PTQ recipe, the final eval and the benchmarks read it instead of running the BF16 model again.

The KL estimator. With p the BF16 distribution at a position and q the evaluated model's, let
S be p's top-k tokens and R the rest. What is computed is the KL divergence between the two
distributions coarsened to S plus one bucket R:

    KL_k = sum_{i in S} p_i (log p_i - log q_i)  +  p_R (log p_R - log q_R),
    p_R = 1 - sum_{i in S} p_i,  q_R = 1 - sum_{i in S} q_i.

By the log-sum inequality KL_k <= KL(p || q), and the gap is p_R * KL(p|R || q|R): the rest mass
times the divergence of the two distributions inside the rest. It is exact when the top k hold
all of p's mass and shrinks as k grows; `tests/test_reference.py` bounds it on the demo model.
The evaluated model's log-probs are computed chunk by chunk of positions (`LOGIT_CHUNK_TOKENS`)
and never held for more than one chunk, so no process holds [windows, positions, vocab].
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from qad_pipeline.artifacts import read_json, write_json

# Tokens per chunk of logits: the largest [tokens, vocab] float32 block an eval holds at once
# (2048 x 128K vocabulary = 1 GiB). The memory plan uses the same number.
LOGIT_CHUNK_TOKENS = 2048
FILES = ("topk_ids.npy", "topk_logprobs.npy", "rest_logmass.npy")
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
    from qad_pipeline.modeling import input_device

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


def top_k_terms(logprobs: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(top-k ids, their log-probs, log of the remaining mass) of log-probs [..., vocab]."""
    values, ids = logprobs.topk(min(k, logprobs.shape[-1]), dim=-1)
    rest = logprobs.scatter(-1, ids, float("-inf")).logsumexp(-1)
    return ids, values, rest


def coarse_kl(ref_ids: torch.Tensor, ref_lp: torch.Tensor, ref_rest: torch.Tensor, logprobs: torch.Tensor) -> torch.Tensor:
    """KL_k per position (see the module docstring): the reference's top-k + rest vs `logprobs`."""
    q_top = logprobs.gather(-1, ref_ids)
    q_rest = logprobs.scatter(-1, ref_ids, float("-inf")).logsumexp(-1)
    p_top = ref_lp.exp()
    top = (p_top * (ref_lp - q_top)).sum(-1)
    p_rest = ref_rest.exp()
    rest = torch.where(p_rest > 0, p_rest * (ref_rest - q_rest), torch.zeros_like(p_rest))
    return top + rest


class ReferenceWriter:
    """Writes the reference arrays as they stream in (memory-mapped .npy files)."""

    def __init__(self, folder: Path, windows: int, positions: int, k: int):
        folder.mkdir(parents=True, exist_ok=True)
        self.folder, self.k = folder, k
        open_memmap = np.lib.format.open_memmap
        self.ids = open_memmap(folder / FILES[0], mode="w+", dtype=np.int32, shape=(windows, positions, k))
        self.lp = open_memmap(folder / FILES[1], mode="w+", dtype=np.float32, shape=(windows, positions, k))
        self.rest = open_memmap(folder / FILES[2], mode="w+", dtype=np.float32, shape=(windows, positions))

    def write(self, i: int, s: int, e: int, logprobs: torch.Tensor) -> None:
        ids, values, rest = top_k_terms(logprobs, self.k)
        b = logprobs.shape[0]
        self.ids[i : i + b, s:e] = ids.cpu().numpy()
        self.lp[i : i + b, s:e] = values.cpu().numpy()
        self.rest[i : i + b, s:e] = rest.cpu().numpy()

    def close(self, manifest: dict) -> dict:
        for arr in (self.ids, self.lp, self.rest):
            arr.flush()
        del self.ids, self.lp, self.rest
        digest = hashlib.sha256()
        for name in FILES:
            with (self.folder / name).open("rb") as f:
                for block in iter(lambda: f.read(1 << 24), b""):
                    digest.update(block)
        manifest = {**manifest, "k": self.k, "estimator": "top-k + rest-mass KL (a lower bound of the full KL)",
                    "fingerprint": digest.hexdigest()}
        write_json(self.folder / "manifest.json", manifest)
        return manifest


class Reference:
    """The reference on disk, read slice by slice (memory-mapped)."""

    def __init__(self, folder: Path):
        manifest = Path(folder) / "manifest.json"
        if not manifest.is_file():
            from qad_pipeline.config import ConfigError

            raise ConfigError(f"no BF16 reference at {folder} (no manifest.json); run the baseline stage first")
        self.folder, self.manifest = Path(folder), read_json(manifest)
        self.ids, self.lp, self.rest = (np.load(self.folder / name, mmap_mode="r") for name in FILES)

    def check_windows(self, windows: torch.Tensor) -> None:
        """The reference was computed on exactly these windows."""
        from qad_pipeline.config import ConfigError

        if self.manifest.get("windows_fingerprint") != windows_fingerprint(windows):
            raise ConfigError(f"the BF16 reference at {self.folder} was computed on other eval windows; "
                              "run the baseline stage again")

    def kl_sum(self, i: int, s: int, e: int, logprobs: torch.Tensor) -> float:
        b = logprobs.shape[0]
        device = logprobs.device
        terms = [torch.from_numpy(np.ascontiguousarray(a[i : i + b, s:e])).to(device) for a in (self.ids, self.lp)]
        rest = torch.from_numpy(np.ascontiguousarray(self.rest[i : i + b, s:e])).to(device)
        return coarse_kl(terms[0].long(), terms[1], rest, logprobs).sum().item()


def windows_fingerprint(windows: torch.Tensor) -> str:
    return hashlib.sha256(windows.numpy().astype(np.int64).tobytes()).hexdigest()


@torch.no_grad()
def score_windows(
    model, windows: torch.Tensor, batch_size: int, reference: Reference | None = None,
    writer: ReferenceWriter | None = None,
) -> dict:
    """Perplexity over the windows, and KL_k to `reference` (or the reference written to `writer`)."""
    nll, count, kl = 0.0, 0, 0.0
    for i, s, e, lp in logprob_chunks(model, windows, batch_size):
        targets = windows[i : i + lp.shape[0], s + 1 : e + 1].to(lp.device)
        nll -= lp.gather(-1, targets.unsqueeze(-1)).sum().item()
        count += targets.numel()
        if writer is not None:
            writer.write(i, s, e, lp)
        if reference is not None:
            kl += reference.kl_sum(i, s, e, lp)
    out = {"perplexity": math.exp(nll / count)}
    if reference is not None:
        out["kl_divergence"] = kl / count
    return out
