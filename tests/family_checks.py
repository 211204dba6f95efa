"""What the architecture matrix asserts of each family's run (tests/families.py runs it)."""

from __future__ import annotations

from qad_pipeline.core.artifacts import read_json
from tests.families import AGGRESSIVE, SEED_RECIPES, expected_formats, ptq_scores

# What vLLM's CPU build (0.32.0) cannot run of a family's export, with the error it gives: the serving
# check then runs at the config level and records it. Every other family runs the full check
# (prompt log-probs against the student's, both views). vLLM's NVFP4 fused-MoE kernels are CUDA and
# ROCm only (the demo's Nemotron-H MoE meets the same limit).
VLLM_CPU_LIMIT = {"qwen3_moe": "No NvFp4 MoE backend supports the deployment configuration"}


def check_family(name: str, params, layout) -> None:
    model_dir = params.base_model.path
    # the five recipes ran (or were recognised as the same model as an earlier one: no Mamba layers)
    statuses = {r: ptq_scores(layout, r)["status"] for r in params.ptq.recipes}
    assert set(statuses.values()) <= {"ok", "alias"} and list(statuses.values()).count("ok") >= 4, statuses
    # each role in the format the recipes state for it, whatever the family names its layers
    expected = expected_formats(model_dir)
    exported = params.export.source.removeprefix("ptq/") if params.export.source.startswith("ptq/") else None
    beside = set(params.ptq.recipes) - set(SEED_RECIPES)
    for recipe in {AGGRESSIVE} | beside:  # a recipe beside the five (and its export, where exported: below)
        assert statuses[recipe] == "ok", statuses
        formats = ptq_scores(layout, recipe)["layer_formats"]
        assert {n: formats.get(n) for n in expected} == expected, recipe
        # against the weights before quantization, also where the algorithm rewrote them (GPTQ): NVFP4's
        # error on these random weights is ~0.1, not the ~0 of a rounded weight against itself
        assert ptq_scores(layout, recipe)["weight_error"]["median"] > 0.02, recipe
    assert ptq_scores(layout, AGGRESSIVE)["kv_cache"] == "nvfp4"
    if params.ptq.layerwise is True:
        assert ptq_scores(layout, AGGRESSIVE)["layerwise"]["layers"] == 2
    selection = read_json(layout.metrics / "selection.json")
    assert selection["selected"] in params.ptq.recipes
    qad = read_json(layout.metrics / "qad.json")
    assert qad["steps"] == params.qad.steps and qad["median_recovery"] > 0
    training = read_json(layout.qad / "loss.json")
    assert training["learn_scales"] == params.qad.learn_scales
    assert (training["learned_scales"] > 0) == (params.qad.learn_scales == "lsq"), training["learned_scales"]
    export = read_json(layout.metrics / "export.json")
    assert export["source"] == (f"ptq/{exported}" if exported else "qad"), export["source"]
    assert export["passed"] and all(c["passed"] for c in export["checks"].values()), export["checks"]
    serving = export["serving_check"]
    assert "serving check passed" in serving["summary"], serving
    if name in VLLM_CPU_LIMIT:
        assert serving["level"] == "config" and VLLM_CPU_LIMIT[name] in serving["summary"], serving
    else:
        assert serving["level"] == "full", serving
