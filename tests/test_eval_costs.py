"""What the plan says each evaluation sends (qad_pipeline/plan/eval_costs.py): the standard suite's
requests, racing's round-1 pricing, and a registry task whose size is unknown. No model loads."""

import json
import math
from pathlib import Path

import lm_eval
import pytest
import yaml

from qad_pipeline.plan import costs, eval_costs
from qad_pipeline.core.config import PROJECT_ROOT, load_params
from qad_pipeline.plan.eval_costs import STANDARD, stage_cost, task_sizes
from qad_pipeline.plan.memory_model import model_shape
from qad_pipeline.core.targets import parse

PROFILE_8B = PROJECT_ROOT / "profiles" / "llama-3.1-8b_8xh100.yaml"
TASKS = Path(lm_eval.__file__).parent / "tasks"
OTHER = ("eval.tasks=[hellaswag,arc_challenge,mmlu]", "eval.task_settings={}")


def _params(*overrides: str):
    return load_params(PROFILE_8B, list(overrides))


def test_standard_suite_requests_are_items_times_choices_within_the_limits():
    sizes = {s.task: s for s in task_sizes(_params())[0]}
    assert {t: s.requests for t, s in sizes.items()} == {
        "mmlu": 14_042 * 4, "gsm8k": 1_319, "arc_challenge": 1_172 * 4, "hellaswag": 10_042 * 4, "winogrande": 1_267 * 2}
    # eval.limit cuts each task, and each of a group's sub-tasks (57 MMLU subjects, all over 100 items);
    # a task's own limit wins over it
    settings = {"hellaswag": {"limit": 50}, "gsm8k": {"num_fewshot": 0, "gen_kwargs": {"max_gen_toks": 64}}}
    limited = {s.task: s for s in task_sizes(_params("eval.limit=100", f"eval.task_settings={json.dumps(settings)}"))[0]}
    assert {t: s.requests for t, s in limited.items()} == {
        "mmlu": 57 * 100 * 4, "gsm8k": 100, "arc_challenge": 400, "hellaswag": 200, "winogrande": 200}
    gsm = STANDARD["gsm8k"]  # 5-shot by default; here 0-shot and at most 64 generated tokens
    assert sizes["gsm8k"].tokens == 1_319 * (gsm.request_tokens + 5 * gsm.shot_tokens + gsm.generated)
    assert limited["gsm8k"].tokens == 100 * (gsm.request_tokens + 64)
    # MMLU's one-token letters: four requests, one forward per item
    assert sizes["mmlu"].tokens == 14_042 * STANDARD["mmlu"].request_tokens


def test_the_known_facts_agree_with_lm_evals_own_task_yamls():
    class Loader(yaml.SafeLoader):
        pass

    Loader.add_multi_constructor("!", lambda loader, suffix, node: None)

    def config(path: Path) -> dict:
        cfg = yaml.load(path.read_text(), Loader=Loader)
        base = cfg.pop("include", None)
        return {**(config(path.parent / base) if base else {}), **cfg}

    files = {"gsm8k": "gsm8k/gsm8k.yaml", "arc_challenge": "arc/arc_challenge.yaml", "hellaswag": "hellaswag/hellaswag.yaml",
             "winogrande": "winogrande/default.yaml", "ifeval": "ifeval/ifeval.yaml",
             "mmlu": "mmlu/default/mmlu_abstract_algebra.yaml"}
    for task, rel in files.items():
        cfg, known = config(TASKS / rel), STANDARD[task]
        split = cfg.get("test_split") or cfg.get("validation_split")
        assert (split, cfg.get("num_fewshot", 0)) == (known.split, known.fewshot), task
        assert (cfg["output_type"] == "generate_until") == (known.choices == 1), task
    assert len(config(TASKS / files["mmlu"])["doc_to_choice"]) == STANDARD["mmlu"].choices
    subjects = {p.stem for p in (TASKS / "mmlu" / "default").glob("mmlu_*.yaml")}
    assert subjects == set(STANDARD["mmlu"].items) and sum(STANDARD["mmlu"].items.values()) == 14_042


