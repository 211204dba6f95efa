"""The calibration stage's manifest: artifacts/calibration/manifest.json."""

from __future__ import annotations


from qad_pipeline.results.base import Strict


class CalibrationSet(Strict):
    samples: int
    seq_len: int
    fingerprint: str


class HeldOutSet(Strict):
    ppl_samples: int
    seq_len: int
    heldout_cloze: int
    heldout_continuation: int
    fingerprint: str


class CalibrationManifest(Strict):  # artifacts/calibration/manifest.json (tasks/calibration.py)
    source: str
    revision: str | None = None  # a hub dataset's, as pinned in calibration.revision
    documents: int  # documents read (a hub dataset: the first ones of its stream, until enough tokens)
    calibration_documents: list[int]
    eval_documents: list[int]
    calibration: CalibrationSet
    eval: HeldOutSet
    tokenizer: str
    seed: int
