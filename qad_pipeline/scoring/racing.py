"""Racing the candidates' evaluation: which candidate stops after which round, and why (pure).

Every candidate (a PTQ recipe, a sweep point) is scored on round 1's items, then only those
selection could still choose go on to the next round's items; the rest finish every item. A round
is a nested slice of each task's items (`round_ids`: a seeded permutation of the baseline's item
ids per task, cut at `race.fractions`), so a later round only adds items and no item is scored twice.

After each round but the last, `decide` reads each candidate's median-recovery bootstrap
(`recovery.median_draws`, the same paired bootstrap selection reports; every candidate is
restricted to the round's items, so the draws of any two are paired) and stops a candidate when:

* **below the floor**: the upper end of its interval lies below selection's floor. The floor is
  the one selection's eligibility uses (`tasks/selection.py: select_recipe`): the band's low end
  with policy `qad`, `ptq_final_min` with `ptq_final`. A candidate confidently below it is never
  eligible. The band's upper end only adds a note to a pick ("could compress further") and never
  excludes one, so it stops nothing.
* **beaten**: another candidate that selection ranks first whenever both are eligible (no more
  bits, then no larger KV cache: selection's `compression` order) beats it beyond the intervals,
  either by recovering more (the lower end of the paired difference above 0: if this one were
  eligible the other would be too, and it ranks first), or, being strictly more compressed, by
  lying confidently at or above the floor (eligible, so it is chosen first whatever this one
  recovers: under selection's policy compression decides among eligible candidates).

Each test is one-sided at `tail = (1 - confidence) / 2 / (rounds - 1)`: one end of a two-sided
`confidence` interval, Bonferroni-split over the looks. With one look (two rounds) and confidence
0.95 it is the end of selection's own 95 % interval. The chance that racing stops the candidate a
full evaluation would choose is what `tests/test_racing.py` measures on random tables (stated:
at most 1 - confidence). A round's slice is a subset of the very items the full evaluation scores,
so the bootstrap, which treats the items as drawn from an unbounded pool, overstates how far the
slice can stray from the full set: the tests are conservative.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from qad_pipeline.scoring.recovery import aggregate, median_draws, median_recovery, recoveries


@dataclass
class Contender:
    """A candidate as the race sees it: its compression (selection's order: effective bits per
    element, KV-cache bits), its recorded scores (`{"tasks": {...}}`, for tasks without per-item
    values) and the per-item values it holds so far (`items`: task -> aggregation, ids, values)."""

    name: str
    compression: tuple[float, float]
    scores: dict
    items: dict


@dataclass(frozen=True)
class Stop:
    round: int  # 1-based: the round after which it stopped
    items: int  # the items it had been scored on
    why: str  # "below_floor" | "beaten"
    by: str | None
    text: str


@dataclass
class RaceOutcome:
    stops: dict[str, Stop] = field(default_factory=dict)
    items: dict[str, dict] = field(default_factory=dict)  # each candidate's items at the end
    spent: dict[str, int] = field(default_factory=dict)  # items each candidate was scored on
    full: int = 0  # items of a full evaluation of one candidate
    by_round: list[list[str]] = field(default_factory=list)  # who was scored in each round


def tail(confidence: float, rounds: int) -> float:
    """Each stop test's one-sided error: `(1 - confidence) / 2`, split over the looks (rounds - 1)."""
    return (1 - confidence) / 2 / max(1, rounds - 1)


def round_ids(baseline_items: dict, fractions: list[float], seed: int) -> list[dict[str, list[int]]]:
    """For each round, the item ids of each task scored by its end (sorted; nested across rounds):
    the first ceil(fraction * n) of a permutation seeded by `seed` and the task's name, at least two
    (a bootstrap needs two) and at most n."""
    rounds = [{} for _ in fractions]
    for task, items in baseline_items.items():
        ids = list(items["ids"])
        order = np.random.default_rng([seed, zlib.crc32(task.encode())]).permutation(len(ids))
        for r, fraction in enumerate(fractions):
            rounds[r][task] = sorted(ids[i] for i in order[:slice_size(len(ids), fraction)])
    return rounds


def slice_size(n: int, fraction: float) -> int:
    """How many of a task's `n` items a round at `fraction` scores: ceil(fraction * n), at least two
    (a bootstrap needs two), at most n (the plan's racing budget counts with it too)."""
    return min(n, max(2, int(np.ceil(fraction * n - 1e-9))))


def restrict(items: dict, ids: dict[str, list[int]]) -> dict:
    """`items` cut to `ids` (a task `ids` does not name is left out)."""
    out = {}
    for task, keep in ids.items():
        if task not in items:
            continue
        wanted, have = set(keep), items[task]
        pairs = [(i, v) for i, v in zip(have["ids"], have["values"]) if i in wanted]
        out[task] = {"aggregation": have["aggregation"], "ids": [i for i, _ in pairs], "values": [v for _, v in pairs]}
    return out


