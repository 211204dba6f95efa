"""The calibration stage: deterministic, disjoint splits, fingerprints that follow the data."""

import numpy as np
from transformers import AutoTokenizer

from qad_pipeline.core.artifacts import read_json
from qad_pipeline.core.calibration_data import load_calibration, split_documents
from qad_pipeline.core.config import load_params
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


def test_a_hub_dataset_is_streamed_at_its_revision_and_read_only_as_far_as_needed(demo_model_path, tmp_path,
                                                                                monkeypatch):
    """No hub here: `datasets.load_dataset` is replaced by a stream of the demo's documents, 50
    times over, that counts what was read."""
    from qad_pipeline.core import calibration_data
    from qad_pipeline.platform.versioning import dvc_yaml
    from tasks.qad import training_windows

    texts = [p.read_text() for p in sorted((demo_model_path.parent.parent / "data" / "heldout").glob("*.txt"))]
    calls = []

    def load_dataset(source, config=None, split=None, revision=None, streaming=False):
        calls.append({"source": source, "config": config, "split": split, "revision": revision,
                      "streaming": streaming, "read": 0})

        def rows():
            for i in range(50 * len(texts)):
                calls[-1]["read"] += 1
                yield {"article": texts[i % len(texts)], "id": i}
        return rows()

    monkeypatch.setattr(calibration_data.datasets, "load_dataset", load_dataset)
    tok = AutoTokenizer.from_pretrained(demo_model_path)
    hub = ["calibration.source=org/news", "calibration.dataset_config=3.0.0", "calibration.text_field=article",
           "calibration.revision=abc123", "calibration.num_samples=8", "calibration.seq_len=64",
           "eval.num_cloze=20", "eval.num_continuation=10", "eval.ppl_samples=4", "qad.seq_len=64", "qad.batch_size=8"]
    params = load_params(overrides=hub)
    manifest = build_calibration(params, tok, tmp_path / "data")
    first = calls[0]
    assert (first["source"], first["config"], first["revision"], first["streaming"]) == (
        "org/news", "3.0.0", "abc123", True)
    assert first["read"] == manifest["documents"] < 50 * len(texts) // 10  # stopped early
    assert manifest["revision"] == "abc123" and len(load_calibration(tmp_path / "data")) == 8
    # QAD on the calibration documents reads the same first documents again, no more
    windows = training_windows(params, tok, tmp_path / "data")
    assert calls[1]["read"] == manifest["documents"] and len(windows) >= params.qad.batch_size
    # a hub id is no path for DVC: the calibration stage depends on its params (id, revision) only
    assert "${calibration.source}" not in dvc_yaml(params) and "${calibration.source}" in dvc_yaml(load_params())


def test_windows_start_as_the_tokenizer_starts_a_text(demo_model_path):
    """A tokenizer that puts BOS before every text (Llama 3, Gemma, Mistral) gets it at position 0 of
    every window; one that puts nothing there (the demo's, GPT-2-style) gets plain windows."""
    from qad_pipeline.core.calibration_data import token_windows

    docs = ["the cat sat on the mat and looked at the door " * 8] * 4
    plain = token_windows(docs, AutoTokenizer.from_pretrained(demo_model_path), 16)
    with_bos = AutoTokenizer.from_pretrained(demo_model_path, add_bos_token=True)
    windows = token_windows(docs, with_bos, 16)
    assert windows.shape[1] == 16 and (windows[:, 0] == with_bos.bos_token_id).all()
    assert (windows[0, 1:] == plain.reshape(-1)[:15]).all()  # then the same text, one token later per window
    assert (plain[:, 0] != with_bos.bos_token_id).all()
