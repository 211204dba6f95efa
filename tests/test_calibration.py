"""The calibration stage: deterministic, disjoint splits, fingerprints that follow the data."""

import numpy as np
from transformers import AutoTokenizer

from qad_pipeline.artifacts import read_json
from qad_pipeline.calibration_data import load_calibration, split_documents
from qad_pipeline.config import load_params
from tasks.calibration import build_calibration


def test_split_is_disjoint_seeded_and_nonempty():
    cal, ev = split_documents(21, 0.5, seed=0)
    assert set(cal).isdisjoint(ev) and len(cal) + len(ev) == 21 and cal and ev
    assert split_documents(21, 0.5, seed=0) == (cal, ev)
    assert split_documents(21, 0.5, seed=1) != (cal, ev)
    assert split_documents(2, 0.99, seed=0)[0]  # always leaves one for calibration


def test_build_is_deterministic_and_fingerprinted(demo_model_path, tmp_path):
    tok = AutoTokenizer.from_pretrained(demo_model_path)
    params = load_params(overrides=["calibration.num_samples=8", "calibration.seq_len=64",
                                    "eval.num_cloze=20", "eval.num_continuation=10", "eval.ppl_samples=4"])
    first = build_calibration(params, tok, tmp_path / "a")
    again = build_calibration(params, tok, tmp_path / "b")
    assert first == again
    assert load_calibration(tmp_path / "a").shape == (8, 64)
    assert np.array_equal(load_calibration(tmp_path / "a"), load_calibration(tmp_path / "b"))
    assert read_json(tmp_path / "a" / "manifest.json") == first
    assert set(first["calibration_documents"]).isdisjoint(first["eval_documents"])

    other = build_calibration(load_params(overrides=[
        "calibration.num_samples=8", "calibration.seq_len=64", "calibration.seed=1",
        "eval.num_cloze=20", "eval.num_continuation=10", "eval.ppl_samples=4"]), tok, tmp_path / "c")
    assert other["calibration"]["fingerprint"] != first["calibration"]["fingerprint"]
