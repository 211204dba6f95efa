"""The failure catalog (`qad_pipeline.checks.failure_catalog`): every NVFP4 failure class, applied to a real
export (SmolLM2-135M; the demo's Nemotron-H for the MoE entries), is refused by the export check the
catalog names, with its one-line problem; the same checks pass the export as it was written."""

import re
from dataclasses import dataclass, replace

import pytest
import torch

from qad_pipeline.checks import failure_catalog
from qad_pipeline.core.artifacts import read_json
from qad_pipeline.core.config import load_params
from qad_pipeline.checks.export_checks import (block_amax, check_formats, check_weights, fp8_roundings, read_tensors,
                                               student_block_amax, student_weights)
from qad_pipeline.checks.export_lint import lint, lint_folder, student_input_scales, student_weight_scales
from qad_pipeline.core.modeling import load_model
from qad_pipeline.nvfp4.sizes import size_report
from tests.test_serving import RECIPE, real_params

# entry -> the problem line its check gives (a regular expression, searched in each line)
REFUSED_WITH = {
    "fused_scales_unshared": r"^model\.layers\.\d+\.mlp\.gate_proj/up_proj: weight_scale_2 [\d.e-]+ vs [\d.e-]+: "
                             r"a server fuses them into one GEMM with one scale \(vLLM #54974",
    "lm_head_w4a4_without_input_scale": r"^lm_head\.input_scale: missing, and hf_quant_config gives the layer NVFP4, "
                                        r"which quantizes its input",
    "input_scale_fp8_formula": r"^model\.layers\.29\.mlp\.down_proj\.input_scale: [\d.e-]+, the student's calibrated",
    "tied_embedding_written_twice": r"^lm_head\.weight: stored, and config\.json ties it to the input embedding",
    "tied_embedding_untied": r"^lm_head\.weight: missing, and config\.json unties it",
    "expert_never_routed_zero_scales": r"^backbone\.layers\.5\.mixer\.experts\.3\.(up|down)_proj\.input_scale: "
                                       r"1 of 1 scale values are not finite and > 0",
    "expert_never_routed_scales_missing": r"^backbone\.layers\.5\.mixer\.experts\.3\.(up|down)_proj\.input_scale: "
                                          r"missing, and hf_quant_config gives the layer NVFP4",
    "weight_only_moe": r"^backbone\.layers\.[15]\.mixer\.experts: experts quantized weight-only \(W4A16_NVFP4\).*#54189",
    "global_scale_off": r"^model\.layers\.10\.mlp\.down_proj\.weight_scale_2: [\d.e-]+, the student's calibrated",
    "block_scale_one_step": r"^model\.layers\.10\.mlp\.down_proj\.weight: 1 of \d+ blocks of 16 values are the "
                            r"student's times one ratio \(block 100: x1\.\d+\)",
    "bf16_layer_quantized": r"^model\.layers\.0\.self_attn\.o_proj\.weight: expected bf16, exported as nvfp4",
    "nvfp4_layer_left_bf16": r"^model\.layers\.3\.mlp\.down_proj\.weight: expected nvfp4, exported as bf16",
    "kv_scale_missing": r"^model\.layers\.7\.self_attn\.k_proj\.k_scale: missing, and hf_quant_config quantizes the "
                        r"KV cache \(NVFP4\)",
    "mlp_scaled": r"^model\.layers\.\d+\.mlp\.(gate|up)_proj\.weight_scale_2: [\d.e-]+, the student's calibrated",
}


@dataclass
class Export:
    """An export folder and what its student says it must hold."""

    folder: object
    student_dir: object
    formats: dict
    input_scales: dict
    weight_scales: dict
    quantized: dict
    static_amax: dict


def with_student(folder, student_dir, params) -> Export:
    student = load_model(params.base_model, params.hardware, folder=student_dir, dtype=torch.bfloat16)
    return Export(folder, student_dir, size_report(student)["layer_formats"], student_input_scales(student),
                  student_weight_scales(student), student_weights(student), student_block_amax(student))


@pytest.fixture(scope="module")
def smollm2(real_export):
    """The real SmolLM2-135M export, the session's (tests/conftest.py: shared with tests/test_serving.py)."""
    _, layout, _ = real_export
    return with_student(layout.export, layout.ptq(RECIPE) / "checkpoint", real_params())


