"""Task groups in `eval.tasks` (lm-eval's `mmlu`, or a group YAML in `eval.task_dir`).

A group's score is lm-eval's own aggregate, read from its results under the group's name like any
task's. Its sub-tasks are its leaves: the tasks under it through nested groups and tags, sorted by
name (`leaves`, from lm-eval's task index, so without running or downloading anything). The score
records each leaf's value (`subtasks`) and, from the leaves' logged samples, per-item values
(`group_items`) whose ids are unique within the group:

    item id = ITEM_STRIDE * (the leaf's index in the sorted leaves) + the doc id within the leaf

(`split_ids` decodes them). They are kept only when they reproduce lm-eval's aggregate
(`recovery.item_aggregation`): a size-weighted mean (MMLU's, at every level) does; a macro mean over
leaves of different sizes does not, and such a group has no items: one number, no interval, not raced.

Racing a group (`raced_group`): lm-eval runs the leaves that have ids, by name, with `samples` keyed
by them, so only the docs asked for are scored; `aggregate` then aggregates them as lm-eval
aggregates the group (its `aggregate_metric_list`, lm-eval's `aggregate_subtask_metrics`). (An
inline group config of lm-eval 0.4.13 hands its own keys down to its tasks, so it cannot be used.)

The project reads groups whose members are named (tasks, groups, tags) and that set no task settings
for them; a group of another shape is scored as one number, and `leaves` says why in one line.
A group YAML in `eval.task_dir` lists tasks of `eval.task_dir` (found there through lm-eval's
`include_path`); their `data_files` are read as written (a relative path from the working
directory, the project root).
"""

from __future__ import annotations

import functools
from pathlib import Path

import yaml

ITEM_STRIDE = 1_000_000  # a leaf's doc ids must stay below it


class GroupShapeError(ValueError):
    """A group whose leaves the project cannot name (its message is the one-line reason)."""


def is_project_group(name: str, task_dir: Path) -> bool:
    """`eval.task_dir/<name>.yaml` exists and defines a group."""
    path = task_dir / f"{name}.yaml"
    return path.is_file() and "group" in (yaml.safe_load(path.read_text()) or {})


@functools.lru_cache(maxsize=4)
def task_manager(task_dir: str, defaults: bool):
    """lm-eval's TaskManager over `task_dir` (and its own registry with `defaults`: ~9 s to index),
    built once per process and shared by the checks, the calls and the reading of scores."""
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=task_dir, include_defaults=defaults)


def index_for(name: str, task_dir: Path) -> dict:
    """The task index that knows `name`: `task_dir`'s alone for a project group, else lm-eval's too."""
    return task_manager(str(task_dir), not (task_dir / f"{name}.yaml").is_file()).task_index


def leaves(name: str, index: dict) -> list[str] | None:
    """The sorted leaf tasks of group `name` (None: `name` is no group); GroupShapeError for a
    group whose members are not all named tasks, groups or tags, or that sets their settings."""
    from dataclasses import fields

    from lm_eval.api.group import GroupConfig
    from lm_eval.tasks._index import Kind

    entry = index.get(name)
    if entry is None or entry.kind is not Kind.GROUP:
        return None
    group_keys = {f.name for f in fields(GroupConfig)}
    found: set[str] = set()

    def walk(group: str, path: tuple[str, ...]) -> None:
        cfg = index[group].cfg or {}
        settings = sorted(set(cfg) - group_keys)
        if settings:
            raise GroupShapeError(f"eval task group {name!r}: group {group!r} sets {settings} for its members; "
                                  "the project reads groups whose members keep their own settings")
        for member in cfg.get("task") or []:
            member_entry = index.get(member) if isinstance(member, str) else None
            if member_entry is None:
                raise GroupShapeError(f"eval task group {name!r}: member {member!r} of {group!r} is not a task, "
                                      "group or tag that lm-eval knows by name here (inline definitions are not read)")
            if member_entry.kind is Kind.GROUP:
                if member in path:
                    raise GroupShapeError(f"eval task group {name!r}: {member!r} contains itself ({' > '.join(path)})")
                walk(member, (*path, member))
            elif member_entry.kind is Kind.TAG:
                found.update(member_entry.tags)
            else:
                found.add(member)

    walk(name, (name,))
    return sorted(found)


def split_ids(ids: list[int], names: list[str]) -> dict[str, list[int]]:
    """Group item ids -> each leaf's sorted doc ids (leaves with none left out)."""
    out: dict[str, list[int]] = {}
    for i in sorted(ids):
        leaf, doc = divmod(i, ITEM_STRIDE)
        if not 0 <= leaf < len(names):
            raise ValueError(f"item id {i} names leaf {leaf}, but the group has {len(names)} leaves")
        out.setdefault(names[leaf], []).append(doc)
    return out


def group_items(per_leaf: dict[str, dict | None], names: list[str], score: float) -> dict | None:
    """The group's items from its leaves' (`evaluation.task_items`, per leaf that ran), ids as in the
    module docstring; None when a leaf that ran has none, or they do not reproduce `score`."""
    from qad_pipeline.scoring.recovery import item_aggregation

    ids, values = [], []
    for position, leaf in enumerate(names):
        if leaf not in per_leaf:
            continue  # raced: not asked for in this run
        held = per_leaf[leaf]
        if held is None or any(d >= ITEM_STRIDE for d in held["ids"]):
            return None
        ids += [position * ITEM_STRIDE + d for d in held["ids"]]
        values += held["values"]
    aggregation = item_aggregation(values, score)
    return {"aggregation": aggregation, "ids": ids, "values": values} if aggregation else None


def raced_group(ids: list[int], names: list[str]) -> tuple[list[str], dict[str, list[int]]]:
    """(the leaves to run, lm-eval's `samples` for them) that score exactly the group items `ids`."""
    docs = split_ids(ids, names)
    return sorted(docs), docs


def aggregate(name: str, index: dict, results: dict, higher: dict) -> tuple[dict, dict]:
    """A raced group's results and higher-is-better, from its leaves that ran, as lm-eval aggregates a
    group (`Group.aggregate`: over every leaf under it, by each `aggregate_metric_list` entry, with
    lm-eval's `aggregate_subtask_metrics`, weighted by the docs scored when `weight_by_size`)."""
    from lm_eval.api.metrics import aggregate_subtask_metrics
    from lm_eval.config.group import AggMetricConfig

    ran = [leaf for leaf in leaves(name, index) or [] if leaf in results]
    out, better = {}, {}
    for entry in index[name].cfg.get("aggregate_metric_list") or []:
        agg = AggMetricConfig(**entry)  # lm-eval's defaults (weight_by_size: true; filters: those reported)
        filters = agg.filter_list or sorted({k.split(",", 1)[1] for leaf in ran for k in results[leaf]
                                             if "," in k and k.split(",", 1)[0] == agg.metric})
        for filter_name in filters:
            key = f"{agg.metric},{filter_name}"
            have = [leaf for leaf in ran if key in results[leaf]]
            if have:
                out[key] = aggregate_subtask_metrics([results[leaf][key] for leaf in have],
                                                     [results[leaf].get("sample_len", 0) for leaf in have],
                                                     agg.weight_by_size)
                better[agg.metric] = higher.get(have[0], {}).get(agg.metric, True)
    return out, better
