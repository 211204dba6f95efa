"""Layerwise PTQ (`ptq.layerwise`, qad_pipeline/nvfp4/layerwise.py): Model Optimizer's layer-by-layer calibration
gives the whole-model checkpoint on the demo, and a recipe killed with SIGKILL mid-calibration resumes
from its per-layer checkpoints and ends with the same checkpoint.

Tolerance: none. On the demo, every tensor of the layerwise checkpoint (weights, every quantizer's
`_amax`/`_global_amax`, `lm_head`'s included) equals the whole-model one bit for bit, and so do the
KL and the task scores: with `max`/`mse` Model Optimizer captures each layer's inputs with the
earlier layers' quantizers off (`get_qdq_activations_from_prev_layer: false`), so each layer sees
the activations of a whole-model pass, batch by batch in the same order, and the amax reductions
over them are the same float operations. The recipe is four-over-six (static NVFP4 weights, MSE
search): the case where an uncalibrated `lm_head` crashes (qad_pipeline/nvfp4/layerwise.py).
"""

import json
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoTokenizer

from qad_pipeline.nvfp4 import layerwise
from qad_pipeline.core.artifacts import read_json
from qad_pipeline.core.config import load_params
from qad_pipeline.core.layout import Layout
from qad_pipeline.results.base import write_result
from tasks.baseline import run_baseline
from tasks.calibration import build_calibration
from tasks.ptq import run_ptq
from tests import samples
from tests.conftest import GOOD_RECIPES, TINY

RECIPE = GOOD_RECIPES[1]  # nvfp4_4o6-mamba_w4a16-kv_nvfp4
LAYERS = 6  # the demo model's decoder layers
# 4x as many calibration tokens as TINY: the six layers take ~0.3 s to calibrate instead of ~0.1 s,
# a wider window for the kill to land in
SETTINGS = [*TINY, "calibration.num_samples=16", "calibration.seq_len=128"]


def tensors(folder) -> dict:
    return load_file(folder / "checkpoint" / "model.safetensors")


def outcome(scores: dict) -> dict:
    return {"kl": scores["kl_divergence"], "bpe": scores["effective_bpe"], "weight_error": scores["weight_error"],
            "tasks": {t: v["value"] for t, v in scores["tasks"].items()}}


def assert_same_checkpoint(got: dict, expected: dict) -> None:
    assert got.keys() == expected.keys()
    assert "lm_head.weight_quantizer._amax" in got  # calibrated outside the layers too
    differ = [k for k in expected if not torch.equal(got[k], expected[k])]
    assert not differ, f"{len(differ)} tensors differ from the whole-model checkpoint, e.g. {differ[:3]}"


@pytest.fixture(scope="module")
def whole_model(tmp_path_factory, demo_model_path):
    """Calibration, baseline and the recipe calibrated whole-model (ptq.layerwise false), in one out-root."""
    layout = Layout(tmp_path_factory.mktemp("layerwise"))
    params = load_params(overrides=[*SETTINGS, "ptq.layerwise=false"])
    build_calibration(params, AutoTokenizer.from_pretrained(demo_model_path), layout.data)
    run_baseline(params, layout.data, layout.baseline_metrics, layout.reference)
    scores = run_ptq(params, RECIPE, layout.data, layout.reference, layout.root / "whole",
                     layerwise_root=layout.ptq_layerwise(RECIPE))
    assert "layerwise" not in scores
    return layout, scores, tensors(layout.root / "whole")


def test_layerwise_calibration_gives_the_whole_model_checkpoint(whole_model):
    layout, expected, expected_tensors = whole_model
    params = load_params(overrides=[*SETTINGS, "ptq.layerwise=true"])
    scores = run_ptq(params, RECIPE, layout.data, layout.reference, layout.ptq(RECIPE),
                     layerwise_root=layout.ptq_layerwise(RECIPE))
    assert scores["layerwise"] == {"layers": LAYERS, "resumed_from_layer": 0, "checkpoints": True}
    assert read_json(layout.ptq(RECIPE) / "scores.json")["layerwise"] == scores["layerwise"]
    assert_same_checkpoint(tensors(layout.ptq(RECIPE)), expected_tensors)
    assert outcome(scores) == outcome(expected)
    assert not layout.ptq_layerwise(RECIPE).exists()  # done: no checkpoint left to resume


def test_checkpoints_of_another_recipe_or_calibration_are_not_resumed(tmp_path):
    params = load_params(overrides=TINY)
    data = tmp_path / "calibration"
    data.mkdir()
    write_result(data / "manifest.json", samples.manifest())
    recipe = tmp_path / f"{RECIPE}.yaml"
    recipe.write_text(params.recipe_path(RECIPE).read_text())
    key = layerwise.checkpoint_key(params, recipe, data)
    assert layerwise.checkpoint_key(params, recipe, data) == key
    other_batch = load_params(overrides=[*TINY, "ptq.calib_batch_size=2"])
    assert layerwise.checkpoint_key(other_batch, recipe, data) != key
    write_result(data / "manifest.json", samples.manifest(seed=1))  # other calibration samples
    assert layerwise.checkpoint_key(params, recipe, data) != key
    write_result(data / "manifest.json", samples.manifest())
    recipe.write_text(recipe.read_text() + "\n# edited\n")
    assert layerwise.checkpoint_key(params, recipe, data) != key
    root = tmp_path / "ptq_layerwise"
    (root / "stale" / "layer_0000").mkdir(parents=True)
    (root / "stale" / "manifest.json").write_text(json.dumps({"last_completed_layer": 2, "num_layers": LAYERS}))
    assert layerwise.resume_point(root / "stale") == 3  # Model Optimizer alone would resume from it
    folder = layerwise.checkpoint_dir(root, key)
    assert folder == root / key and not (root / "stale").exists()  # but it is another key's: removed
    assert layerwise.resume_point(folder) == 0