def merge(a: dict, b: dict) -> dict:
    """The union of two models' item tables for one model, by task, sorted by id (`b` wins a clash)."""
    out = {}
    for task in {**a, **b}:
        pairs = dict(zip(a.get(task, {}).get("ids", []), a.get(task, {}).get("values", [])))
        pairs.update(zip(b.get(task, {}).get("ids", []), b.get(task, {}).get("values", [])))
        aggregation = (b.get(task) or a.get(task))["aggregation"]
        ordered = sorted(pairs.items())
        out[task] = {"aggregation": aggregation, "ids": [i for i, _ in ordered], "values": [v for _, v in ordered]}
    return out


def missing(items: dict, ids: dict[str, list[int]]) -> dict[str, list[int]]:
    """The ids of `ids` that `items` does not hold yet, per task (tasks with none left out)."""
    out = {}
    for task, wanted in ids.items():
        have = set(items.get(task, {}).get("ids", []))
        rest = [i for i in wanted if i not in have]
        if rest:
            out[task] = rest
    return out


def count(ids_or_items: dict) -> int:
    return sum(len(v["ids"]) if isinstance(v, dict) else len(v) for v in ids_or_items.values())


def on_items(scores: dict, items: dict) -> dict:
    """`scores` with each task that has per-item values scored on exactly those items."""
    tasks = {name: dict(score) for name, score in scores["tasks"].items()}
    for task, held in items.items():
        if task in tasks and held["values"]:
            tasks[task]["value"] = float(aggregate(np.asarray(held["values"], np.float64), held["aggregation"]))
    return {**scores, "tasks": tasks}


def _draws(c: Contender, ids: dict, baseline: dict, baseline_items: dict) -> tuple[float, np.ndarray]:
    """(median recovery, its bootstrap resamples) on the round's items `ids`."""
    items, base_items = restrict(c.items, ids), restrict(baseline_items, ids)
    scores, base = on_items(c.scores, items), on_items(baseline, base_items)
    point = median_recovery(recoveries(scores["tasks"], base["tasks"]))
    return point, median_draws(scores, items, base, base_items)


def _pct(x: float) -> str:
    return f"{100 * x:.2f} %"


def decide(contenders: list[Contender], ids: dict[str, list[int]], baseline: dict, baseline_items: dict,
           floor: float, alpha: float, round_no: int) -> dict[str, Stop]:
    """Which of `contenders` (each holding at least the items `ids`) stop after round `round_no`."""
    draws = {c.name: _draws(c, ids, baseline, baseline_items) for c in contenders}
    n = count(ids)
    where = f"after round {round_no} ({n} items)"
    stops: dict[str, Stop] = {}
    for c in contenders:
        point, own = draws[c.name]
        low, high = np.percentile(own, [100 * alpha, 100 * (1 - alpha)])
        if high < floor:
            stops[c.name] = Stop(round_no, n, "below_floor", None,
                                 f"{c.name} stopped {where}: median recovery {_pct(point)}, the upper end of its "
                                 f"{_pct(1 - alpha)} one-sided bound {_pct(high)} lies below the floor of {_pct(floor)}")
            continue
        for o in sorted(contenders, key=lambda o: (o.compression, o.name)):
            if o.name == c.name or o.compression > c.compression:
                continue
            o_point, o_draws = draws[o.name]
            gain_low = float(np.percentile(o_draws - own, 100 * alpha))
            o_low = float(np.percentile(o_draws, 100 * alpha))
            if gain_low > 0:
                text = (f"{c.name} stopped {where}: {o.name}, with no more bits, recovers more beyond the intervals "
                        f"({_pct(o_point)} vs {_pct(point)}; the lower end of the paired difference is "
                        f"{100 * gain_low:.2f} points)")
            elif o.compression < c.compression and o_low >= floor:
                text = (f"{c.name} stopped {where}: {o.name} is more compressed and confidently at or above the "
                        f"floor of {_pct(floor)} (median recovery {_pct(o_point)}, lower bound {_pct(o_low)}), "
                        "so selection chooses it first")
            else:
                continue
            stops[c.name] = Stop(round_no, n, "beaten", o.name, text)
            break
    return stops


def run_race(contenders: list[Contender], baseline: dict, baseline_items: dict, rounds: list[dict[str, list[int]]],
             floor: float, confidence: float, score: Callable[[Contender, dict[str, list[int]], int], dict]) -> RaceOutcome:
    """The race: round by round, `score(contender, ids, round)` returns the contender's items on the ids it
    lacks (the stage: from its checkpoint, or from what a killed run stored; the replay test: a
    table's full results); after each round but the last, `decide` stops who cannot be selected."""
    alpha = tail(confidence, len(rounds))
    outcome = RaceOutcome(full=count(rounds[-1]))
    alive = list(contenders)
    for r, ids in enumerate(rounds, start=1):
        scored = []
        for c in alive:
            lacking = missing(c.items, ids)
            if lacking:
                c.items = merge(c.items, score(c, lacking, r))
                scored.append(c.name)
        outcome.by_round.append(scored)
        if r < len(rounds):
            stops = decide(alive, ids, baseline, baseline_items, floor, alpha, r)
            outcome.stops.update(stops)
            alive = [c for c in alive if c.name not in stops]
    for c in contenders:
        outcome.items[c.name] = c.items
        outcome.spent[c.name] = count(restrict(c.items, rounds[-1]))
    return outcome
