"""A node the plan is made for when it is not this machine: `qad-pipeline plan --target 8xH100-80GB`
or `hardware.target`.

    <count>x<GPU>[-<memory>][,<memory>-host]      8xH100-80GB   4xB200-180GB,2TiB-host   8xH200

`<GPU>` is one of `GPUS` (its memory and dense BF16 peak; the peak feeds the plan's time
estimate). A GPU's memory as its name gives it ("80GB") is read in GiB: what `nvidia-smi` reports
is within 1 % of that for these GPUs (an H100 80GB: 81,559 MiB). The host memory defaults to
HOST_PER_GPU per GPU (a DGX H100: 2 TiB for 8), which is an assumption: give it where you know it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

GiB, TiB = 2**30, 2**40
# name: (memory, dense BF16 FLOP/s without sparsity), from NVIDIA's datasheets (SXM parts)
GPUS = {
    "A100": (80 * GiB, 312e12),
    "H100": (80 * GiB, 989e12),
    "H200": (141 * GiB, 989e12),
    "B200": (180 * GiB, 2250e12),
}
HOST_PER_GPU = 256 * GiB

_SIZE = r"(\d+(?:\.\d+)?)\s*(GB|GiB|TB|TiB)"
_TARGET = re.compile(rf"^\s*(\d+)\s*[xX]\s*([A-Za-z0-9]+?)(?:-{_SIZE})?\s*(?:,\s*{_SIZE}-host)?\s*$")


@dataclass(frozen=True)
class Target:
    text: str
    count: int
    gpu: str
    gpu_bytes: int
    host_bytes: int
    bf16_flops: float
    host_given: bool


def _bytes(number: str, unit: str) -> int:
    return int(float(number) * (TiB if unit.upper().startswith("T") else GiB))


def parse(text: str) -> Target:
    """The node `text` describes; ValueError naming what is wrong and what would be valid."""
    found = _TARGET.match(text or "")
    if not found:
        raise ValueError(f"target {text!r} is not <count>x<GPU>[-<memory>][,<memory>-host], "
                         "e.g. 8xH100-80GB or 4xB200-180GB,2TiB-host")
    count, gpu, memory, unit, host, host_unit = found.groups()
    name = gpu.upper()
    if name not in GPUS:
        raise ValueError(f"target {text!r}: unknown GPU {gpu!r}; known: {', '.join(GPUS)}")
    if int(count) < 1:
        raise ValueError(f"target {text!r}: the GPU count must be at least 1")
    default_memory, flops = GPUS[name]
    return Target(text.strip(), int(count), name, _bytes(memory, unit) if memory else default_memory,
                  _bytes(host, host_unit) if host else int(count) * HOST_PER_GPU, flops, host is not None)
