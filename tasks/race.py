"""Racing the recipes: `qad-pipeline stage race` (in a run with `race.enabled`).

Each PTQ recipe has scored round 1's items (`tasks/ptq.py: first_round`); the sweep's points, if
they compete, scored every item. Round by round, this stage stops the candidates selection could
no longer choose (`qad_pipeline.scoring.racing.decide`: median-recovery interval below selection's floor,
or beaten beyond the intervals by a candidate with no more bits) and scores the others on the
next round's items: it loads each contender's saved checkpoint, one model at a time, and scores
only the items it lacks (`evaluate_model` with lm-eval's `samples`; perplexity windows and KL by
index). KL to the BF16 reference is raced with the perplexity windows it shares a forward pass
with: a finisher's KL covers every window, a stopped candidate's the windows it was scored on.

Writes, per candidate, `artifacts/race/<candidate>/`: `round<k>.json` (the items round k added,
with a key of the checkpoint's scores, the eval settings and the ids: a killed race run again reads
them back instead of scoring them again), and `scores.json` + `items.json` merged over the rounds
(what selection reads, as it reads a PTQ folder); and `metrics/race.json` (`RaceResult`: who
stopped where and why, items spent against a full evaluation's).
"""

from __future__ import annotations

import hashlib
import json
import shutil

from qad_pipeline.scoring import racing
from qad_pipeline.core.artifacts import read_json, write_json
from qad_pipeline.core.config import Params
from qad_pipeline.core.layout import Layout
from qad_pipeline.results.base import dump_result, read_result, write_result
from qad_pipeline.results.race_metrics import RaceCandidate, RaceResult, RaceStop
from qad_pipeline.results.scores import BaselineMetrics, PTQResult, PTQScores
from tasks.selection import KV_BITS, sweep_candidates


def floor(params: Params) -> float:
    """Selection's floor (`tasks/selection.py: select_recipe`): a recipe below it is never eligible."""
    s = params.selection
    return s.ptq_final_min if s.policy == "ptq_final" else s.band[0]


def contenders(params: Params, layout: Layout) -> list[racing.Contender]:
    """The candidates that ran (a failed or alias recipe is not one), as their PTQ stage left them."""
    out = []
    for name in [*params.ptq.recipes, *sweep_candidates(params, layout)]:
        folder = layout.candidate(name)
        scores = read_result(folder / "scores.json", PTQResult, missing_ok=True)
        if scores is None or scores.status != "ok" or not (folder / "items.json").is_file():
            continue
        out.append(racing.Contender(name, (scores.effective_bpe, KV_BITS.get(scores.kv_cache, 16)),
                                    dump_result(scores), read_json(folder / "items.json")))
    return out


def store_key(params: Params, layout: Layout, name: str) -> str:
    """What a stored round's items were scored from: the candidate's PTQ outputs (its scores.json
    changes whenever its PTQ runs again), the base model and the eval settings."""
    digest = hashlib.sha256((layout.candidate(name) / "scores.json").read_bytes())
    digest.update(json.dumps([params.base_model.model_dump(), params.eval.model_dump()], sort_keys=True).encode())
    return digest.hexdigest()


