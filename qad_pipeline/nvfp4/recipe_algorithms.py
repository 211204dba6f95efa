"""A recipe file's calibration algorithm, read from its YAML alone (no Model Optimizer, no torch): the
memory plan prices a recipe by it and the PTQ stage reports it, so neither pulls in the other."""

from __future__ import annotations

import functools
from pathlib import Path

import yaml


def recipe_algorithm(recipe_path: Path) -> dict:
    """The recipe's calibration algorithm as a dict (`max` -> {"method": "max"}), read from its file
    (once per version of the file: the plan asks for it several times per recipe)."""
    return dict(_algorithm(str(recipe_path), recipe_path.stat().st_mtime_ns))


@functools.lru_cache(maxsize=64)
def _algorithm(path: str, _version: int) -> dict:
    algorithm = (yaml.safe_load(Path(path).read_text()).get("quantize") or {}).get("algorithm")
    return dict(algorithm) if isinstance(algorithm, dict) else {"method": algorithm or "max"}


def weight_scale_algorithm(recipe_path: Path) -> dict:
    """The algorithm that sets the weight scales: activation headroom delegates them to its
    `weight_scale_algorithm` (max unless given); GPTQ sets them by max, then rounds against them."""
    algorithm = recipe_algorithm(recipe_path)
    if algorithm["method"] == "nvfp4_act_headroom":
        return dict(algorithm.get("weight_scale_algorithm") or {"method": "max"})
    return algorithm
