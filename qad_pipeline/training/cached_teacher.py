"""The cached teacher (`qad.teacher: cached`): the BF16 teacher's next-token distribution over
QAD's training windows, written once by the `teacher_cache` stage and read streaming by QAD,
which then never loads the teacher.

What is stored, per training window QAD will draw and per position (all `qad.seq_len` of them, as
the live loss counts them): the teacher's `qad.teacher_top_k` most likely tokens with their
log-probabilities at `qad.temperature`, the log of the rest's mass, and `qad.teacher_tail_samples`
tokens drawn from the rest in proportion to their probability, with their log-probabilities: the
format of the baseline's BF16 reference (`qad_pipeline.scoring.reference`, the same writer), so
(8k + 8m + 4) bytes per token whatever the vocabulary: 516 bytes at k = m = 32.

The loss. The live loss is Model Optimizer's `LogitsDistillationLoss`: per position
T^2 KL(p || q), p and q the teacher's and the student's softmax at temperature T. From the cache:

    T^2 [ sum_{i in S} p_i (log p_i - log q_i)  +  p_R * mean_j (log p_{r_j} - log q_{r_j}) ]

S the stored top k, p_R the rest's mass and r_j its samples (drawn from p restricted to the rest).
Its expectation over the samples is the exact KL, and so is its gradient with respect to the
student (p does not depend on the student): the estimator is unbiased; its sampling noise falls as
1/sqrt(m x tokens) and is frozen into the cache (the same samples every epoch). It is exact when
the top k hold all of p's mass. With m = 0 the rest is one bucket, p_R log(p_R / q_R): biased low
(the KL within the rest is dropped; 16 % low at k = 64 on the demo's eval windows, see
`qad_pipeline.scoring.reference`). `kl_estimate` there computes both.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from qad_pipeline.core.config import ConfigError, Params
from qad_pipeline.training.training_text import batch_indices
from qad_pipeline.scoring.reference import FILES, LOGIT_CHUNK_TOKENS, ReferenceWriter, _head_only, kl_estimate


def used_windows(count: int, params: Params) -> np.ndarray:
    """The windows QAD's `qad.steps` steps of `qad.batch_size` x `qad.grad_accum` rows draw, sorted."""
    q = params.qad
    stream = batch_indices(count, q.batch_size * q.grad_accum, q.seed)
    return np.unique(np.concatenate([next(stream) for _ in range(q.steps)]))


def cache_key(params: Params, windows: np.ndarray) -> str:
    """What the cache stands for: the training windows' tokens and the teacher's settings."""
    q, digest = params.qad, hashlib.sha256(np.ascontiguousarray(windows, dtype=np.int64).tobytes())
    digest.update(repr((params.base_model.model_dump(), q.temperature, q.teacher_top_k, q.teacher_tail_samples,
                        q.steps, q.batch_size * q.grad_accum, q.seed)).encode())
    return digest.hexdigest()


@torch.no_grad()
def write_cache(teacher, windows: np.ndarray, params: Params, folder: Path, batch_size: int) -> dict:
    """Run the teacher over the windows QAD will draw; write its top-k + tail at qad.temperature."""
    from tqdm import tqdm

    from qad_pipeline.core.modeling import input_device

    q = params.qad
    used = used_windows(len(windows), params)
    writer = ReferenceWriter(folder, len(used), q.seq_len, teacher.config.vocab_size, q.teacher_top_k,
                             q.teacher_tail_samples, seed=q.seed)
    head, device = teacher.get_output_embeddings(), input_device(teacher)
    for i in tqdm(range(0, len(used), batch_size), desc="teacher cache", unit="batch"):
        batch = torch.from_numpy(windows[used[i : i + batch_size]]).to(device)
        if _head_only(teacher):  # the output embedding runs per chunk of positions, as in the reference
            hidden, logits = teacher.base_model(input_ids=batch).last_hidden_state, None
        else:
            hidden, logits = None, teacher(input_ids=batch).logits
        step = max(1, LOGIT_CHUNK_TOKENS // len(batch))
        for s in range(0, q.seq_len, step):
            e = min(q.seq_len, s + step)
            part = head(hidden[:, s:e]) if logits is None else logits[:, s:e]
            writer.write(i, s, e, F.log_softmax(part.float() / q.temperature, dim=-1))
    return writer.close({"windows": used.tolist(), "seq_len": q.seq_len, "temperature": q.temperature,
                         "key": cache_key(params, windows), "bytes_per_token": 8 * writer.k + 8 * writer.m + 4})


class TeacherCache:
    """The cache on disk (memory-mapped), for the windows it was written for."""

    def __init__(self, folder: Path, params: Params, windows: np.ndarray):
        from qad_pipeline.core.artifacts import read_json

        manifest = Path(folder) / "manifest.json"
        if not manifest.is_file():
            raise ConfigError(f"qad.teacher is cached but there is no teacher cache at {folder}; run the "
                              "teacher_cache stage first")
        self.manifest = read_json(manifest)
        if self.manifest.get("key") != cache_key(params, windows):
            raise ConfigError(f"the teacher cache at {folder} was written for other training windows or teacher "
                              "settings; run the teacher_cache stage again")
        self.row = {w: r for r, w in enumerate(self.manifest["windows"])}
        self.arrays = [np.load(Path(folder) / name, mmap_mode="r") for name in FILES]

    def loss(self, indices: np.ndarray, student_logits: torch.Tensor, temperature: float) -> torch.Tensor:
        """Per-position T^2 KL estimate ([rows, seq_len]) for the windows `indices` (module docstring)."""
        rows = [self.row[int(w)] for w in indices]
        device = student_logits.device
        top_ids, top_lp, tail_ids, tail_lp, rest = (torch.from_numpy(np.asarray(a[rows])).to(device)
                                                    for a in self.arrays)
        student = F.log_softmax(student_logits / temperature, dim=-1)
        return temperature**2 * kl_estimate(top_ids.long(), top_lp, tail_ids.long(), tail_lp, rest, student)
