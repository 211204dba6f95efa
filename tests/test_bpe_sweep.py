"""The BPE sweep: the knee rule (a pure function), AutoQuantize recipes refused up front, and an
AutoQuantize model's layer map and both bit counts against the safetensors of its export."""

import pytest

from qad_pipeline.nvfp4 import autoquant
from qad_pipeline.core.config import PROJECT_ROOT, ConfigError, load_params
from qad_pipeline.results.sweep_metrics import SweepPoint
from tasks.bpe_sweep import choose_knee, monotone_within, noise

SWEEP_RECIPE = PROJECT_ROOT / "recipes" / "autoquant_4o6-fp8-kv_fp8.yaml"


def point(bpe: float, recovery: float, half: float = 0.002) -> SweepPoint:
    return SweepPoint(name=f"r@{bpe}", kind="sweep", budget=bpe, searched_effective_bits=bpe, effective_bpe=bpe,
                      median_recovery=recovery, median_recovery_ci=(recovery - half, recovery + half),
                      kl_divergence=0.01, layers_by_format={})


def test_knee_of_a_flat_curve_is_its_first_point():
    knee = choose_knee([point(5, 0.98), point(6, 0.981), point(8, 0.9812)], epsilon=0.005)
    assert knee.name == "r@5" and "flat" in knee.reason


def test_knee_where_gains_fall_below_epsilon():
    # +3 points per bit from 4.75 to 5.0, then under 0.5 points per bit
    curve = [point(4.75, 0.95), point(5.0, 0.9575), point(5.5, 0.959), point(6.5, 0.961), point(8.0, 0.962)]
    knee = choose_knee(curve, epsilon=0.005)
    assert knee.name == "r@5.0" and knee.budget == 5.0
    assert "below ε = 0.50" in knee.reason


def test_knee_of_a_curve_that_keeps_gaining_is_its_last_point():
    knee = choose_knee([point(5, 0.90), point(6, 0.93), point(7, 0.96)], epsilon=0.005)
    assert knee.name == "r@7" and "most bits" in knee.reason


def test_a_noisy_dip_does_not_end_the_search_early():
    # 5.5 dips below 5.0 (noise), but 8.0 still gains 1 point per bit over 5.0: the knee is further
    curve = [point(5.0, 0.95), point(5.5, 0.948), point(8.0, 0.98)]
    assert choose_knee(curve, epsilon=0.005).name == "r@8.0"
    assert monotone_within(curve, noise(curve) + 0.001) and not monotone_within(curve, 0.001)


def test_no_points_no_knee():
    knee = choose_knee([], epsilon=0.005)
    assert knee.name is None and "no sweep point" in knee.reason


def test_recipe_validation_names_the_key(tmp_path):
    bad = tmp_path / "aq.yaml"
    bad.write_text(SWEEP_RECIPE.read_text().replace("method: gradient", "methd: gradient"))
    with pytest.raises(ConfigError, match=r"auto_quantize.methd: unknown key"):
        autoquant.load_recipe(bad)
    bad.write_text(SWEEP_RECIPE.read_text().replace("FP8_DEFAULT_CFG]", "FP3_CFG]"))
    with pytest.raises(ConfigError, match=r"unknown format 'FP3_CFG'"):
        autoquant.load_recipe(bad)


def test_budget_below_what_the_model_allows_is_refused_with_the_minimum():
    params = load_params()
    spec = autoquant.load_recipe(SWEEP_RECIPE)
    low = autoquant.minimum_budget(spec, params.base_model)
    # the formats alone allow 4 bits; the demo's BF16 attention and convolutions raise it
    assert autoquant.minimum_bits(spec) == 4.0 and 4.0 < low < 5.0
    with pytest.raises(ConfigError, match=rf"effective_bits 4.5 is outside .* the minimum possible is {low:g}"):
        autoquant.check_recipe(SWEEP_RECIPE, [4.5], params.base_model)
    autoquant.check_recipe(SWEEP_RECIPE, [low, 8.0], params.base_model)  # at the minimum: accepted


def test_minimum_budget_is_computed_once_per_recipe_and_model(monkeypatch):
    """Preflight and the stage in one process ask for the same minimum: the meta-model check runs once
    (the budget itself is not part of it); another model or other formats are checked again."""
    params = load_params()
    spec = autoquant.load_recipe(SWEEP_RECIPE)
    low = autoquant.minimum_budget(spec, params.base_model)
    calls = []
    monkeypatch.setattr(autoquant, "_MINIMUMS", dict(autoquant._MINIMUMS))  # the stand-in's 7.0 stays in this test
    monkeypatch.setattr(autoquant, "_feasibility_minimum", lambda *args: calls.append(args) or 7.0)
    assert autoquant.minimum_budget(spec.model_copy(update={"effective_bits": 8.0}), params.base_model) == low
    assert calls == []
    assert autoquant.minimum_budget(spec.model_copy(update={"formats": ["FP8_DEFAULT_CFG"]}), params.base_model) == 7.0
    assert len(calls) == 1


