"""QAD's training text: the windows of `qad.seq_len` tokens (`training_windows`) and the seeded
order in which QAD draws them (`batch_indices`), shared by the QAD stage and the teacher cache."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from qad_pipeline.core.config import ConfigError, Params
from qad_pipeline.results.base import read_result
from qad_pipeline.results.data import CalibrationManifest


def training_windows(params: Params, tokenizer, data_dir: Path) -> np.ndarray:
    """QAD training text at qad.seq_len: the calibration documents unless qad.source is set."""
    from qad_pipeline.core.calibration_data import TokenBudget, read_documents, token_windows
    from qad_pipeline.core.config import looks_local

    cal, q = params.calibration, params.qad
    if q.source is None:  # the documents the calibration stage read (a hub dataset: its first ones)
        manifest = read_result(Path(data_dir) / "manifest.json", CalibrationManifest)
        docs = read_documents(cal, limit=manifest.documents)
        docs = [docs[i] for i in manifest.calibration_documents]
    else:  # a hub dataset is read until it holds the tokens of every step once
        enough = None if looks_local(q.source) else TokenBudget(
            tokenizer, [(q.steps * q.batch_size * q.grad_accum * q.seq_len, 1.0)])
        docs = read_documents(cal.model_copy(update={"source": q.source}), enough)
    windows = token_windows(docs, tokenizer, params.qad.seq_len)
    if len(windows) < q.batch_size * q.grad_accum:
        raise ConfigError(
            f"QAD training text yields {len(windows)} windows of qad.seq_len = {q.seq_len} tokens, fewer than one "
            f"optimizer step's qad.batch_size x qad.grad_accum = {q.batch_size} x {q.grad_accum}"
        )
    return windows


def batch_indices(count: int, batch_size: int, seed: int, skip: int = 0):
    """QAD's batches as window indices: an endless, seeded stream, reshuffled every epoch; `skip`
    fast-forwards (resume). The live loop and the cache draw the same windows: whole optimizer steps
    (`batch_size` = a step's rows), whatever micro-batches the loop splits them into."""
    rng = np.random.default_rng(seed)
    n = 0
    while True:
        order = rng.permutation(count)
        for i in range(0, len(order) - batch_size + 1, batch_size):
            if n >= skip:
                yield order[i : i + batch_size]
            n += 1
