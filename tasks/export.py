"""Export and verification: `qad-pipeline stage export`.

Exports the QAD student (or, with `export.source`, a PTQ checkpoint; with selection.policy
ptq_final, the selected one) with Model Optimizer's `export_hf_checkpoint` (a unified Hugging Face
checkpoint: `hf_quant_config.json`, packed NVFP4 weights with FP8 block scales and FP32 global
scales) and verifies it before the folder is put in place: formats, size, lint, weights and reload
(`qad_pipeline.checks.export_checks`), then serving: a real vLLM, in its own pinned environment, loads
the checkpoint (`qad_pipeline.checks.serving`): at the `full` level its prompt log-probs on held-out
windows agree with the student's, which this stage writes beside the weights
(`serving_reference.npz`), served as W4A16 (Hopper) and as stored (Blackwell), each within the
reload check's rule of threshold; where vLLM cannot run the architecture on this device, vLLM's
config-level acceptance (`config`). `export.serving_check: skip` leaves it out, and says so in
the metrics.

The checkpoint is written into a temporary folder and moved into place only when every check
passes: a failed or interrupted export never leaves a folder that looks complete. The same
checkpoint serves Blackwell (native W4A4 NVFP4) and Hopper (no FP4 tensor cores: W4A16);
`serving.json` records what each needs, and the serve commands with the options vLLM detected.
"""

from __future__ import annotations

import errno
import shutil
from contextlib import contextmanager
from pathlib import Path

import torch

from qad_pipeline.core.artifacts import fingerprint, read_json, staged_dir, write_json
from qad_pipeline.core.config import ConfigError, Params, StageError
from qad_pipeline.checks.export_verify import (MANIFEST, check_checkpoint, failed_checks, source_folder, student_side,
                                               unquantized_logits)
from qad_pipeline.core.layout import Layout
from qad_pipeline.results.base import dump_result, write_result
from qad_pipeline.results.export_metrics import ExportMetrics, ServingCheck, ServingNotes



class ExportCheckFailed(StageError):
    pass


# -- the stage ----------------------------------------------------------------------------------


def repair_layer_names(folder: Path) -> list[str]:
    """Strip a mangled name-mapping sentinel from the quantization config's layer names.

    Model Optimizer 0.47 appends a sentinel (".\\x00modelopt_name_sentinel") while renaming
    module names to hub names; a rename rule for `model.` (NemotronH: -> `backbone.`) also
    rewrites the sentinel, which then survives as ".\\x00backbone.pt_name_sentinel" in
    `quantized_layers` and `config_groups` targets, so no serving engine would match a layer.
    Returns the names it repaired; the formats check fails on any that remain wrong.
    """
    repaired = []

    def fix(name: str) -> str:
        if "\x00" in name:
            repaired.append(name)
            return name.split(".\x00", 1)[0]
        return name

    for file, key in (("hf_quant_config.json", "quantization"), ("config.json", "quantization_config")):
        path = folder / file
        data = read_json(path)
        section = data.get(key) or {}
        if isinstance(section.get("quantized_layers"), dict):
            section["quantized_layers"] = {fix(k): v for k, v in section["quantized_layers"].items()}
        if isinstance(section.get("exclude_modules"), list):
            section["exclude_modules"] = [fix(n) for n in section["exclude_modules"]]
        for group in (section.get("config_groups") or {}).values():
            if isinstance(group.get("targets"), list):
                group["targets"] = [fix(n) for n in group["targets"]]
        write_json(path, data)
    return sorted(set(repaired))


def serving_notes(quant_config: dict, folder: Path, check: dict | None) -> ServingNotes:
    """What each GPU generation and each engine needs; the serve commands carry what vLLM detected."""
    from qad_pipeline.checks.serving import serve_commands

    q = quant_config.get("quantization", {})
    return ServingNotes(
        quant_algo=q.get("quant_algo"),
        kv_cache_quant_algo=q.get("kv_cache_quant_algo"),
        blackwell="native NVFP4 W4A4 on FP4 tensor cores (SM100+): weights and activations in NVFP4",
        hopper="no FP4 tensor cores (SM90): the server runs the NVFP4 weights as W4A16 "
               "(dequantized to BF16 in the GEMM), activations stay BF16",
        **serve_commands(folder, check),
    )


def check_target(folder: Path, source_key: str) -> None:
    """Refuse an export folder that holds something other than an earlier export of this student."""
    if not folder.exists() or not any(folder.iterdir()):
        return
    manifest = folder / MANIFEST
    if not manifest.is_file():
        raise ConfigError(f"export target {folder} already holds files that are not a qad-pipeline export; "
                          "move them away or choose another --out-root")
    held = read_json(manifest).get("source")
    if held != source_key:
        what = (f"a different checkpoint (source {held[:12]}…)" if isinstance(held, str)
                else f"an export whose {MANIFEST} names no source")
        raise ConfigError(f"export target {folder} holds {what}; "
                          "remove it or choose another --out-root rather than mix two checkpoints")


def mib(n: float) -> str:
    return f"{n / 2**20:,.1f} MiB"


def check_free_space(layout: Layout, needed: int) -> None:
    """Refuse before writing when the out-root's disk cannot hold the staged export beside the
    previous one (which stays until the new one has passed its checks)."""
    needed += 2**20 + needed // 20  # configs and notes, and 5 % for the file format's own overhead
    free = shutil.disk_usage(layout.export.parent).free
    if free < needed:
        raise StageError(f"not enough disk space for the export under {layout.export.parent}: it needs about "
                         f"{mib(needed)} and {mib(free)} are free; free some space or choose another --out-root "
                         f"(the previous export in {layout.export} is untouched)")