def test_layer_map_and_both_bit_counts_agree_with_the_export(tmp_path):
    """AutoQuantize on the demo model at 5.0 bits, exported by Model Optimizer as MIXED_PRECISION:
    each layer's chosen format is what its exported tensors hold, Model Optimizer's count is the
    layer map's, and the project's whole-model count is the safetensors' (the export's checks)."""
    from modelopt.torch.export import export_hf_checkpoint

    from qad_pipeline.core.artifacts import read_json
    from qad_pipeline.checks.export_checks import check_formats, check_size, normalize, read_tensors, tensor_format
    from qad_pipeline.core.modeling import load_model, load_tokenizer
    from qad_pipeline.nvfp4.sizes import size_report
    from tasks.export import repair_layer_names

    params = load_params()
    model = load_model(params.base_model, params.hardware)
    tokenizer = load_tokenizer(params.base_model)
    text = " ".join(p.read_text() for p in sorted((PROJECT_ROOT / "data" / "heldout").glob("*.txt"))[:2])
    samples = tokenizer(text, return_tensors="pt").input_ids[0][: 8 * 64].reshape(8, 64)
    spec = autoquant.load_recipe(SWEEP_RECIPE)
    state = autoquant.search(model, spec, samples, 4, budget=5.0)
    layers = autoquant.layer_map(state)
    assert autoquant.bits_of(layers) == pytest.approx(autoquant.searched_bits(state), rel=1e-9)
    assert autoquant.searched_bits(state) <= 5.0
    chosen = {layer["format"] for layer in layers.values() if len(layer["costs"]) > 1}
    assert {"NVFP4_FOUR_OVER_SIX_CFG", "FP8_DEFAULT_CFG"} <= chosen, "not every layer is NVFP4"
    expected = size_report(model)

    export_hf_checkpoint(model, export_dir=tmp_path)
    repair_layer_names(tmp_path)  # as the export stage does: the mixed-precision layer list's names too
    tensors = read_tensors(tmp_path)
    config = read_json(tmp_path / "hf_quant_config.json")
    assert config["quantization"]["quant_algo"] == "MIXED_PRECISION"
    formats = check_formats(expected["layer_formats"], tensors, config)
    assert formats["passed"], formats["problems"]
    assert check_size(expected["effective_bpe"], tensors)["passed"]
    held = {}
    for name in tensors:
        if name.endswith(".weight") and tensors[name].dim() == 2 or tensor_format(name, tensors) == "nvfp4":
            held.setdefault(normalize(name), set()).add(tensor_format(name, tensors))
    want = {"NVFP4_FOUR_OVER_SIX_CFG": "nvfp4", "FP8_DEFAULT_CFG": "fp8", "none": "bf16"}
    checked = 0
    for layer in layers.values():
        for module in layer["modules"]:
            got = held.get(normalize(module))
            if got is not None:
                assert got == {want[layer["format"]]}, (module, layer["format"], got)
                checked += 1
    assert checked >= 10


@pytest.mark.slow
def test_sweep_flow_gives_the_curve_the_knee_and_its_records(tmp_path):
    """`bpe-sweep` end to end on the tiny settings, two budgets and one fixed recipe: the search runs
    once and each point reuses it, the curve and knee are written, the table is a Prefect artifact,
    MLflow has a child run per budget, and the points are PTQ folders that selection can take."""
    from prefect.client.orchestration import get_client
    from prefect.testing.utilities import prefect_test_harness

    from flows.sweep_flow import bpe_sweep
    from qad_pipeline import tracking
    from qad_pipeline.core.layout import Layout
    from qad_pipeline.results.base import read_result
    from qad_pipeline.results.scores import PTQScores
    from qad_pipeline.results.sweep_metrics import BPESweep
    from tests.conftest import GOOD_RECIPES, TINY

    overrides = [*TINY, f"ptq.recipes=[{GOOD_RECIPES[0]}]", "sweep.budgets=[5.0, 8.0]"]
    with prefect_test_harness(server_startup_timeout=120):
        summary = bpe_sweep(params_file=str(PROJECT_ROOT / "params.yaml"), overrides=overrides, out_root=str(tmp_path))
        with get_client(sync_client=True) as client:
            keys = {a.key for a in client.read_latest_artifacts()}
    layout = Layout(tmp_path)
    sweep = read_result(layout.bpe_sweep_metrics, BPESweep)
    assert [p.budget for p in sweep.points] == [5.0, 8.0] and [p.name for p in sweep.fixed] == [GOOD_RECIPES[0]]
    assert sweep.knee.name in {p.name for p in sweep.points} and sweep.knee.reason
    low, high = sweep.points
    assert low.searched_effective_bits < high.searched_effective_bits and low.effective_bpe < high.effective_bpe
    for budget in ("5.0", "8.0"):
        scores = read_result(layout.sweep(budget) / "scores.json", PTQScores)
        assert scores.auto_quantize.reused_search and scores.recipe == f"autoquant_4o6-fp8-kv_fp8@{budget}"
        assert (layout.candidate(scores.recipe) / "checkpoint").is_dir()
    assert "bpe-sweep-demo-model" in keys
    store = tracking.client_for(tracking.tracking_uri(tmp_path))
    parent = summary["mlflow"]["run_id"]
    children = store.search_runs([store.get_run(parent).info.experiment_id], f"tags.mlflow.parentRunId = '{parent}'")
    assert sorted(r.info.run_name for r in children) == ["sweep-5.0", "sweep-8.0"]
    assert (layout.bpe_sweep / "pareto.png").is_file()


