"""Task groups (qad_pipeline/scoring/eval_groups.py): lm-eval's aggregate as the score, each sub-task's value,
per-item values gathered from the sub-tasks' samples, and racing a group by those items. Offline, on a
local group shaped like MMLU (tests/data/eval_group/: group > group > tag > task, size-weighted, two
MMLU-shaped sub-tasks of 6 and 3 items over local jsonl) with the demo model."""

import json
import re

import numpy as np
import pytest
import yaml

from qad_pipeline.scoring import eval_groups, evaluation
from qad_pipeline.core.config import (
    PROJECT_PARAMS,
    PROJECT_ROOT,
    ConfigError,
    load_params,
    resolve,
)
from qad_pipeline.scoring.eval_groups import ITEM_STRIDE as S
from qad_pipeline.scoring.lm_eval_calls import registry_for
from qad_pipeline.scoring.recovery import score_recovery
from qad_pipeline.results.scores import TaskScore

GROUP_DIR = PROJECT_ROOT / "tests" / "data" / "eval_group"
LEAVES = ["mmlu_local_algebra", "mmlu_local_history"]
RACED = [1, 4, S + 2]  # algebra's docs 1 and 4, history's doc 2


def _params(*overrides):
    return load_params(PROJECT_PARAMS, ["hardware.device=cpu", "eval.tasks=[mmlu_local]",
                                        "eval.task_dir=tests/data/eval_group", *overrides])


def test_a_nested_groups_leaves_come_from_lm_evals_index_without_running_anything():
    index = eval_groups.task_manager(str(GROUP_DIR), False).task_index
    assert eval_groups.leaves("mmlu_local", index) == LEAVES  # through a group and a tag, sorted
    assert eval_groups.leaves("mmlu_local_stem", index) == ["mmlu_local_algebra"]
    assert eval_groups.leaves("mmlu_local_algebra", index) is None  # a task, not a group
    assert eval_groups.split_ids([S + 2, 4, 1], LEAVES) == {"mmlu_local_algebra": [1, 4], "mmlu_local_history": [2]}
    with pytest.raises(ValueError, match="item id 2000000 names leaf 2, but the group has 2 leaves"):
        eval_groups.split_ids([2 * S], LEAVES)


def test_items_are_kept_only_when_they_reproduce_the_aggregate():
    per_leaf = {"mmlu_local_algebra": {"aggregation": "mean", "ids": list(range(6)), "values": [1.0] + [0.0] * 5},
                "mmlu_local_history": {"aggregation": "mean", "ids": [0, 1, 2], "values": [1.0, 1.0, 0.0]}}
    weighted = eval_groups.group_items(per_leaf, LEAVES, 3 / 9)
    assert weighted["ids"] == [0, 1, 2, 3, 4, 5, S, S + 1, S + 2] and weighted["aggregation"] == "mean"
    assert eval_groups.group_items(per_leaf, LEAVES, (1 / 6 + 2 / 3) / 2) is None  # a macro mean: no items
    assert eval_groups.group_items({**per_leaf, "mmlu_local_history": None}, LEAVES, 3 / 9) is None


def test_a_raced_group_is_aggregated_as_lm_eval_aggregates_it(tmp_path):
    results = {"mmlu_local_algebra": {"acc,none": 0.5, "acc_stderr,none": 0.1, "sample_len": 2, "alias": "a"},
               "mmlu_local_history": {"acc,none": 1.0, "sample_len": 1}}
    higher = {"mmlu_local_algebra": {"acc": True}}
    index = eval_groups.task_manager(str(GROUP_DIR), False).task_index
    assert eval_groups.aggregate("mmlu_local", index, results, higher) == ({"acc,none": 2 / 3}, {"acc": True})
    # lm-eval's own defaults: weight_by_size true unless the group says otherwise
    for path in GROUP_DIR.glob("mmlu_local_*.yaml"):
        (tmp_path / path.name).write_text(path.read_text())
    for name, agg in [("plain", {"metric": "acc"}), ("macro", {"metric": "acc", "weight_by_size": False})]:
        (tmp_path / f"{name}.yaml").write_text(yaml.safe_dump({"group": name, "task": LEAVES,
                                                               "aggregate_metric_list": [agg]}))
    index = eval_groups.task_manager(str(tmp_path), False).task_index
    assert eval_groups.aggregate("plain", index, results, higher)[0] == {"acc,none": 2 / 3}
    assert eval_groups.aggregate("macro", index, results, higher)[0] == {"acc,none": 0.75}


