"""The calibration stage: `qad-pipeline stage calibration` (flow and `dvc repro`).

Documents -> calibration samples and held-out eval data, written under artifacts/calibration/
(what each file holds, and how the documents are read and split: `qad_pipeline.core.calibration_data`).
"""

from __future__ import annotations

from pathlib import Path

import datasets

from qad_pipeline.core.artifacts import fingerprint, staged_dir
from qad_pipeline.core.calibration_data import prepare_calibration, write_jsonl
from qad_pipeline.core.config import CalibrationParams, EvalParams, Params
from qad_pipeline.core.layout import Layout
from qad_pipeline.results.base import dump_result, write_result
from qad_pipeline.results.data import CalibrationManifest, CalibrationSet, HeldOutSet


def build_calibration(params: Params, tokenizer, out_dir: Path) -> dict:
    """Stage core: documents -> calibration samples + held-out eval data, written to out_dir."""
    cal: CalibrationParams = params.calibration
    ev: EvalParams = params.eval
    data = prepare_calibration(params, tokenizer)
    calib, ppl = data.calib, data.ppl

    with staged_dir(out_dir) as tmp:
        datasets.Dataset.from_dict({"input_ids": calib.tolist()}).save_to_disk(str(tmp / "calibration"))
        (tmp / "eval").mkdir()
        datasets.Dataset.from_dict({"input_ids": ppl.tolist()}).save_to_disk(str(tmp / "eval" / "ppl"))
        cloze_bytes = write_jsonl(tmp / "eval" / "heldout_cloze.jsonl", data.cloze)
        cont_bytes = write_jsonl(tmp / "eval" / "heldout_continuation.jsonl", data.cont)
        manifest = CalibrationManifest(
            source=cal.source,
            revision=cal.revision,
            documents=data.documents,
            calibration_documents=data.calib_idx,
            eval_documents=data.eval_idx,
            calibration=CalibrationSet(samples=len(calib), seq_len=cal.seq_len,
                                       fingerprint=fingerprint([calib.tobytes()])),
            eval=HeldOutSet(
                ppl_samples=len(ppl), seq_len=ev.seq_len,
                heldout_cloze=len(data.cloze), heldout_continuation=len(data.cont),
                fingerprint=fingerprint([ppl.tobytes(), cloze_bytes, cont_bytes]),
            ),
            tokenizer=params.base_model.path,
            seed=cal.seed,
        )
        write_result(tmp / "manifest.json", manifest)
    return dump_result(manifest)


def main(params: Params, layout: Layout, recipe: str | None = None) -> str:
    """The calibration stage: `qad-pipeline stage calibration`."""
    from qad_pipeline.core.modeling import load_tokenizer

    manifest = build_calibration(params, load_tokenizer(params.base_model), layout.data)["calibration"]
    return (f"calibration: {manifest['samples']} samples x {manifest['seq_len']} tokens, "
            f"fingerprint {manifest['fingerprint'][:12]}")
