"""Evaluation: lm-eval tasks, perplexity and KL divergence, the same for every model.

`evaluate_model` scores any model object (BF16, fake-quantized PTQ, QAD student) the same way:

* every task in `eval.tasks` through lm-eval's harness (`simple_evaluate`). A name with a YAML
  file in `eval.task_dir` is one of the project's tasks, read from the held-out jsonl that the
  calibration stage wrote; any other name is looked up in lm-eval's own task registry.
  `eval.task_settings.<task>` sets its few-shot count, chat template (few-shot as multi-turn),
  generation settings and item limit (tasks with the same settings share one `simple_evaluate`
  call), and the metric and filter that count; without them, the task's first listed metric
  under its first filter is its score. A task group (lm-eval's `mmlu`, a group YAML in
  `eval.task_dir`) scores lm-eval's aggregate, with its sub-tasks' values and items (`eval_groups`).
* perplexity over the held-out token windows (a task whose lower value is better);
* KL divergence to the BF16 model's next-token distribution, read from the reference that the
  baseline wrote (`qad_pipeline.scoring.reference`: top-k log-probs + rest mass, streamed).

The BF16 baseline stage (`tasks/baseline.py`) writes `metrics/baseline.json` and that
reference (`artifacts/baseline/reference/`); PTQ, the sweep and the final eval score against it.
"""

from __future__ import annotations

from pathlib import Path

import torch
import yaml

from qad_pipeline.scoring import eval_groups
from qad_pipeline.core.calibration_data import load_ppl_windows
from qad_pipeline.core.config import ConfigError, EvalParams, resolve
from qad_pipeline.scoring.eval_groups import is_project_group


def project_task_config(name: str, task_dir: Path, eval_dir: Path) -> dict | None:
    """The project's task YAML, pointed at the held-out jsonl of this run; None if not ours (or a group)."""
    path = task_dir / f"{name}.yaml"
    if not path.is_file() or is_project_group(name, task_dir):
        return None
    cfg = yaml.safe_load(path.read_text())
    data_file = eval_dir / f"{name}.jsonl"
    if not data_file.is_file():
        raise ConfigError(f"eval task {name!r} needs {data_file}; run the calibration stage first")
    cfg["dataset_kwargs"] = {"data_files": {cfg.get("test_split", "test"): str(data_file)}}
    return cfg


def check_tasks(params: EvalParams) -> None:
    """Every task name is a project task or group, or known to lm-eval (checked before any model loads)."""
    task_dir = resolve(params.task_dir)
    for name in params.tasks:
        if is_project_group(name, task_dir):
            try:
                eval_groups.leaves(name, eval_groups.index_for(name, task_dir))
            except eval_groups.GroupShapeError as err:
                raise ConfigError(f"{err} ({task_dir / f'{name}.yaml'})") from None
    foreign = [t for t in params.tasks if not (task_dir / f"{t}.yaml").is_file()]
    if not foreign:
        return
    known = set(eval_groups.task_manager(str(task_dir), True).all_tasks)
    unknown = [t for t in foreign if t not in known]
    if unknown:
        ours = sorted(p.stem for p in task_dir.glob("*.yaml"))
        raise ConfigError(f"unknown eval task(s) {unknown}: not in {task_dir} ({ours}) nor in lm-eval's registry")


def primary_score(task: str, results: dict, higher: dict, metric_order: list[str], metric: str | None = None,
                  filter_name: str | None = None) -> dict:
    """{"metric", "filter", "value", "higher_is_better", "all"} for one task of lm-eval's results
    (keyed "metric,filter"): `metric` under `filter_name` when given, else the task's first listed
    metric (`metric_order`) under its first filter."""
    values = {
        tuple(k.split(",", 1)): float(v)
        for k, v in results.items()
        if "," in k and "_stderr" not in k and isinstance(v, (int, float)) and not isinstance(v, bool)
    }
    if not values:
        raise RuntimeError(f"lm-eval returned no numeric metric for task {task!r}: {results}")
    names = [m for m, _ in values]
    chosen = metric or next((m for m in metric_order if m in names), names[0])
    pairs = [(m, f) for m, f in values if m == chosen and (filter_name is None or f == filter_name)]
    if not pairs:
        raise ConfigError(f"eval.task_settings.{task}: lm-eval reports no {chosen!r}"
                          + (f" under filter {filter_name!r}" if filter_name else "")
                          + f"; it reports {sorted(','.join(p) for p in values)}")
    return {
        "metric": chosen,
        "filter": pairs[0][1],
        "value": values[pairs[0]],
        "higher_is_better": bool(higher.get(chosen, True)),
        "all": {",".join(p): v for p, v in values.items()},
    }


