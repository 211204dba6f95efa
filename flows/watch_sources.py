"""What the watcher watches, and the parameters of the pipeline runs it starts for each source.

The `watch-base-checkpoints` flow's `sources` parameter is a list of places to watch, each with
the params file (a profile) and the overrides its runs get:

    sources:
      - watch_dir: checkpoints/llama          # each settled subfolder is a checkpoint
        params_file: profiles/llama-3.1-8b_8xh100.yaml
        overrides: ["qad.steps=200"]
      - hub_id: Qwen/Qwen3-30B-A3B-Base        # the id's newest revision is a checkpoint
        params_file: profiles/qwen3-30b-a3b_8xb200.yaml
        stage_deployment: gpu-stage/gpu-8       # its GPU stages on another pool (larger nodes)

`params_file` defaults to `params.yaml`, `overrides` to none; `recipe_deployment` and
`stage_deployment`, when set, replace the pipeline deployment's own (which pool its recipes and GPU
stages run on; the run's preflight checks that pool can give each stage its GPUs). A run started
for a checkpoint of a source gets

    params_file  the source's params file as an absolute path, resolved in the watcher's working
                 directory (like `base_model`, the folder's absolute path: the pipeline's workers
                 must see it at the same path, which they do for the image's own files, e.g.
                 /opt/qad-pipeline/profiles/..., and for files on the shared volume)
    overrides    the deployment's own default `overrides`, then the source's, then the watcher's:
                 `base_model.path=<folder or hub id>` and, for a hub id, `base_model.revision=<sha>`
                 (applied in order, so the watcher's win; a source may not set these two itself)
    base_model   null, so that a default `base_model` of the deployment cannot replace the watched one
    out_root     runs_root/<model slug>-<first 12 hex of the identity's hash>

    recipe_deployment, stage_deployment   the source's, when it sets them

The deployment's other defaults (`recipes`, `qad`, the deployments a source leaves unset, ...) apply
as they are.
Every source is checked (`check_sources`) before a tick looks for checkpoints, and every run's
own parameters (`check_run`) before the first run starts: the params file and overrides loaded
with `qad_pipeline.core.config.load_params` (the pipeline's own pydantic models) and its recipes found
(`check_recipes`). A bad value fails the tick with one line naming the source, and starts nothing.
"""

from __future__ import annotations

import json
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, model_validator

from qad_pipeline.core.config import ConfigError, load_params, parse_override
from qad_pipeline.plan.preflight import check_recipes
from qad_pipeline.core.stages import with_sweep

WATCHER_KEYS = ("base_model.path", "base_model.revision")  # what the watcher sets for each checkpoint


class WatchedSource(BaseModel):
    """One watched place (a folder of checkpoints or a hub id) and the configuration of its runs."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    watch_dir: str | None = None
    hub_id: str | None = None
    params_file: str = "params.yaml"
    overrides: list[str] = Field(default_factory=list)
    recipe_deployment: str | None = None  # e.g. ptq-recipe/gpu: where its runs' recipes run
    stage_deployment: str | None = None  # e.g. gpu-stage/gpu-4: where its runs' other GPU stages run

    @model_validator(mode="after")
    def _one_place(self) -> WatchedSource:
        if bool(self.watch_dir) == bool(self.hub_id):
            raise ValueError(f"a source watches exactly one of watch_dir and hub_id, got {self.label}")
        return self

    @property
    def label(self) -> str:
        """How errors and logs name the source: `watch_dir checkpoints` or `hub_id org/name`."""
        return " and ".join(f"{key} {value}" for key, value in (("watch_dir", self.watch_dir),
                                                                ("hub_id", self.hub_id)) if value) or "nothing"

    def params_path(self) -> str:
        """The params file as the runs get it: absolute, resolved in this (the watcher's) working directory."""
        return str(Path(self.params_file).expanduser().resolve())


def legacy_sources(watch_dir: str | None, hub_model_ids: list[str] | None) -> list[WatchedSource]:
    """The flow's older parameters as sources with params.yaml and no overrides."""
    return ([WatchedSource(watch_dir=watch_dir)] if watch_dir else []) + [
        WatchedSource(hub_id=model_id) for model_id in hub_model_ids or []]


def checkpoint_overrides(base_model: str, revision: str | None) -> list[str]:
    """The watcher's overrides for one checkpoint (values JSON-quoted: any folder name parses as a string)."""
    return [f"base_model.path={json.dumps(base_model)}"] + (
        [f"base_model.revision={json.dumps(revision)}"] if revision else [])


def run_parameters(source: WatchedSource, base_model: str, revision: str | None, deployment_overrides: list[str],
                   out_root: str) -> dict:
    """The parameters of the pipeline run for one checkpoint of `source` (module docstring)."""
    overrides = [*deployment_overrides, *source.overrides, *checkpoint_overrides(base_model, revision)]
    pools = {key: value for key in ("recipe_deployment", "stage_deployment") if (value := getattr(source, key))}
    return {"params_file": source.params_path(), "overrides": overrides, "base_model": None, "out_root": out_root,
            **pools}


def check_run(source: WatchedSource, parameters: dict) -> None:
    """Load the run's params file with its overrides, as the pipeline will, and find its recipes;
    a `ConfigError` names the source."""
    try:
        params = load_params(Path(parameters["params_file"]), parameters["overrides"])
        check_recipes(params, Path(parameters["params_file"]).parent, sweep=with_sweep(params))
    except ConfigError as err:
        raise ConfigError(f"source {source.label}: {err}") from None


def check_sources(sources: list[WatchedSource]) -> None:
    """Every source before anything is looked up: its folder exists, no two sources watch the same
    place, it sets no key the watcher sets, and its params file with its overrides validates."""
    places: dict[str, WatchedSource] = {}
    for source in sources:
        place = f"watch_dir {Path(source.watch_dir).resolve()}" if source.watch_dir else f"hub_id {source.hub_id}"
        if place in places:
            raise ConfigError(f"source {source.label}: given twice; a checkpoint starts one run, so each "
                              "folder or hub id is watched by one source")
        places[place] = source
        if source.watch_dir and not Path(source.watch_dir).is_dir():
            raise ConfigError(f"source {source.label}: watch_dir {source.watch_dir} is not a folder")
        for item in source.overrides:
            try:
                key = ".".join(parse_override(item)[0])
            except ConfigError as err:
                raise ConfigError(f"source {source.label}: {err}") from None
            if key in WATCHER_KEYS:
                raise ConfigError(f"source {source.label}: override {item!r} sets {key}, which the watcher sets "
                                  "for each checkpoint (the folder or hub id, and the hub revision)")
        stand_in = str(Path(source.watch_dir).absolute()) if source.watch_dir else source.hub_id
        check_run(source, run_parameters(source, stand_in, None, [], ""))