@pytest.mark.parametrize("group, message", [
    ({"task": [{"task": "mmlu_local_algebra", "num_fewshot": 5}]},
     ("member {'num_fewshot': 5, 'task': 'mmlu_local_algebra'} of 'bad_group' is not a task, group or tag that "
      "lm-eval knows by name here (inline definitions are not read)")),
    ({"task": ["mmlu_local_geography"]}, "member 'mmlu_local_geography' of 'bad_group' is not a task, group or tag"),
    ({"task": ["mmlu_local_stem"], "num_fewshot": 5}, "group 'bad_group' sets ['num_fewshot'] for its members"),
])
def test_a_group_the_project_cannot_read_is_refused_at_load_in_one_line(tmp_path, group, message):
    for path in GROUP_DIR.glob("mmlu_local_*.yaml"):
        (tmp_path / path.name).write_text(path.read_text())
    (tmp_path / "bad_group.yaml").write_text(yaml.safe_dump({"group": "bad_group", **group}))
    params = load_params(PROJECT_PARAMS, ["eval.tasks=[bad_group]", f"eval.task_dir={tmp_path}"])
    with pytest.raises(ConfigError, match="^" + re.escape(f"eval task group 'bad_group': {message}")) as err:
        evaluation.check_tasks(params.eval)
    assert "\n" not in str(err.value)


def test_a_groups_registry_is_its_folder_alone_and_racing_runs_only_the_leaves_asked_for():
    params = _params()
    evaluation.check_tasks(params.eval)  # the project group is known, lm-eval's registry not indexed
    calls, _ = evaluation.eval_calls(params.eval, GROUP_DIR)
    assert calls[0]["tasks"] == ["mmlu_local"] and calls[0]["include_path"] == str(GROUP_DIR)
    assert set(registry_for(calls).all_tasks) == {"mmlu_local", "mmlu_local_stem", "mmlu_local_humanities",
                                                  "mmlu_local_stem_tasks", *LEAVES}
    raced, _ = evaluation.eval_calls(params.eval, GROUP_DIR, {"mmlu_local": [S, S + 2]})
    assert (raced[0]["tasks"], raced[0]["samples"], raced[0]["limit"]) == (["mmlu_local_history"],
                                                                           {"mmlu_local_history": [0, 2]}, None)


def test_old_scores_without_subtasks_stay_valid():
    old = {"metric": "acc", "filter": "none", "value": 0.5, "higher_is_better": True}
    assert TaskScore.model_validate(old).subtasks is None
    assert TaskScore.model_validate({**old, "subtasks": {"a": 0.25}}).subtasks == {"a": 0.25}


@pytest.fixture(scope="module")
def runs(demo_model_path):
    """The demo model scored on the group in full and on RACED, with what lm-eval was called with and returned."""
    import lm_eval
    from transformers import AutoModelForCausalLM, AutoTokenizer

    params = _params()  # transformers' own loader: the project's also imports Model Optimizer (~2 s)
    model = AutoModelForCausalLM.from_pretrained(demo_model_path)
    tokenizer = AutoTokenizer.from_pretrained(demo_model_path)
    real, seen = lm_eval.simple_evaluate, []

    def recorded(**kwargs):
        seen.append({"kwargs": kwargs, "out": real(**kwargs)})
        return seen[-1]["out"]

    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(PROJECT_ROOT)  # the sub-tasks' data_files are relative to the project root
        mp.setattr(lm_eval, "simple_evaluate", recorded)
        full = evaluation.lm_eval_scores(model, tokenizer, params.eval, GROUP_DIR)
        raced = evaluation.lm_eval_scores(model, tokenizer, params.eval, GROUP_DIR, items={"mmlu_local": RACED})
    return {"full": (full["mmlu_local"], seen[0]), "raced": (raced["mmlu_local"], seen[1])}


