"""Which GPUs each stage process gets: its own, through `CUDA_VISIBLE_DEVICES`.

A stage process sees only the GPUs it claims, so `device_map: single` (the process's GPU 0) is a
GPU of its own, and `device_map: auto` spreads a model over exactly the GPUs it was given:

- a PTQ recipe or a sweep budget: `ptq.gpus_per_recipe` GPUs (`auto`: one, or with
  `hardware.device_map: auto` the fewest that hold it, as the plan settles it: `memory.settled`);
- QAD: the first `qad.num_gpus` free ones (its torchrun ranks use them in order; `auto`: the
  fewest over which it fits, as the plan settles it);
- the other GPU-heavy stages (baseline, sweep_search, final_eval, export): one, or with
  `device_map: auto` as many as a recipe (the same model, spread alike);
- the stages that load no model: none (their environment is left as it is).

A claim is a lock file per GPU (`flock`), under a folder every process of this machine shares, so
the recipe runs of one flow (threads), and the flow runs a process worker starts (processes), never
share a GPU: a claim waits until that many GPUs are free, takes all of them or none (no stage holds
a GPU while it waits for another), and is released when the process ends. A GPU is named as the
process that claims it sees it in its own `CUDA_VISIBLE_DEVICES` (an index or a UUID), so two
workers given different GPUs never wait for each other.
"""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from qad_pipeline.core.config import ConfigError, Params
from qad_pipeline.core.stages import STAGES

LOCK_DIR_ENV = "QAD_GPU_LOCK_DIR"  # where the claims' lock files are (default: <tmp>/qad-pipeline-gpus)


def free_bytes() -> list[int]:
    """Free bytes per visible GPU, asked in a child process so that no CUDA context stays here
    (none, without asking, where there is no NVIDIA driver)."""
    if not Path("/dev/nvidiactl").exists():
        return []
    code = "import torch; print([torch.cuda.mem_get_info(i)[0] for i in range(torch.cuda.device_count())])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    return json.loads(out.stdout.strip().splitlines()[-1]) if out.returncode == 0 and out.stdout.strip() else []