@pytest.fixture(scope="module")
def demo(pipeline_run):
    _, layout, overrides, _ = pipeline_run
    return with_student(layout.export, layout.qad / "model", load_params(overrides=overrides))


def run_check(check: str, export: Export) -> dict:
    """The export check the catalog names (`Entry.check`) on `export.folder`."""
    folder = export.folder
    tensors = read_tensors(folder)
    if check == "lint":  # static: the folder alone
        return lint_folder(folder)
    if check == "lint+student":
        return lint(tensors, export.input_scales, read_json(folder / "config.json"),
                    read_json(folder / "hf_quant_config.json"), export.weight_scales)
    if check == "formats":
        return check_formats(export.formats, tensors, read_json(folder / "hf_quant_config.json"))
    if check == "weights":
        return check_weights(tensors, export.quantized, block_amax(export.student_dir, export.static_amax))
    raise ValueError(check)


def test_every_entry_names_a_check_and_a_problem_line():
    names = [e.name for e in failure_catalog.CATALOG]
    assert len(set(names)) == len(names) == len(REFUSED_WITH) and set(names) == set(REFUSED_WITH)
    assert {e.check for e in failure_catalog.CATALOG} <= {"lint", "lint+student", "formats", "weights"}
    assert {e.model for e in failure_catalog.CATALOG} == {"smollm2", "demo"}


def test_next_fp8_step_is_one_representable_step():
    scales = torch.tensor([1.0, 0.5, 448.0 / 2], dtype=torch.float8_e4m3fn)
    stepped = failure_catalog.next_fp8_step(scales, 1).float()
    assert stepped[0] == 1.0 and stepped[1] == 0.5625 and stepped[2] == 224.0  # 0.5 x (1 + 1/8)


def test_a_midpoint_computed_in_another_order_is_still_a_tie():
    """SmolLM2-135M's GPTQ export, layers.21.mlp.down_proj: block amax 0.228515625, global amax 2.4375.
    The export's scale is exactly 42 (between FP8's 40 and 44, stored as 40); recomputed from the
    stored global scale it is 42.0000038, one float32 ulp above. Both roundings are candidates; a
    value half an FP8 step from the midpoint has one."""
    stored_global = torch.tensor(2.4375) / (6 * 448)
    x = torch.tensor(0.228515625) / (6 * stored_global)
    assert x.item() != 42.0
    nearest, either = fp8_roundings(torch.stack([x, torch.tensor(42.0), torch.tensor(41.0), torch.tensor(43.0)]))
    assert nearest.tolist() == [44.0, 40.0, 40.0, 44.0]
    assert either.tolist() == [40.0, 44.0, 40.0, 44.0]


@pytest.mark.slow
@pytest.mark.parametrize("check", ["lint", "lint+student", "formats", "weights"])
def test_the_export_as_written_passes_every_check_of_the_catalog(smollm2, check):
    result = run_check(check, smollm2)
    assert result["passed"], result["problems"]
    if check == "weights":  # the 4/6 recipe's few blocks on the other candidate scale are cleared, not missed
        assert result["scaled_blocks"] == 0 and result["blocks_compared"] > 4_000_000


@pytest.mark.slow
@pytest.mark.parametrize("entry", [e for e in failure_catalog.CATALOG if e.model == "smollm2"], ids=lambda e: e.name)
def test_each_failure_is_refused_on_smollm2(smollm2, entry, tmp_path):
    refused(entry, smollm2, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("entry", [e for e in failure_catalog.CATALOG if e.model == "demo"], ids=lambda e: e.name)
def test_each_moe_failure_is_refused_on_the_demo(demo, entry, tmp_path):
    assert run_check(entry.check, demo)["passed"]
    refused(entry, demo, tmp_path)


def refused(entry, export: Export, tmp_path) -> None:
    broken = entry.corrupt(export.folder, tmp_path / entry.name)
    result = run_check(entry.check, replace(export, folder=broken))
    assert not result["passed"]
    assert any(re.search(REFUSED_WITH[entry.name], p) for p in result["problems"]), result["problems"]