def eval_calls(params: EvalParams, eval_dir: Path, items: dict[str, list[int]] | None = None
               ) -> tuple[list[dict], dict[str, list[str]]]:
    """lm-eval's `simple_evaluate` calls for `params.tasks` (`qad_pipeline.scoring.lm_eval_calls`: JSON, what
    the vLLM side runs too), and each task's metric order. With `items` (racing): only the tasks it
    names with ids, on those doc ids, through lm-eval's `samples` (a group's: `eval_groups.raced_group`);
    the others in full. A call that runs a group of `eval.task_dir` names that folder as `include_path`."""
    task_dir = resolve(params.task_dir)
    specs, metric_orders, samples, local = {}, {}, {}, set()
    names = [n for n in params.tasks if items is None or n not in items or items[n]]
    for name in names:
        cfg = project_task_config(name, task_dir, eval_dir)
        specs[name] = cfg if cfg is not None else name
        metric_orders[name] = [m["metric"] for m in (cfg or {}).get("metric_list", [])]
        if is_project_group(name, task_dir):
            local.add(name)
        if items and name in items:
            # lm-eval maps a logged sample back to its doc id only through sorted ids (evaluator.py)
            samples[name] = {name: sorted(items[name])}
            group_leaves = None if cfg is not None else _leaves(name, task_dir)
            if group_leaves:  # its leaves that have ids, on those docs (eval_groups.aggregate scores it)
                specs[name], samples[name] = eval_groups.raced_group(items[name], group_leaves)
    calls = []
    for (fewshot, chat, multiturn, gen, limit), group in _by_settings(params).items():
        group = [n for n in group if n in names]
        # the raced tasks (on their ids) apart from the rest (on `limit`, as in a full evaluation):
        # lm-eval's `samples` replaces `limit` for a whole call
        for part in ([n for n in group if n in samples], [n for n in group if n not in samples]):
            if not part:
                continue
            chosen = {leaf: docs for n in part for leaf, docs in samples.get(n, {}).items()} or None
            tasks = [t for n in part for t in (specs[n] if isinstance(specs[n], list) else [specs[n]])]
            call = {"tasks": tasks, "samples": chosen,
                    "limit": None if chosen else limit, "num_fewshot": fewshot, "apply_chat_template": chat,
                    "fewshot_as_multiturn": multiturn, "gen_kwargs": dict(gen) if gen else None}
            if local.intersection(part):
                call["include_path"] = str(task_dir)
            calls.append(call)
    return calls, metric_orders


def _leaves(name: str, task_dir: Path) -> list[str] | None:
    """A group's sorted leaves (None: not a group, or one whose leaves the project cannot name)."""
    try:
        return eval_groups.leaves(name, eval_groups.index_for(name, task_dir))
    except eval_groups.GroupShapeError as err:
        print(f"eval: {err}; it is scored as one number", flush=True)
        return None