def visible(count: int | None = None, env: dict[str, str] | None = None) -> tuple[str, ...]:
    """The names of the `count` GPUs this process sees (default: as many as `free_bytes` finds), as
    a child's `CUDA_VISIBLE_DEVICES` must name them: this process's own entries where it has one."""
    env = os.environ if env is None else env
    if count is None:
        count = len(free_bytes())
    given = [d.strip() for d in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    return tuple(given[:count]) if "CUDA_VISIBLE_DEVICES" in env else tuple(str(i) for i in range(count))


def of_worker(params: Params) -> tuple[str, ...]:
    """The GPUs this process (a run here, a pool's worker) hands out to its stage processes."""
    return () if params.hardware.device == "cpu" else visible()


def per_recipe(params: Params, seen: int) -> int:
    """GPUs per PTQ recipe (and sweep budget) on a machine that sees `seen` GPUs."""
    wanted = params.ptq.gpus_per_recipe
    spread = params.hardware.device_map == "auto"
    if wanted == "auto":
        return max(1, seen) if spread else 1
    if wanted > 1 and not spread:
        raise ConfigError(f"ptq.gpus_per_recipe = {wanted} needs hardware.device_map=auto "
                          "(with device_map single a recipe's model is loaded onto one GPU)")
    if wanted > seen:
        raise ConfigError(f"ptq.gpus_per_recipe = {wanted} but this machine sees {seen} GPU(s); "
                          f"set it to at most {seen}, or auto")
    return wanted


def needed(stage: str, params: Params, seen: int) -> int:
    """How many GPUs one process of `stage` (a registry name: `ptq`, `qad`, ...) claims; 0: none."""
    declared = STAGES[stage]
    if not declared.gpu or seen == 0:
        return 0
    return declared.load("gpus").count(params, seen)


def ranks(stage: str, params: Params) -> int | None:
    """The processes of a distributed stage (`stage`: a registry name or summary key), one per GPU
    (QAD's torchrun ranks, which place the model themselves, not by `device_map`); None: one process."""
    declared = STAGES[stage.partition("/")[0]]
    claim = declared.load("gpus") if declared.gpu else None
    return claim.ranks(params) if claim is not None and claim.ranks else None


# -- the stages' GPU claims: each `Stage.gpus` names one ------------------------------------------


@dataclass(frozen=True)
class GpuClaim:
    """How many GPUs one process of a stage claims on a machine that sees `seen` (`count(params,
    seen)`), the setting that decides it (`knob(params)`, which a refusal names), and whether other
    pods hold its GPUs (`elsewhere(params)`: its own Job asks for none)."""

    count: Callable[[Params, int], int]
    knob: Callable[[Params], str]
    elsewhere: Callable[[Params], bool] = lambda params: False
    ranks: Callable[[Params], int] | None = None  # torchrun ranks, one per GPU (QAD): how many; None: one process


def _device_map_knob(params: Params) -> str:
    return f"hardware.device_map={params.hardware.device_map}"


def _recipe_knob(params: Params) -> str:
    if params.ptq.gpus_per_recipe != "auto":
        return f"ptq.gpus_per_recipe={params.ptq.gpus_per_recipe}"
    return _device_map_knob(params)


def _spread_or_one(params: Params, seen: int) -> int:
    """One; with `device_map: auto` as many as a PTQ recipe gets (the same model spread alike:
    `ptq.gpus_per_recipe`, which the plan settles to the fewest that hold it)."""
    return per_recipe(params, seen) if params.hardware.device_map == "auto" else 1


# a PTQ recipe, a sweep budget: `ptq.gpus_per_recipe`
RECIPE = GpuClaim(per_recipe, _recipe_knob)
# QAD: its torchrun ranks' `qad.num_gpus`; across nodes, the TrainJob's pods hold them (qad_pipeline/training/trainjob.py)
QAD = GpuClaim(lambda params, seen: params.qad.num_gpus, lambda params: f"qad.num_gpus={params.qad.num_gpus}",
               elsewhere=lambda params: params.qad.num_nodes > 1, ranks=lambda params: params.qad.num_gpus)
# the other GPU-heavy stages: one, or as many as a recipe with `device_map: auto`
WHOLE_MODEL = GpuClaim(_spread_or_one, _device_map_knob)


def slots(params: Params, seen: int) -> int:
    """How many recipes (or budgets) can hold their GPUs at once."""
    return seen // per_recipe(params, seen) if seen else 0


def layout(runs: list[tuple[str, str | None]], params: Params, names: tuple[str, ...], at_once: int
           ) -> dict[str, tuple[str, ...]]:
    """The GPUs each stage process of `runs` ((stage, item) in the order a run starts them) gets
    when nothing else holds them, by its summary key (`ptq/<recipe>`, `qad`): the recipes and
    budgets in turn over `at_once` slots of `per_recipe` GPUs, every other stage the first
    `needed` GPUs. The plan prints it; a run claims these first (`claim`'s `prefer`)."""
    out, turn = {}, 0
    width = per_recipe(params, len(names)) if names else 0
    for stage, item in runs:
        count = needed(stage, params, len(names))
        start = 0
        if item is not None and count:
            start, turn = (turn % max(1, min(at_once, slots(params, len(names))))) * width, turn + 1
        out[f"{stage}/{item}" if item is not None else stage] = names[start:start + count]
    return out


def shown(gpus: tuple[str, ...]) -> str:
    """GPUs as the plan's table shows them: `-`, `3`, `0-3` (a run of indices) or `3,5`."""
    if not gpus:
        return "-"
    if len(gpus) > 2 and all(g.isdigit() for g in gpus) and [int(g) for g in gpus] == list(
            range(int(gpus[0]), int(gpus[0]) + len(gpus))):
        return f"{gpus[0]}-{gpus[-1]}"
    return ",".join(gpus)


def _lock_dir() -> Path:
    folder = Path(os.environ.get(LOCK_DIR_ENV) or Path(tempfile.gettempdir()) / "qad-pipeline-gpus")
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def _lock_name(gpu: str) -> str:
    return "gpu-" + "".join(c if c.isalnum() or c in "-_" else "_" for c in gpu) + ".lock"


@contextmanager
def claim(count: int, gpus: tuple[str, ...], what: str = "", waiting: Callable[[str], None] | None = None,
          prefer: tuple[str, ...] = (), poll_s: float = 0.5) -> Iterator[tuple[str, ...]]:
    """Hold `count` of `gpus` (the free ones: those of `prefer` first, then in order) for as long as
    the block runs; yields them.

    Waits while fewer than `count` are free, taking none meanwhile; `waiting` is told once.
    `count` 0 yields () at once."""
    if count == 0:
        yield ()
        return
    if count > len(gpus):
        raise ConfigError(f"{what or 'a stage'} needs {count} GPU(s), this machine sees {len(gpus)} ({', '.join(gpus) or 'none'})")
    folder, told = _lock_dir(), False
    while True:
        held: list[tuple[str, int]] = []
        for gpu in [*prefer, *(g for g in gpus if g not in prefer)]:
            fd = os.open(folder / _lock_name(gpu), os.O_RDWR | os.O_CREAT, 0o666)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue
            held.append((gpu, fd))
            if len(held) == count:
                break
        if len(held) == count:
            break
        for _, fd in held:
            os.close(fd)  # closing the file releases its lock
        if waiting and not told:
            waiting(f"{what or 'a stage'}: waiting for {count} free GPU(s) of {', '.join(gpus)}")
            told = True
        time.sleep(poll_s)
    try:
        yield tuple(gpu for gpu, _ in held)
    finally:
        for _, fd in held:
            os.close(fd)


def env_for(claimed: tuple[str, ...]) -> dict[str, str]:
    """The environment a stage process gets for the GPUs it holds (nothing when it holds none)."""
    return {"CUDA_VISIBLE_DEVICES": ",".join(claimed)} if claimed else {}
