"""The export's checks of a checkpoint against its student, as one call: the export stage
(`tasks/export.py`) runs them on the folder it writes, `qad-pipeline verify-export` on any folder
(an export converted, copied or edited by hand) against a finished run's student."""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from qad_pipeline.core.artifacts import read_json
from qad_pipeline.core.config import ConfigError, Params
from qad_pipeline.checks.export_checks import (block_amax, check_formats, check_reload, check_size, check_weights,
                                               read_tensors, reload_reference, student_block_amax, student_weights)
from qad_pipeline.checks.export_lint import lint, student_input_scales, student_weight_scales
from qad_pipeline.core.layout import Layout

MANIFEST = "export_manifest.json"


def source_folder(layout: Layout, source: str) -> Path:
    """The checkpoint folder of an export source (qad, or ptq/<recipe>) in this run."""
    return layout.qad / "model" if source == "qad" else layout.candidate(source.removeprefix("ptq/")) / "checkpoint"


@dataclass
class StudentSide:
    """What the export's checks compare a checkpoint with, computed from the student (before the
    export: it packs the student's weights in place)."""

    expected: dict  # size_report: each layer's format, bits per element, bytes
    batch: torch.Tensor  # the reload check's held-out windows
    reload: tuple  # reload_reference: the student's weight-only logits, its noise, the quantization's KL
    prompts: list[list[int]]  # the serving check's held-out prompts
    served: dict  # student_reference: per view what vLLM must reproduce
    input_scales: dict[str, float]  # the calibrated input scales the lint expects
    weight_scales: dict[str, float]  # the student's global weight scales the lint expects
    quantized: dict | None  # the student's quantized weights, for the weights check (then dropped)
    static_amax: dict | None  # its static per-block amax, where it has one (`student_block_amax`; then dropped)
    student_dir: Path  # its checkpoint: the weights check reads each other block's amax there
    vocab: int


def held_out(layout: Layout) -> tuple[torch.Tensor, list[list[int]]]:
    """The reload check's windows and the serving check's prompts, from the run's held-out windows."""
    from qad_pipeline.core.calibration_data import load_ppl_windows
    from qad_pipeline.checks.serving_reference import held_out_prompts

    windows = load_ppl_windows(layout.data)
    return torch.from_numpy(windows[:2]), held_out_prompts(windows)


def rewrites_weights(params: Params, source: str) -> bool:
    """The source is a PTQ recipe whose algorithm rewrote the weights (GPTQ writes back its rounded
    ones): its student with the quantizers off is then not the model before quantization."""
    from qad_pipeline.nvfp4.recipes import mutates_weights

    if not source.startswith("ptq/"):
        return False
    recipe = params.recipe_path(source.removeprefix("ptq/"))
    if not recipe.is_file():
        raise ConfigError(f"{source}: its recipe file {recipe} is gone (ptq.recipe_dir); the export's checks read "
                          "its algorithm (whether it rewrote the weights)")
    return mutates_weights(recipe)


@torch.no_grad()
def unquantized_logits(params: Params, layout: Layout, source: str) -> dict[str, torch.Tensor] | None:
    """For a source that `rewrites_weights` (else None): the base model's logits on the checks'
    held-out tokens (`reload`: the first PROMPT_LEN of the reload windows; `served`: the serving
    prompts), the model before quantization, from which the export must be measurably further than
    from the student (`serving_reference.threshold_terms`). The student with its quantizers off would
    be GPTQ's rounded weights, the quantized model itself: a threshold of 0. Call it before loading
    the student: the base model is loaded, run and freed, one model on the device at a time."""
    from qad_pipeline.core.modeling import input_device, load_model
    from qad_pipeline.checks.serving_reference import PROMPT_LEN

    if not rewrites_weights(params, source):
        return None

    base = load_model(params.base_model, params.hardware, dtype=torch.bfloat16)
    batch, prompts = held_out(layout)
    device = input_device(base)
    out = {"reload": base(input_ids=batch[:, :PROMPT_LEN].to(device)).logits.float().cpu(),
           "served": base(input_ids=torch.tensor(prompts).to(device)).logits.float().cpu()}
    del base
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return out


def student_side(layout: Layout, student, student_dir: Path, unquantized: dict | None = None) -> StudentSide:
    """The student's side of every check, on the run's held-out windows; `unquantized`: the model
    before quantization's logits where the student's own weights are not that model's (`unquantized_logits`)."""
    from qad_pipeline.checks.serving_reference import student_reference
    from qad_pipeline.nvfp4.sizes import size_report

    batch, prompts = held_out(layout)
    unquantized = unquantized or {}
    return StudentSide(expected=size_report(student), batch=batch,
                       reload=reload_reference(student, batch, unquantized.get("reload")),
                       prompts=prompts, served=student_reference(student, prompts, unquantized.get("served")),
                       input_scales=student_input_scales(student), weight_scales=student_weight_scales(student),
                       quantized=student_weights(student), static_amax=student_block_amax(student),
                       student_dir=student_dir, vocab=student.config.vocab_size)