def command(layout: Layout) -> list[str]:
    cmd = [sys.executable, "-m", "qad_pipeline", "stage", "ptq", RECIPE, "--out-root", str(layout.root)]
    for item in [*SETTINGS, "ptq.layerwise=true"]:
        cmd += ["--set", item]
    return cmd


def committed(layout: Layout) -> int | None:
    """The last layer Model Optimizer committed (its manifest), None before the first."""
    manifests = list(layout.ptq_layerwise(RECIPE).glob("*/manifest.json"))
    try:
        return json.loads(manifests[0].read_text())["last_completed_layer"] if manifests else None
    except (json.JSONDecodeError, KeyError):  # written by os.replace, so whole; but be safe
        return None


@pytest.mark.slow
def test_kill_9_mid_calibration_resumes_from_the_last_finished_layer(whole_model):
    layout, expected, expected_tensors = whole_model
    for attempt in range(1, 4):  # the layers take a fraction of a second: a kill that came too late is tried again
        shutil.rmtree(layout.ptq_layerwise(RECIPE), ignore_errors=True)
        proc = subprocess.Popen(command(layout), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            deadline = time.time() + 600
            while committed(layout) is None and proc.poll() is None and time.time() < deadline:
                time.sleep(0.002)
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
        last = committed(layout)
        if last is not None and last < LAYERS - 1:
            break
    assert last is not None and last < LAYERS - 1, f"not killed mid-calibration (last committed layer: {last})"
    folder = next(layout.ptq_layerwise(RECIPE).glob("*/manifest.json")).parent
    kept = sorted(str(p.relative_to(folder)) for p in folder.glob("layer_*/*"))
    assert f"layer_{last:04d}/next_inputs.pt" in kept  # what the next layer resumes from
    assert not (layout.ptq(RECIPE) / "scores.json").exists()

    done = subprocess.run(command(layout), capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    resumed = last + 1
    assert f"resuming layerwise calibration at layer {resumed} of {LAYERS}" in done.stdout
    # Model Optimizer's own line: it restored the layers before `resumed` from the files, not recalibrated them
    assert f"Checkpoint: resuming layerwise calibration from layer {resumed}/{LAYERS}" in done.stdout
    assert f"Checkpoint: restored {resumed} previously calibrated layers" in done.stdout
    assert f"(calibrated layerwise, resumed at layer {resumed})" in done.stdout  # the stage's own line
    assert "Checkpoint: committed layer 0\n" not in done.stdout.replace("\r", "\n")
    scores = read_json(layout.ptq(RECIPE) / "scores.json")
    assert scores["layerwise"] == {"layers": LAYERS, "resumed_from_layer": resumed, "checkpoints": True}
    assert_same_checkpoint(tensors(layout.ptq(RECIPE)), expected_tensors)
    assert outcome(scores) == outcome(expected)
    assert not layout.ptq_layerwise(RECIPE).exists()
    print(json.dumps({"attempts": attempt, "killed_after_layer": last, "resumed_from_layer": resumed, "layer_files_kept": len(kept)}))



def test_the_setting_per_recipe_and_what_is_refused(demo_model_path, tmp_path):
    """auto is whole-model on a CPU; true is refused for an AutoQuantize recipe, and for a recipe that
    quantizes activations outside the decoder layers before any layer is calibrated."""
    from qad_pipeline.core.config import ConfigError
    from qad_pipeline.core.modeling import load_model
    from tasks.ptq import quantize_model

    params = load_params(overrides=TINY)
    model = load_model(params.base_model, params.hardware)
    assert layerwise.enabled(True, model, RECIPE, auto_quantize=False)
    assert not layerwise.enabled("auto", model, RECIPE, auto_quantize=False)  # nothing offloaded on a CPU
    assert not layerwise.enabled(False, model, RECIPE, auto_quantize=False)
    assert not layerwise.enabled("auto", model, "autoquant", auto_quantize=True)
    with pytest.raises(ConfigError, match="recipe autoquant is an AutoQuantize recipe"):
        layerwise.enabled(True, model, "autoquant", auto_quantize=True)

    recipe = tmp_path / "lm_head_w4a4.yaml"
    recipe.write_text(params.recipe_path(GOOD_RECIPES[0]).read_text()
                      + "    - quantizer_name: '*lm_head*input_quantizer'\n      cfg:\n        $import: nvfp4\n")
    folder = tmp_path / "layers"
    with pytest.raises(ConfigError, match=r"quantizes lm_head\.input_quantizer, outside the decoder layers"):
        quantize_model(model, recipe, torch.zeros(4, 16, dtype=torch.long), 4, True, folder)
    assert not list(folder.glob("layer_*"))  # refused before the first layer