@contextmanager
def disk_full_is_reported(layout: Layout):
    """A disk that fills up while the export is written (after `check_free_space`: something else
    wrote meanwhile) is one line that says the previous export is intact, not an OSError."""
    try:
        yield
    except OSError as err:
        if err.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        raise StageError(f"the disk under {layout.export.parent} filled up while the export was written "
                         f"({mib(shutil.disk_usage(layout.export.parent).free)} free now): nothing was put in "
                         f"place and the previous export in {layout.export} is as it was; free some space and "
                         "run the stage again") from None


def export_source(params: Params, layout: Layout) -> tuple[str, Path]:
    """(what is exported, its checkpoint folder): `export.source`, where auto is the QAD student
    with selection.policy qad and the selected PTQ candidate with ptq_final."""
    from qad_pipeline.results.base import read_result
    from qad_pipeline.results.selection_metrics import SelectionResult

    source = params.export.source
    if source == "none":
        raise ConfigError("export.source is none (a run that only compares recipes): nothing to export; "
                          "set it to auto, qad or ptq/<recipe>")
    if source == "auto" and params.selection.policy == "qad":
        source = "qad"
    elif source == "auto":
        selected = read_result(layout.selection_metrics, SelectionResult).selected
        if selected is None:
            raise ConfigError("selection.policy is ptq_final and no PTQ recipe was selected (metrics/selection.json): "
                              "nothing to export")
        source = f"ptq/{selected}"
    folder = source_folder(layout, source)
    if not (folder / "config.json").is_file():
        ready = ["qad"] if (layout.qad / "model" / "config.json").is_file() else []
        ready += [f"ptq/{p.parent.parent.name}" for p in sorted(layout.root.glob("artifacts/ptq/*/checkpoint/config.json"))]
        raise ConfigError(f"export.source {params.export.source!r}: no checkpoint at {folder}; exportable here: "
                          + (", ".join(ready) or "nothing yet (run PTQ, or QAD, first)"))
    return source, folder


def run_export(params: Params, layout: Layout) -> dict:
    """Stage core: export the QAD student (or a PTQ checkpoint: `export_source`), verify it, put it in
    place; write metrics/export.json."""
    from modelopt.torch.export import export_hf_checkpoint

    from qad_pipeline.core.modeling import load_model, load_tokenizer
    from qad_pipeline.checks.serving_reference import reference_bytes
    from qad_pipeline.nvfp4.sizes import tokenizer_bytes

    source, student_dir = export_source(params, layout)
    source_key = fingerprint([p.name.encode() + p.read_bytes() for p in sorted(student_dir.glob("*.json"))]
                             + [f"{p.name}:{p.stat().st_size}" for p in sorted(student_dir.glob("*.safetensors"))])
    check_target(layout.export, source_key)
    # a recipe that rewrote the weights (GPTQ) is compared with the base model, not with itself unquantized
    unquantized = unquantized_logits(params, layout, source)
    student = load_model(params.base_model, params.hardware, folder=student_dir, dtype=torch.bfloat16)
    side = student_side(layout, student, student_dir, unquantized)

    check_free_space(layout, side.expected["size_bytes"] + tokenizer_bytes(params.base_model)
                     + reference_bytes(len(side.prompts), len(side.prompts[0]), side.vocab))
    with disk_full_is_reported(layout), staged_dir(layout.export) as tmp:
        export_hf_checkpoint(student, export_dir=tmp)
        repaired = repair_layer_names(tmp)
        load_tokenizer(params.base_model).save_pretrained(tmp)
        checks = check_checkpoint(params, tmp, side)
        serving_check = checks.get("serving")
        size_bytes = sum(p.stat().st_size for p in tmp.glob("*.safetensors"))
        serving = serving_notes(read_json(tmp / "hf_quant_config.json"), layout.export, serving_check)
        write_result(tmp / "serving.json", serving)
        metrics = ExportMetrics(
            path=str(layout.export),
            source=source,
            size_bytes=size_bytes,
            bf16_size_bytes=checks["size"]["bf16_size_bytes"],
            size_ratio=checks["size"]["bf16_size_bytes"] / size_bytes,
            effective_bpe=checks["size"]["effective_bpe"],
            layer_formats=checks["formats"]["layer_formats"],
            layers_by_format=checks["formats"]["layers_by_format"],
            repaired_layer_names=len(repaired),
            checks=checks,
            serving=serving,
            serving_check=(ServingCheck(level=serving_check["level"], summary=serving_check["summary"])
                           if serving_check else
                           ServingCheck(level="skipped", summary="skipped by export.serving_check=skip")),
            passed=all(c["passed"] for c in checks.values()),
        )
        write_result(layout.export_metrics, metrics)
        if not metrics.passed:
            raise ExportCheckFailed("export verification failed; nothing was put in place. "
                                    + "; ".join(failed_checks(checks)))
        write_json(tmp / MANIFEST, {"source": source_key, "student": str(student_dir), "exported": source})
    return dump_result(metrics)


def main(params: Params, layout: Layout, recipe: str | None = None) -> str:
    """The export stage: `qad-pipeline stage export`."""
    m = run_export(params, layout)
    return f"export of {m['source']}: {m['path']} ({m['size_bytes'] / 1e6:.2f} MB, {m['effective_bpe']:.3f} bits per element)"
