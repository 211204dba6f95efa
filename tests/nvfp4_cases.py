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


# --------------------------------------------------------------------------------------------
# The parity cases: scripts/gpu_nvfp4_parity.py runs them at the default size on a GPU,
# tests/test_nvfp4_parity.py at that size or a smaller one on the CPU.

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
TIES = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0])
PARITY_SIZE = (256, 1024)  # rows x columns of the parity tensors (at least 16 x 64)


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``."""
    return str(dtype).removeprefix("torch.")


def with_ties(x: torch.Tensor) -> torch.Tensor:
    """Blocks of exact E2M1 decision boundaries times 2**-8 .. 2**-1 (block amax 6 * 2**k).

    With a global amax of 5.25 (dynamic; global scale 2**-9) or 6 (static) every such block gets
    the exact scale 2**k, so ``|x| / scale`` lands exactly on the boundaries.
    """
    x = x.clone()
    rows = x.view(-1, x.shape[-1])
    ties = torch.cat([TIES, -TIES]).to(x.dtype)
    for r in range(3, 11):
        rows[r, :BLOCK] = ties * 2.0 ** (r - 11)
    return x


def with_tiny_blocks(x: torch.Tensor) -> torch.Tensor:
    """Blocks far below the tensor's amax: FP8 scale underflow and the 1e-5 dynamic floor."""
    x = x.clone()
    rows = x.view(-1, x.shape[-1])
    for r, factor in zip(range(3, 7), (1e-3, 1e-5, 1e-7, 1e-9)):
        rows[r, :BLOCK] *= factor
    return x


def block_amax(x: torch.Tensor) -> torch.Tensor:
    """Per-16-element amax over the flattened tensor, float32."""
    return x.float().reshape(-1, BLOCK).abs().amax(-1)


def dynamic_cases(size: tuple[int, int] = PARITY_SIZE):
    """(name, x, global_amax or None = x's amax) for the dynamic path."""
    rows, cols = size
    for dtype in DTYPES:
        dname = dtype_name(dtype)
        for i, kind in enumerate(KINDS):
            x = sample(kind, size, dtype, seed=i)
            amax = x.float().abs().amax()
            yield f"{kind}/{dname}", x, amax
            yield f"{kind}/{dname}/amax*1.3", x, amax * 1.3
        x = sample("normal", size, dtype, seed=40)
        yield f"ties/{dname}", with_ties(x), torch.tensor(5.25)
        x = with_tiny_blocks(sample("normal", size, dtype, seed=41))
        yield f"tiny_blocks/{dname}", x, x.float().abs().amax()
        yield f"small_global_amax/{dname}", x * 1e-3, torch.tensor(1e-3)
        yield f"reciprocal_form_amax/{dname}", x * 0.2, torch.tensor(1.0090899467468262)
        zeros = torch.zeros(rows // 4, cols // 8, dtype=dtype)
        yield f"zero_global_amax/{dname}", zeros, torch.tensor(0.0)
        short = sample("normal", (rows * 3 // 8, cols - 24), dtype, seed=42)
        yield f"short_last_block/{dname}", short, None
        yield f"3d/{dname}", sample("outliers", (4, rows // 4, cols // 2), dtype, seed=43), None


def static_cases(size: tuple[int, int] = PARITY_SIZE):
    """(name, x as [blocks, 16], per-block amax, global amax) for the static path."""
    for dtype in DTYPES:
        dname = dtype_name(dtype)
        for i, kind in enumerate(KINDS):
            x = sample(kind, size, dtype, seed=10 + i)
            amax = block_amax(x)
            for label, factor in (("", 1.0), ("/amax*0.9", 0.9), ("/amax*1.5", 1.5)):
                blocks, global_amax = x.reshape(-1, BLOCK), x.float().abs().amax()
                yield f"{kind}/{dname}{label}", blocks, amax * factor, global_amax
        x = with_ties(sample("normal", size, dtype, seed=50))
        yield f"ties/{dname}", x.reshape(-1, BLOCK), block_amax(x), torch.tensor(6.0)
        x = with_tiny_blocks(sample("normal", size, dtype, seed=51))
        yield f"tiny_blocks/{dname}", x.reshape(-1, BLOCK), block_amax(x), x.float().abs().amax()
        x = sample("normal", size, dtype, seed=52)
        # For this global amax the CUDA (reciprocal) and CPU (true division) forms differ.
        blocks, global_amax = x.reshape(-1, BLOCK) * 0.2, torch.tensor(1.0090899467468262)
        yield f"reciprocal_form_amax/{dname}", blocks, block_amax(x) * 0.2, global_amax


def cast_cases(size: tuple[int, int] = PARITY_SIZE):
    """(name, x) for the FP4 cast: already-scaled values, with exact ties."""
    for dtype in DTYPES:
        x = (sample("normal", size, torch.float32, seed=60) * 4).to(dtype)
        yield dtype_name(dtype), with_ties(x)