def test_kl_div_scoring_searches_to_the_budget_too():
    """`method: kl_div` scores by the KL between unquantized and quantized logits (no backward)."""
    from qad_pipeline.core.modeling import load_model, load_tokenizer

    params = load_params()
    model, tokenizer = load_model(params.base_model, params.hardware), load_tokenizer(params.base_model)
    text = " ".join(p.read_text() for p in sorted((PROJECT_ROOT / "data" / "heldout").glob("*.txt"))[:2])
    samples = tokenizer(text, return_tensors="pt").input_ids[0][: 4 * 64].reshape(4, 64)
    spec = autoquant.load_recipe(SWEEP_RECIPE).model_copy(update={"method": "kl_div", "num_score_steps": 1})
    state = autoquant.search(model, spec, samples, 4, budget=5.0)
    assert state["method"] == "kl_div"
    assert autoquant.bits_of(autoquant.layer_map(state)) == pytest.approx(autoquant.searched_bits(state))
    assert autoquant.searched_bits(state) <= 5.0


def _noisy_curve(seed: int, wrong: dict[float, float]):
    """A sweep on 400 pass/fail items: each point fails a baseline-passed item with probability
    `wrong[bits]`, drawn with `seed` (one eval run); its scores, items and paired resamples."""
    import numpy as np

    from qad_pipeline.scoring.recovery import median_draws

    rng = np.random.default_rng(seed)
    base_values = (np.arange(400) % 5 != 0).astype(float)  # 80 % right
    baseline = {"tasks": {"t": {"value": base_values.mean(), "higher_is_better": True}}}
    base_items = {"t": {"aggregation": "mean", "ids": list(range(400)), "values": base_values.tolist()}}
    points, draws = [], {}
    for b, p in wrong.items():
        values = base_values * (rng.random(400) >= p)
        scores = {"tasks": {"t": {"value": values.mean(), "higher_is_better": True}}}
        items = {"t": {"aggregation": "mean", "ids": list(range(400)), "values": values.tolist()}}
        recovery = values.mean() / base_values.mean()
        points.append(point(b, recovery))
        draws[f"r@{b}"] = median_draws(scores, items, baseline, base_items)
    return points, draws


def test_the_knee_does_not_move_with_the_eval_noise():
    """A curve flat within the noise (every point loses ~3 % of the items, drawn afresh in each of
    ten runs): on point estimates the knee moves between runs; on the paired intervals it is the
    first point every time, and the reason says the curve is flat within the noise."""
    flat = {5.0: 0.03, 5.5: 0.03, 6.5: 0.03, 8.0: 0.03}
    on_points, on_intervals = set(), set()
    for seed in range(10):
        points, draws = _noisy_curve(seed, flat)
        on_points.add(choose_knee(points, epsilon=0.002).name)
        knee = choose_knee(points, epsilon=0.002, draws=draws)
        on_intervals.add(knee.name)
        assert "flat within the noise" in knee.reason
    assert len(on_points) > 1 and on_intervals == {"r@5.0"}


def test_a_gain_beyond_the_noise_still_moves_the_knee():
    # 5.0 loses 25 % of the items, 6.5 and 8.0 lose 2 %: a gain of ~15 points per bit, far beyond the noise
    points, draws = _noisy_curve(0, {5.0: 0.25, 6.5: 0.02, 8.0: 0.02})
    knee = choose_knee(points, epsilon=0.01, draws=draws)
    assert knee.name == "r@6.5" and "paired interval" in knee.reason