def read_scores(params: EvalParams, out: dict, metric_orders: dict[str, list[str]]) -> dict[str, dict]:
    """Each task's score (`primary_score`) and per-item values from merged lm-eval results (`run_calls`);
    a group's with its sub-tasks' values and items (`eval_groups`)."""
    scores, task_dir = {}, resolve(params.task_dir)
    for name, order in metric_orders.items():
        chosen = params.settings(name)
        results, higher = out["results"].get(name), out["higher_is_better"].get(name, {})
        group_leaves = None
        if results is None or out.get("group_subtasks", {}).get(name):  # a group (raced: its leaves ran)
            group_leaves = _leaves(name, task_dir)
        if results is None and group_leaves:
            results, higher = eval_groups.aggregate(name, eval_groups.index_for(name, task_dir), out["results"],
                                                    out["higher_is_better"])
        score = primary_score(name, results or {}, higher, order, chosen.metric, chosen.filter)
        if group_leaves:
            key = f"{score['metric']},{score['filter']}"
            ran = [leaf for leaf in group_leaves if key in out["results"].get(leaf, {})]
            score["subtasks"] = {leaf: float(out["results"][leaf][key]) for leaf in ran}
            per_leaf = {leaf: task_items(out["samples"].get(leaf, []), score["metric"], score["subtasks"][leaf],
                                         score["filter"]) for leaf in ran}
            score["items"] = eval_groups.group_items(per_leaf, group_leaves, score["value"])
        else:
            score["items"] = task_items(out["samples"].get(name, []), score["metric"], score["value"], score["filter"])
        scores[name] = score
    return scores


def lm_eval_scores(model, tokenizer, params: EvalParams, eval_dir: Path,
                   items: dict[str, list[int]] | None = None) -> dict[str, dict]:
    """Every task of `params.tasks` scored through lm-eval's `hf` model on `model` in memory (with
    `items`, racing: see `eval_calls`)."""
    from lm_eval.models.huggingface import HFLM

    from qad_pipeline.scoring.lm_eval_calls import run_calls
    from qad_pipeline.core.modeling import input_device

    calls, metric_orders = eval_calls(params, eval_dir, items)
    # lm-eval takes the model where it is (a spread model's inputs go to its first device)
    lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=params.batch_size, device=str(input_device(model)))
    task_dir = resolve(params.task_dir)  # one task index for the calls and the reading of groups
    registry = eval_groups.task_manager(str(task_dir),
                                        any(not (task_dir / f"{n}.yaml").is_file() for n in metric_orders))
    return read_scores(params, run_calls(lm, calls, registry), metric_orders)


def _by_settings(params: EvalParams) -> dict[tuple, list[str]]:
    """The tasks grouped by the settings of one `simple_evaluate` call (few-shot, chat template,
    multi-turn, generation, limit), in `eval.tasks` order."""
    groups: dict[tuple, list[str]] = {}
    for name in params.tasks:
        s = params.settings(name)
        gen = tuple(sorted(s.gen_kwargs.items())) if s.gen_kwargs else None
        key = (s.num_fewshot, s.apply_chat_template, s.fewshot_as_multiturn, gen, s.limit or params.limit)
        groups.setdefault(key, []).append(name)
    return groups


def item_value(metric: str, value) -> float | None:
    """One item's value of `metric` as a number whose mean over items is the task's score.

    lm-eval logs most metrics per item as numbers; the Brier score as (gold index, choice
    probabilities), which its aggregation turns into the mean squared distance to the one-hot.
    """
    if isinstance(value, bool) or isinstance(value, (int, float)):
        return float(value)
    if metric == "brier_score" and isinstance(value, (tuple, list)) and len(value) == 2:
        gold, probs = value
        return float(sum((p - (i == gold)) ** 2 for i, p in enumerate(probs)))
    return None


def task_items(samples: list[dict], metric: str, score: float, filter_name: str | None = None) -> dict | None:
    """The task's per-item values of `metric` under `filter_name` (lm-eval's logged samples, by doc
    id), with how they aggregate into `score`; None when they do not (a corpus-level metric such
    as BLEU)."""
    from qad_pipeline.scoring.recovery import item_aggregation

    by_filter: dict[str, list] = {}
    for sample in samples:
        if filter_name is not None and sample.get("filter", "none") != filter_name:
            continue
        value = item_value(metric, sample.get(metric))
        if value is not None:
            by_filter.setdefault(sample.get("filter", "none"), []).append((sample["doc_id"], value))
    for pairs in by_filter.values():
        pairs.sort()
        values = [v for _, v in pairs]
        aggregation = item_aggregation(values, score)
        if aggregation:
            return {"aggregation": aggregation, "ids": [d for d, _ in pairs], "values": values}
    return None