class Scorer:
    """`run_race`'s `score`: a contender's items on the ids it lacks, read back from a killed run's
    store when its key and ids match, else scored from its checkpoint (and stored)."""

    def __init__(self, params: Params, layout: Layout):
        self.params, self.layout = params, layout
        self.reused: dict[str, int] = {}
        self.kl: dict[str, list[tuple[float, int]]] = {}  # (KL, windows) of each scoring, round 1's first

    def __call__(self, c: racing.Contender, ids: dict[str, list[int]], round_no: int) -> dict:
        path = self.layout.race(c.name) / f"round{round_no}.json"
        key = store_key(self.params, self.layout, c.name)
        stored = read_json(path) if path.is_file() else None
        if stored is not None and stored["key"] == key and stored["ids"] == ids:
            self.reused[c.name] = self.reused.get(c.name, 0) + racing.count(ids)
            print(f"race: {c.name} round {round_no}: {racing.count(ids)} items read back from {path}", flush=True)
        else:
            stored = {"key": key, "ids": ids, **self._score(c.name, ids)}
            write_json(path, stored)
        if stored.get("kl") is not None:
            self.kl.setdefault(c.name, []).append((stored["kl"], len(ids.get("perplexity", []))))
        return stored["items"]

    def _score(self, name: str, ids: dict[str, list[int]]) -> dict:
        import gc

        from qad_pipeline.scoring.evaluation import evaluate_model
        from qad_pipeline.core.modeling import load_model, load_tokenizer

        p, layout = self.params, self.layout
        print(f"race: scoring {name} on {racing.count(ids)} more items", flush=True)
        model = load_model(p.base_model, p.hardware, folder=layout.candidate(name) / "checkpoint")
        # a task without per-item values was scored in full in round 1: [] keeps it from being scored again
        wanted = {task: ids.get(task, []) for task in [*p.eval.tasks, "perplexity"]}
        scores = evaluate_model(model, load_tokenizer(p.base_model), p.eval, layout.data, layout.reference,
                                items=wanted)
        del model
        gc.collect()
        return {"items": scores["items"], "kl": scores.get("kl_divergence")}


def merged_scores(c: racing.Contender, kl: list[tuple[float, int]]) -> PTQScores:
    """The contender's PTQ scores with each raced task scored on every item it holds and KL over
    every window it was scored on (windows have the same positions: a window-weighted mean)."""
    scores = racing.on_items(c.scores, c.items)
    for task in c.items:  # lm-eval's other metrics (a group's sub-tasks) of a raced task covered round 1's items only
        scores["tasks"].get(task, {}).pop("all", None)
        scores["tasks"].get(task, {}).pop("subtasks", None)
    if kl:
        scores["kl_divergence"] = sum(k * n for k, n in kl) / max(1, sum(n for _, n in kl))
    return PTQScores.model_validate(scores)


def run_race(params: Params, layout: Layout) -> RaceResult:
    """Stage core: race the candidates; write their merged scores and metrics/race.json."""
    baseline_items = read_json(layout.items("baseline"))
    baseline = dump_result(read_result(layout.baseline_metrics, BaselineMetrics))
    rounds = racing.round_ids(baseline_items, params.race.fractions, params.race.seed)
    field = contenders(params, layout)
    scorer = Scorer(params, layout)
    for c in field:  # round 1's KL: what the PTQ stage measured, over the windows it scored
        windows = len(c.items.get("perplexity", {}).get("ids", []))
        if c.scores.get("kl_divergence") is not None:
            scorer.kl[c.name] = [(c.scores["kl_divergence"], windows)]
    for stale in (layout.root / "artifacts" / "race").glob("*"):
        if stale.is_dir() and stale.name not in {c.name for c in field}:
            shutil.rmtree(stale)
    outcome = racing.run_race(field, baseline, baseline_items, rounds, floor(params), params.race.confidence, scorer)
    candidates = []
    for c in field:
        folder = layout.race(c.name)
        write_result(folder / "scores.json", merged_scores(c, scorer.kl.get(c.name, [])))
        write_json(folder / "items.json", c.items)
        stop = outcome.stops.get(c.name)
        candidates.append(RaceCandidate(name=c.name, items=outcome.spent[c.name], reused=scorer.reused.get(c.name, 0),
                                        stopped=RaceStop(**stop.__dict__) if stop else None))
    spent, full = sum(outcome.spent.values()), outcome.full * len(field)
    result = RaceResult(fractions=params.race.fractions, confidence=params.race.confidence,
                        tail=racing.tail(params.race.confidence, len(rounds)), floor=floor(params),
                        rounds=[{task: len(ids) for task, ids in r.items()} for r in rounds],
                        candidates=candidates, items_spent=spent, items_full=full,
                        saved=1 - spent / full if full else 0.0)
    write_result(layout.race_metrics, result)
    return result


def main(params: Params, layout: Layout, recipe: str | None = None) -> str:
    """Race the candidates: `qad-pipeline stage race`."""
    r = run_race(params, layout)
    stopped = sum(c.stopped is not None for c in r.candidates)
    return (f"race: {stopped} of {len(r.candidates)} candidates stopped early; {r.items_spent} of {r.items_full} "
            f"items scored ({100 * r.saved:.0f} % saved)")