def check_checkpoint(params: Params, folder: Path, side: StudentSide) -> dict[str, dict]:
    """The export's checks of the checkpoint in `folder` against the student (`side`): formats, size,
    lint, weights, reload, and (unless export.serving_check is skip) serving, for which the student's
    `serving_reference.npz` is written into `folder` first."""
    from qad_pipeline.checks.serving_reference import write_reference

    tensors = read_tensors(folder)
    reference, noise, quantization_kl = side.reload
    quant_config = read_json(folder / "hf_quant_config.json")
    checks = {
        "formats": check_formats(side.expected["layer_formats"], tensors, quant_config),
        "size": check_size(side.expected["effective_bpe"], tensors),
        "lint": lint(tensors, side.input_scales, read_json(folder / "config.json"), quant_config, side.weight_scales),
        "weights": check_weights(tensors, side.quantized, block_amax(side.student_dir, side.static_amax)),
    }
    side.quantized = side.static_amax = None  # a BF16 copy of the NVFP4 layers, gone before the reload builds its model
    checks["reload"] = check_reload(folder, tensors, reference, side.batch, noise, quantization_kl,
                                    params.base_model.trust_remote_code)
    write_reference(folder, side.prompts, side.served)
    serving_check = check_serving(params, folder)
    if serving_check is not None:
        checks["serving"] = serving_check
    return checks


def failed_checks(checks: dict[str, dict]) -> list[str]:
    """One phrase per failed check: its name and first problem (or summary, or figure)."""
    out = []
    for name, c in checks.items():
        if c["passed"]:
            continue
        if c.get("problems"):
            out.append(f"{name}: {c['problems'][0]}" + (f" (+{len(c['problems']) - 1} more)" if len(c["problems"]) > 1
                                                          else ""))
        elif c.get("summary"):
            out.append(f"{name}: {c['summary']}")
        else:
            figure = {k: c[k] for k in ("kl_divergence", "tolerance", "relative_difference") if k in c}
            out.append(f"{name}: {figure or c}")
    return out


def check_serving(params: Params, folder: Path) -> dict | None:
    """A real vLLM serves what the student computes (`qad_pipeline.checks.serving`); None when
    export.serving_check is skip."""
    from qad_pipeline.checks import serving

    if params.export.serving_check == "skip":
        return None
    return serving.verify_serving(folder, params.export.serving_check)


def verify_export(params: Params, layout: Layout, checkpoint: Path) -> dict:
    """`qad-pipeline verify-export`: the export's checks (`check_checkpoint`) on any checkpoint folder
    (an export converted, copied or edited by hand) against the student of the run in `layout`, the
    one its export's manifest names. Nothing in `checkpoint` changes: the checks read it through a
    folder of links, beside which the student's serving reference is written."""
    from qad_pipeline.core.modeling import load_model
    from qad_pipeline.checks.serving_reference import REFERENCE_FILE

    checkpoint = Path(checkpoint)
    if not (checkpoint / "config.json").is_file() or not (checkpoint / "hf_quant_config.json").is_file():
        raise ConfigError(f"{checkpoint} is not an exported checkpoint (it needs config.json and hf_quant_config.json)")
    manifest = layout.export / MANIFEST
    if not manifest.is_file():
        raise ConfigError(f"{layout.root} holds no finished export ({manifest} is missing): give the --out-root of a "
                          "run whose export stage passed (its student is what the checkpoint is checked against)")
    exported = read_json(manifest)["exported"]
    student_dir = source_folder(layout, exported)
    if not (student_dir / "config.json").is_file():
        raise ConfigError(f"the run's student {student_dir} ({exported}, which {manifest} names) is gone: "
                          "the checks compare the checkpoint with it")
    unquantized = unquantized_logits(params, layout, exported)
    side = student_side(layout, load_model(params.base_model, params.hardware, folder=student_dir,
                                           dtype=torch.bfloat16), student_dir, unquantized)
    with tempfile.TemporaryDirectory(prefix="qad-verify-export-") as tmp:
        view = Path(tmp)
        for file in checkpoint.iterdir():
            if file.name != REFERENCE_FILE:
                os.symlink(file.resolve(), view / file.name)
        checks = check_checkpoint(params, view, side)
    failed = failed_checks(checks)
    return {"checkpoint": str(checkpoint), "student": exported, "checks": checks, "passed": not failed,
            "summary": (f"verify-export passed: {checkpoint} against the run's student ({exported}): "
                        + ", ".join(checks)) if not failed else
                       f"verify-export FAILED: {checkpoint} against the run's student ({exported}): " + "; ".join(failed)}