def perplexity_task(perplexity: float, window_nll: list[float], ids: list[int], positions: int) -> dict:
    """The held-out perplexity as a task (lower is better), with each window's mean log-likelihood
    per position as its items."""
    return {"metric": "perplexity", "value": perplexity, "higher_is_better": False,
            "items": {"aggregation": "perplexity", "ids": ids, "values": [-n / positions for n in window_nll]}}


def pop_items(tasks: dict[str, dict]) -> dict[str, dict]:
    """Each task's per-item values, taken out of its score (callers store them apart)."""
    items = {task: score.pop("items") for task, score in tasks.items() if score.get("items")}
    for score in tasks.values():
        score.pop("items", None)
    return items


def evaluate_model(
    model, tokenizer, params: EvalParams, data_dir: Path, reference: Path | None = None,
    write_reference: Path | None = None, items: dict[str, list[int]] | None = None,
) -> dict:
    """Scores of one model: lm-eval tasks + perplexity (+ KL to the BF16 reference in `reference`).

    `write_reference` (the baseline only) is where this model's own top-k reference is written, in
    the same pass over the held-out windows (`qad_pipeline.scoring.reference`). `items` holds each task's
    per-item values (for the recovery's confidence interval); callers store it apart from the scores.

    `items` (racing, `qad_pipeline.scoring.racing`): the ids to score per task (lm-eval doc ids; "perplexity":
    window indices); a task it names with no ids is not scored, one it does not name is scored in
    full. KL then covers the scored windows only.

    A fake-quantized model's weights are fake-quantized once for the whole evaluation, not in
    every forward (`qad_pipeline.nvfp4.weight_folding`: the same logits, bit for bit; the model comes
    out as it went in).
    """
    from qad_pipeline.nvfp4.weight_folding import folded_weights

    with folded_weights(model) as folding:
        if folding.folded or folding.left:
            print(f"eval: {folding.summary()}", flush=True)
        return _evaluate(model, tokenizer, params, data_dir, reference, write_reference, items)


def _evaluate(model, tokenizer, params: EvalParams, data_dir: Path, reference: Path | None,
              write_reference: Path | None, items: dict[str, list[int]] | None) -> dict:
    """`evaluate_model`'s passes over the model as it is."""
    from qad_pipeline.scoring.reference import Reference, ReferenceWriter, score_windows, windows_fingerprint

    windows = torch.from_numpy(load_ppl_windows(data_dir))
    ref = Reference(reference) if reference is not None else None
    if ref is not None:
        ref.check_windows(windows)
    rows = sorted(items["perplexity"]) if items is not None and "perplexity" in items else list(range(len(windows)))
    writer = None
    if write_reference is not None:
        writer = ReferenceWriter(write_reference, len(windows), windows.shape[1] - 1, model.config.vocab_size,
                                 params.kl_top_k, params.kl_tail_samples)
    streamed = None
    if len(rows) == len(windows):  # every window, as without racing
        streamed = score_windows(model, windows, params.batch_size, reference=ref, writer=writer)
    elif rows:
        streamed = score_windows(model, windows[rows], params.batch_size, reference=ref, rows=rows)
    written = None
    if writer is not None:
        written = writer.close({"windows": len(windows), "positions": windows.shape[1] - 1,
                                "windows_fingerprint": windows_fingerprint(windows),
                                "vocab_size": model.config.vocab_size})
    tasks = lm_eval_scores(model, tokenizer, params, Path(data_dir) / "eval", items)
    if streamed is not None:
        tasks["perplexity"] = perplexity_task(streamed["perplexity"], streamed["window_nll"], rows,
                                              windows.shape[1] - 1)
    result = {"tasks": tasks, "items": pop_items(tasks)}
    if ref is not None and streamed is not None:
        result["kl_divergence"] = streamed["kl_divergence"]
        result["kl_estimator"] = (f"exact over the top {ref.manifest['k']} tokens + "
                                  f"{ref.manifest['tail_samples']} tail samples per position")
    if written is not None:
        result["reference"] = {key: written[key] for key in ("k", "tail_samples", "fingerprint")}
    return result


