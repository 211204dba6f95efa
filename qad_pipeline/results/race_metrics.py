"""What the race stage writes: metrics/race.json (tasks/race.py), and each candidate's merged
scores and items under artifacts/race/<candidate>/ (a PTQ recipe's `PTQScores`, `items.json`)."""

from __future__ import annotations

from typing import Literal

from qad_pipeline.results.base import Strict


class RaceStop(Strict):  # qad_pipeline/scoring/racing.py: Stop
    round: int  # the round after which it stopped (1-based)
    items: int  # the items it had been scored on
    why: Literal["below_floor", "beaten"]
    by: str | None  # the candidate that beat it
    text: str


class RaceCandidate(Strict):
    name: str
    items: int  # items it was scored on, over all rounds (round 1 in its PTQ stage)
    reused: int  # of those, items a killed race had already scored (read back, not scored again)
    stopped: RaceStop | None


class RaceResult(Strict):  # metrics/race.json
    fractions: list[float]  # race.fractions: the share of each task's items scored by the end of each round
    confidence: float
    tail: float  # each stop test's one-sided error
    floor: float  # selection's floor (the band's low end with policy qad, ptq_final_min with ptq_final)
    rounds: list[dict[str, int]]  # each round's items per task (cumulative)
    candidates: list[RaceCandidate]
    items_spent: int  # items scored by all candidates together
    items_full: int  # what a full evaluation of each would have scored
    saved: float  # 1 - items_spent / items_full
