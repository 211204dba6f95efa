"""What selection writes: metrics/ptq/<r>.json (scores and recovery), metrics/selection.json and
metrics/recovery.json."""

from __future__ import annotations

from dataclasses import field
from typing import Annotated, Any, Literal, Union

from pydantic import ConfigDict, Field, RootModel
from pydantic.dataclasses import dataclass

from qad_pipeline.results.base import Strict
from qad_pipeline.results.scores import PTQScores


class RecipeMetrics(PTQScores):  # metrics/ptq/<r>.json (tasks/selection.py): the scores and their recovery
    median_recovery: float
    median_recovery_ci: tuple[float, float]
    recovery_interval: str


class RecipeFailed(Strict):
    recipe: str
    status: Literal["failed"]
    error: str


class RecipeAlias(Strict):
    recipe: str
    status: Literal["alias"]
    alias_of: str


RecipeResult = Annotated[Union[RecipeMetrics, RecipeFailed, RecipeAlias], Field(discriminator="status")]


@dataclass(frozen=True, config=ConfigDict(extra="forbid"))
class RecipeRow:
    """One recipe as selection weighs it (tasks/selection.py) and as metrics/selection.json holds it."""

    name: str
    status: Literal["ok", "failed", "alias"]
    median_recovery: float | None = None
    effective_bpe: float | None = None
    kv_cache: str = "none"
    error: str | None = None
    median_recovery_ci: tuple[float, float] | None = None
    alias_of: str | None = None
    kl_divergence: float | None = None
    weight_error_median: float | None = None
    # the recipe's RecipeSettings and its effective_bpe: the recipe axis of MLflow's compare view
    settings: dict[str, Any] = field(default_factory=dict)


class Racing(Strict):  # with race.enabled: what racing the candidates spent (metrics/race.json has the rest)
    items_spent: int  # eval items scored by all candidates together
    items_full: int  # what a full evaluation of each would have scored
    saved: float  # 1 - items_spent / items_full
    fractions: list[float]
    confidence: float
    stopped: dict[str, str]  # candidate -> where it stopped and why (not candidates of this selection)


class SelectionResult(Strict):  # metrics/selection.json (tasks/selection.py): the verdict and its table
    selected: str | None
    policy: str
    band: tuple[float, float]
    reason: str
    table: list[RecipeRow]
    runner_up: str | None
    could_compress_further: bool
    racing: Racing | None = None  # only with race.enabled


class RecoveryPoint(Strict):
    recipe: str
    effective_bpe: float
    median_recovery: float
    ci_low: float | None
    ci_high: float | None


class RecoveryTable(RootModel[list[RecoveryPoint]]):
    """metrics/recovery.json, DVC's recovery plot: one point per recipe that ran."""
