"""Test tensors for NVFP4 kernels, shared by the CPU tests and the GPU parity script.

Each kind stresses the block scaling differently (outliers, all-negative, heavy tails, sparsity);
every tensor also holds two all-zero blocks and one constant negative block.
"""

from __future__ import annotations

import torch

BLOCK = 16
KINDS = ("normal", "outliers", "negative", "heavy_tail", "sparse")


def sample(kind: str, shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Random test tensor (float32 draw cast to ``dtype``) with all-zero and constant blocks."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen)
    if kind == "outliers":
        flat = x.view(-1)
        idx = torch.randint(0, flat.numel(), (max(1, flat.numel() // 500),), generator=gen)
        flat[idx] *= 40.0
    elif kind == "negative":
        x = -x.abs()
    elif kind == "heavy_tail":
        x = x * torch.exp(2.0 * torch.randn(shape, generator=gen))
    elif kind == "sparse":
        x = x * (torch.rand(shape, generator=gen) < 0.3)
    rows = x.view(-1, shape[-1])
    rows[1, : 2 * BLOCK] = 0.0
    rows[2, BLOCK : 2 * BLOCK] = -0.5
    return x.to(dtype)
