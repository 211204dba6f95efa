"""What the stages may use: this machine's free host and GPU memory, or a target node's, with
`HEADROOM` kept back (`capacity`, `target_capacity`); the memory plan (`qad_pipeline.plan.memory`)
holds each stage's estimate against it."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from qad_pipeline.core.config import ConfigError, HardwareParams
from qad_pipeline.plan import gpus
from qad_pipeline.plan.memory_model import GiB

HEADROOM = 0.9                    # the share of the free memory the plan lets the stages use


@dataclass(frozen=True)
class Capacity:
    """What the stages may use: host bytes and bytes per visible GPU, HEADROOM applied."""

    device: str  # "cpu" | "cuda"
    host_bytes: int
    gpu_bytes: tuple[int, ...] = ()  # none seen on CUDA: the stages run elsewhere, nothing is checked
    gpu_names: tuple[str, ...] = ()  # as the stage processes' CUDA_VISIBLE_DEVICES name them (default: this machine's)
    bf16_flops: float | None = None  # per GPU, for the time estimate (a target's; unknown for this machine)
    target: str | None = None  # the node planned for, when it is not this machine


def target_capacity(text: str) -> Capacity:
    """What a node described as `text` (`8xH100-80GB`, see qad_pipeline/core/targets.py) offers, HEADROOM applied."""
    from qad_pipeline.core.targets import parse

    try:
        node = parse(text)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    return Capacity("cuda", int(node.host_bytes * HEADROOM), (int(node.gpu_bytes * HEADROOM),) * node.count,
                    tuple(str(i) for i in range(node.count)), node.bf16_flops, node.text)


def _host_free() -> int:
    """MemAvailable, or less where this process's cgroup (a container's limit) leaves less."""
    try:
        info = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
        free = int(info["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError):
        import psutil

        free = psutil.virtual_memory().available
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit != "max":
            free = min(free, int(limit) - int(Path("/sys/fs/cgroup/memory.current").read_text()))
    except (OSError, ValueError):
        pass
    return free


def planned_device(hardware: HardwareParams) -> str:
    if hardware.device == "cuda":  # also where this process sees no GPU (a flow's control node)
        return "cuda"
    from qad_pipeline.core.modeling import resolve_device

    return resolve_device(hardware)


def capacity(hardware: HardwareParams) -> Capacity:
    """`hardware.host_memory_gb` (GiB) or the free host memory, and each visible GPU's free memory,
    within `hardware.max_memory`."""
    from accelerate.utils import convert_file_size_to_int

    device = planned_device(hardware)
    caps = {k: convert_file_size_to_int(v) for k, v in (hardware.max_memory or {}).items()}
    host = hardware.host_memory_gb * GiB if hardware.host_memory_gb is not None else _host_free()
    host = min(host, caps.get("cpu", host))
    free = [min(f, caps.get(str(i), f)) for i, f in enumerate(gpus.free_bytes() if device == "cuda" else [])]
    return Capacity(device, int(host * HEADROOM), tuple(int(g * HEADROOM) for g in free))