def test_racing_prices_each_recipe_at_round_one_and_the_race_at_its_rounds():
    full_p = _params(*OTHER)
    raced_p = _params(*OTHER, "race.enabled=true", "race.fractions=[0.25,0.5,1.0]")
    full, first = stage_cost("ptq/x", full_p), stage_cost("ptq/x", raced_p)
    sizes = {s.task: s for s in task_sizes(full_p)[0]}
    # a quarter of each raced task (rounded up); MMLU, a group, sliced as one task of its 14,042 items
    assert first.items == math.ceil(10_042 / 4) + math.ceil(1_172 / 4) + math.ceil(14_042 / 4)
    assert first.tokens == pytest.approx(sum(s.tokens for s in sizes.values()) / 4, rel=1e-3)
    assert first.window_tokens == 16 * raced_p.eval.seq_len and full.window_tokens == 64 * raced_p.eval.seq_len
    race = stage_cost("race", raced_p)
    recipes = len(raced_p.ptq.recipes)
    assert race.items == recipes * (full.items - first.items) and race.best.items == full.items - first.items
    assert race.requests == recipes * race.best.requests > 0
    assert stage_cost("baseline", raced_p).tokens == full.tokens == stage_cost("final_eval", raced_p).tokens
    # the time estimate follows: a raced recipe's evaluation is the round-1 share of the full one
    shape, flops = model_shape(full_p.base_model), parse("8xH100-80GB").bf16_flops
    calib = costs.seconds("ptq/x", full_p, shape, flops) - costs.eval_seconds(full, shape, flops)
    raced_eval = costs.seconds("ptq/x", raced_p, shape, flops) - calib
    assert raced_eval == pytest.approx(costs.eval_seconds(full, shape, flops) * first.total_tokens / full.total_tokens)
    assert costs.seconds("race", raced_p, shape, flops) == pytest.approx(costs.eval_seconds(race, shape, flops))
    lines = eval_costs.summary(raced_p, [("race", race, None)])
    n_full, n_first = full.items + full.windows, first.items + first.windows  # the race counts windows as items
    assert f"worst case {recipes * n_full:,} items" in lines[-1]
    assert f"best case {recipes * n_first + n_full - n_first:,}" in lines[-1]


def test_a_registry_task_of_unknown_size_is_reported_as_not_counted():
    params = _params("eval.tasks=[hellaswag,lambada_openai]", "eval.task_settings={}")
    sizes, unknown = task_sizes(params)
    assert [s.task for s in sizes] == ["hellaswag"] and unknown == ["lambada_openai"]
    assert stage_cost("baseline", params).uncounted == ["lambada_openai"]
    assert stage_cost("qad", params) is None and stage_cost("calibration", params) is None


def test_the_docs_have_the_standard_suites_cost_from_the_plan():
    import importlib.util

    spec = importlib.util.spec_from_file_location("eval_costs_table", PROJECT_ROOT / "scripts" / "eval_costs_table.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    page = (PROJECT_ROOT / "docs" / "memory-plan.md").read_text()
    for table in (script.task_table(), script.stage_table()):
        assert "\n".join(table) in page, "docs/memory-plan.md's eval cost tables differ: run scripts/eval_costs_table.py"


def test_the_racing_budget_counts_items_as_the_race_does():
    """The plan's items per round are what `racing.round_ids` slices from the baseline's items (the
    demo's 300 cloze, 200 continuation items and 48 windows: 137 at a quarter, as the demo's measured race scored in round 1)."""
    from qad_pipeline.scoring import racing

    params = load_params(PROJECT_ROOT / "params.yaml", ["race.enabled=true", "race.fractions=[0.1,0.25,0.5,1.0]"])
    ev = params.eval
    baseline = {"heldout_cloze": {"ids": list(range(ev.num_cloze))},
                "heldout_continuation": {"ids": list(range(ev.num_continuation))},
                "perplexity": {"ids": list(range(ev.ppl_samples))}}
    rounds = racing.round_ids(baseline, params.race.fractions, params.race.seed)
    assert eval_costs.round_items(params) == [racing.count(r) for r in rounds] == [55, 137, 274, 548]
