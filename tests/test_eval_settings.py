"""lm-eval's settings per task (eval.task_settings) reach lm-eval, and the metric and filter that
count are the ones read: offline, on a local task shaped like GSM8K (generation, few-shot from its
own split, a strict-match and a flexible-extract filter) with the demo model."""

import json

import pytest
import yaml

from qad_pipeline.scoring import evaluation
from qad_pipeline.core.config import PROJECT_PARAMS, ConfigError, load_params

TASK = {
    "task": "gsm8k_local", "dataset_path": "json", "test_split": "test", "fewshot_split": "test",
    "output_type": "generate_until", "doc_to_text": "Question: {{question}}\nAnswer:", "doc_to_target": "{{answer}}",
    "generation_kwargs": {"until": ["Question:"], "do_sample": False, "max_gen_toks": 32},
    "filter_list": [
        {"name": "strict-match", "filter": [{"function": "regex", "regex_pattern": r"#### (\-?[0-9\.\,]+)"},
                                            {"function": "take_first"}]},
        {"name": "flexible-extract", "filter": [{"function": "regex", "group_select": -1,
                                                 "regex_pattern": r"(-?[$0-9.,]{2,})|(-?[0-9]+)"},
                                                {"function": "take_first"}]},
    ],
    "metric_list": [{"metric": "exact_match", "aggregation": "mean", "higher_is_better": True}],
}
CHAT = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}")


@pytest.fixture(scope="module")
def task_files(tmp_path_factory):
    root = tmp_path_factory.mktemp("gsm8k")
    (root / "tasks").mkdir()
    (root / "eval").mkdir()
    (root / "tasks" / "gsm8k_local.yaml").write_text(yaml.safe_dump(TASK))
    rows = [{"question": f"What is {a} plus {b}?", "answer": f"{a} + {b} = {a + b}\n#### {a + b}"}
            for a, b in [(2, 3), (4, 5), (10, 7), (6, 6), (1, 8), (3, 9)]]
    (root / "eval" / "gsm8k_local.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return root


def test_settings_reach_lm_eval_and_the_strict_match_is_read(task_files, monkeypatch):
    import lm_eval

    from qad_pipeline.core.modeling import load_model, load_tokenizer

    settings = {"gsm8k_local": {"num_fewshot": 2, "apply_chat_template": True, "fewshot_as_multiturn": True,
                                "gen_kwargs": {"max_gen_toks": 8}, "metric": "exact_match",
                                "filter": "strict-match", "limit": 3}}
    # a number, as a stage settles `auto` (qad_pipeline/plan/memory.py): unsettled, lm-eval's own batch-size
    # search would run the model at its longest length until it fits (34 of this test's 46 s)
    params = load_params(PROJECT_PARAMS, ["hardware.device=cpu", "eval.batch_size=4", "eval.tasks=[gsm8k_local]",
                                          f"eval.task_dir={task_files / 'tasks'}",
                                          f"eval.task_settings={json.dumps(settings)}"])
    calls = []
    real = lm_eval.simple_evaluate

    def recorded(**kwargs):
        calls.append({"kwargs": kwargs, "out": real(**kwargs)})
        return calls[-1]["out"]

    monkeypatch.setattr(lm_eval, "simple_evaluate", recorded)
    model = load_model(params.base_model, params.hardware)
    tokenizer = load_tokenizer(params.base_model)
    tokenizer.chat_template = CHAT
    scores = evaluation.lm_eval_scores(model, tokenizer, params.eval, task_files / "eval")

    kwargs = calls[0]["kwargs"]
    assert (kwargs["num_fewshot"], kwargs["apply_chat_template"], kwargs["fewshot_as_multiturn"],
            kwargs["gen_kwargs"], kwargs["limit"]) == (2, True, True, {"max_gen_toks": 8}, 3)
    samples = calls[0]["out"]["samples"]["gsm8k_local"]
    prompt, generation = samples[0]["arguments"][0]
    # two shots as user/assistant turns, then the question, in the chat template's markup
    assert prompt.count("<|user|>Question:") == 3 and prompt.count("<|assistant|>") == 3, prompt
    assert generation["max_gen_toks"] == 8 and generation["until"] == ["Question:"]
    assert len({s["doc_id"] for s in samples}) == 3
    score = scores["gsm8k_local"]
    results = calls[0]["out"]["results"]["gsm8k_local"]
    assert (score["metric"], score["filter"]) == ("exact_match", "strict-match")
    assert score["value"] == results["exact_match,strict-match"]
    assert set(score["all"]) == {"exact_match,strict-match", "exact_match,flexible-extract"}
    assert score["items"]["values"] == [s["exact_match"] for s in sorted(samples, key=lambda s: s["doc_id"])
                                        if s["filter"] == "strict-match"]


def test_a_metric_or_filter_the_task_does_not_report_is_named():
    results = {"exact_match,strict-match": 0.5, "exact_match,flexible-extract": 0.75, "alias": "x"}
    assert evaluation.primary_score("t", results, {}, [], "exact_match", "flexible-extract")["value"] == 0.75
    assert evaluation.primary_score("t", results, {}, [])["filter"] == "strict-match"  # the first by default
    with pytest.raises(ConfigError, match=r"lm-eval reports no 'exact_match' under filter 'strict'; it reports "
                                          r"\['exact_match,flexible-extract', 'exact_match,strict-match'\]"):
        evaluation.primary_score("t", results, {}, [], "exact_match", "strict")


@pytest.mark.parametrize("settings, message", [
    ({"mmlu": {"num_fewshot": 5}}, "task_settings for ['mmlu'], which eval.tasks does not list"),
    ({"heldout_cloze": {"fewshot_as_multiturn": True}}, "fewshot_as_multiturn needs apply_chat_template: true"),
    ({"heldout_cloze": {"num_fewshots": 5}}, "num_fewshots"),
])
def test_bad_task_settings_are_refused_in_one_line(settings, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        load_params(PROJECT_PARAMS, [f"eval.task_settings={json.dumps(settings)}"])


def test_a_raced_task_and_an_unraced_one_go_in_two_calls_so_the_limit_still_cuts_the_unraced(tmp_path):
    """lm-eval's `samples` replaces `limit` for a whole call: a task racing does not slice (a
    corpus-level metric, say) would otherwise lose `eval.limit` in a slice and be scored on other
    items than in the baseline."""
    for name in ("heldout_cloze", "heldout_continuation"):
        (tmp_path / f"{name}.jsonl").write_text("{}\n")
    params = load_params(PROJECT_PARAMS, {"eval.limit": 5}).eval
    calls, _ = evaluation.eval_calls(params, tmp_path, items={"heldout_cloze": [3, 1]})
    raced, rest = calls
    assert [t["task"] for t in raced["tasks"]] == ["heldout_cloze"] and raced["samples"] == {"heldout_cloze": [1, 3]}
    assert raced["limit"] is None
    assert [t["task"] for t in rest["tasks"]] == ["heldout_continuation"] and rest["samples"] is None
    assert rest["limit"] == 5
    full, _ = evaluation.eval_calls(params, tmp_path)  # without racing: one call, the limit for both
    assert len(full) == 1 and full[0]["limit"] == 5 and full[0]["samples"] is None
