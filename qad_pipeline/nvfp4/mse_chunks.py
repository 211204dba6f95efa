"""Model Optimizer's MSE weight-scale search, a chunk of rows at a time (`ptq.mse_chunk_rows`).

Why: Model Optimizer 0.47's `mse_calibrate` hands each weight whole to its calibrator, which
searches every candidate scale over all of it at once: float32 copies of the weight, its fake
quantization and error per candidate, and with `fp8_scale_sweep` a float32 loss per block for
each of the 126 FP8 scale candidates (`MseCalibrator.collect`). That is ~22 float32 copies of the
largest weight (Llama-3.1-70B's LM head, 1.05B elements: ~87 GiB), on one GPU, layerwise or not.

Why chunks give the same answer: an NVFP4 weight quantizer's amax is per 16-element block along
a row, and once max calibration has fixed the weight's global amax (it does, before the search),
each block's best scale depends on that block alone (the calibrator sums each candidate's error
per block and takes the argmin per block). Searching the blocks of each chunk of rows and
concatenating the chunks' amax gives bit for bit what the whole-weight search gives
(tests/test_mse_chunks.py), with memory bounded by the chunk.

How: inside `chunked_mse(rows)`, Model Optimizer's own factory (`_make_weight_mse_calibrator`)
still decides which weights are searched and builds their calibrators; `ChunkedCalibrator` wraps
each one and, given the weight in the quantizer's block layout, runs a calibrator of the same kind
and settings on each chunk's blocks (their slice of the initial amax, the same global amax), then
hands Model Optimizer the concatenated amax. A search that is not per block (a per-tensor FP8
weight, the local-Hessian metric, a registered backend's calibrator) runs unchunked.
"""

from __future__ import annotations

import contextlib

import torch


def _block_quantize(quantizer):
    """The quantizer's own fake quantization of weight blocks under a candidate amax: what Model
    Optimizer's `_mse_quant_func` computes, without its reshape to the whole weight's shape."""

    def quant(blocks: torch.Tensor, amax: torch.Tensor) -> torch.Tensor:
        calibrated = quantizer._amax
        quantizer._amax = amax
        try:
            return quantizer._fake_quantize(blocks)
        finally:
            quantizer._amax = calibrated

    return quant


class ChunkedCalibrator:
    """Model Optimizer's calibrator `inner` for one weight, run on chunks of `rows` rows."""

    def __init__(self, inner, quantizer, rows: int):
        self.inner, self.quantizer, self.rows = inner, quantizer, rows
        self._amax: torch.Tensor | None = None
        self.chunks = 0  # how many chunks the last weight was searched in (1: whole)

    def _chunk_calibrator(self, initial_amax: torch.Tensor):
        """A calibrator of `inner`'s kind and settings for the blocks whose initial amax is given;
        None where the search is not per block or not one of Model Optimizer's two."""
        from modelopt.torch.quantization.calib import MseCalibrator, NVFP4MSECalibrator

        inner, quant = self.inner, _block_quantize(self.quantizer)
        if inner._error_func is not None or getattr(inner, "_hessian", None) is not None:
            return None
        if type(inner) is NVFP4MSECalibrator:
            return NVFP4MSECalibrator(amax=initial_amax, global_amax=inner._global_amax, axis=inner._axis,
                                      quant_func=quant)
        if type(inner) is MseCalibrator:
            return MseCalibrator(amax=initial_amax, axis=inner._axis, step_size=inner._step_size,
                                 start_multiplier=inner._start_multiplier,
                                 stop_multiplier=inner._stop_multiplier, quant_func=quant)
        return None

    @torch.no_grad()
    def collect(self, x: torch.Tensor) -> None:
        """Search `x`, the weight in the quantizer's block layout ([blocks, 16]), chunk by chunk."""
        initial = self.inner._initial_amax
        shape = getattr(self.quantizer, "_original_shape", None)
        per_block = (x.ndim == 2 and shape is not None and initial is not None
                     and initial.shape[0] == x.shape[0] == initial.numel())
        step = self.rows * (shape[-1] // x.shape[1]) if per_block else 0
        if not per_block or x.shape[0] <= step or self._chunk_calibrator(initial[:1]) is None:
            self.chunks = 1
            self.inner.collect(x)
            return
        parts = []
        for start in range(0, x.shape[0], step):
            calibrator = self._chunk_calibrator(initial[start:start + step])
            calibrator.collect(x[start:start + step])
            parts.append(calibrator.compute_amax())
            calibrator.reset()
        self.chunks = len(parts)
        self._amax = torch.cat(parts).view_as(initial)

    def compute_amax(self, *args, **kwargs):
        return self._amax if self._amax is not None else self.inner.compute_amax(*args, **kwargs)

    def reset(self) -> None:
        self._amax = None
        self.inner.reset()

    def __getattr__(self, name):  # _axis and the rest of the calibrator's interface: the inner one's
        if name == "inner":  # not set yet (a copy being built): no attribute, not a recursion
            raise AttributeError(name)
        return getattr(self.inner, name)


@contextlib.contextmanager
def chunked_mse(rows: int | None):
    """Within it, Model Optimizer's MSE weight calibration searches `rows` rows at a time (None: whole weights)."""
    if rows is None:
        yield
        return
    if rows < 1:
        raise ValueError(f"ptq.mse_chunk_rows is {rows}; give a positive number of rows, or null for whole weights")
    from modelopt.torch.quantization import model_calib

    make = model_calib._make_weight_mse_calibrator

    def make_chunked(weight_quantizer, *args, **kwargs):
        inner = make(weight_quantizer, *args, **kwargs)
        return None if inner is None else ChunkedCalibrator(inner, weight_quantizer, rows)

    model_calib._make_weight_mse_calibrator = make_chunked
    try:
        yield
    finally:
        model_calib._make_weight_mse_calibrator = make