def test_a_groups_score_is_lm_evals_aggregate_with_its_subtasks_and_items(runs):
    score, call = runs["full"]
    results = call["out"]["results"]
    assert (score["metric"], score["filter"]) == ("acc", "none")
    assert score["value"] == results["mmlu_local"]["acc,none"]  # lm-eval's own aggregate
    assert score["subtasks"] == {leaf: results[leaf]["acc,none"] for leaf in LEAVES}
    # the items: every doc of each sub-task, numbered within the group, with lm-eval's logged values
    items = score["items"]
    assert items["ids"] == [0, 1, 2, 3, 4, 5, S, S + 1, S + 2] and items["aggregation"] == "mean"
    logged = [s["acc"] for leaf in LEAVES for s in sorted(call["out"]["samples"][leaf], key=lambda s: s["doc_id"])]
    assert items["values"] == logged
    assert np.mean(items["values"]) == pytest.approx(score["value"], abs=1e-12)
    macro = np.mean(list(score["subtasks"].values()))
    assert macro != pytest.approx(score["value"])  # the sub-tasks' sizes differ: only a size-weighted mean fits
    # a recovery interval: a "quantized" model that loses one of the group's correct items
    lost = items["values"].index(1.0)
    quantized = {**items, "values": [0.0 if i == lost else v for i, v in enumerate(items["values"])]}
    baseline = {"tasks": {"mmlu_local": score}}
    q_tasks = {"tasks": {"mmlu_local": {**score, "value": float(np.mean(quantized["values"]))}}}
    out = score_recovery(q_tasks, {"mmlu_local": quantized}, baseline, {"mmlu_local": items})
    low, high = out["tasks"]["mmlu_local"]["recovery_ci"]
    assert low < out["tasks"]["mmlu_local"]["recovery"] < 1.0 <= high
    json.dumps(score)  # the score travels as JSON (scores.json, items.json)


def test_racing_a_group_scores_exactly_the_requested_docs_in_their_subtasks(runs):
    score, call = runs["raced"]
    assert call["kwargs"]["tasks"] == LEAVES
    assert call["kwargs"]["samples"] == {"mmlu_local_algebra": [1, 4], "mmlu_local_history": [2]}
    logged = call["out"]["samples"]
    assert {leaf: sorted({s["doc_id"] for s in logged[leaf]}) for leaf in logged} == call["kwargs"]["samples"]
    assert score["items"]["ids"] == RACED
    # the same docs give the same values as in the full run; the score is their size-weighted mean
    full = dict(zip(runs["full"][0]["items"]["ids"], runs["full"][0]["items"]["values"]))
    assert score["items"]["values"] == [full[i] for i in RACED]
    assert score["value"] == pytest.approx(np.mean(score["items"]["values"]), abs=1e-12)
    assert set(score["subtasks"]) == set(LEAVES)


@pytest.mark.slow  # indexes lm-eval's registry (~9 s); reads no data
def test_lm_evals_mmlu_is_read_as_its_57_subjects_and_raced_by_them(tmp_path):
    from qad_pipeline.plan.eval_costs import STANDARD

    params = load_params(PROJECT_PARAMS, ["eval.tasks=[mmlu]", "eval.task_settings={}"])
    evaluation.check_tasks(params.eval)
    subjects = evaluation._leaves("mmlu", resolve(params.eval.task_dir))
    assert subjects == sorted(STANDARD["mmlu"].items)  # the plan's 57 subjects, through mmlu's groups and tags
    calls, _ = evaluation.eval_calls(params.eval, tmp_path, {"mmlu": [5, 3 * S + 7]})
    assert (calls[0]["tasks"], calls[0]["samples"]) == (["mmlu_abstract_algebra", "mmlu_business_ethics"],
                                                        {"mmlu_abstract_algebra": [5], "mmlu_business_ethics": [7]})
