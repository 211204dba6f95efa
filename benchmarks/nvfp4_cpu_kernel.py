"""The CPU NVFP4 fake quantization's speed: `python benchmarks/nvfp4_cpu_kernel.py [--size 4096] [--repeats 5]`.

Times `qad_pipeline.nvfp4.nvfp4_cpu.fp4_fake_quant_block` on a random BF16 square matrix (after a
warm-up) and prints each run's wall time, the median and the elements per second. A 4096x4096
matrix took ~0.4 s on two busy cores (it was a test's assertion, < 2.5 s, until wall time left the
tests: a benchmark measures, a test checks behaviour).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from qad_pipeline.nvfp4 import nvfp4_cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    w = torch.randn(args.size, args.size, dtype=torch.bfloat16)
    amax = w.float().abs().amax()
    nvfp4_cpu.fp4_fake_quant_block(w[:16], amax)  # warm-up
    seconds = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        nvfp4_cpu.fp4_fake_quant_block(w, amax)
        seconds.append(time.perf_counter() - start)
        print(f"{args.size}x{args.size}: {seconds[-1]:.3f} s")
    median = statistics.median(seconds)
    print(f"median {median:.3f} s, {w.numel() / median / 1e6:.0f} M elements/s ({torch.get_num_threads()} threads)")


if __name__ == "__main__":
    main()
