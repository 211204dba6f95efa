"""Fake-quantize a quantized model's weights once for an evaluation, not once per forward.

A Model Optimizer fake-quantized model re-quantizes every weight in every forward (NVFP4: block
scales from the weight under its calibrated global amax, or its static per-block amax), which
makes a forward cost several BF16 forwards. Over an evaluation the weights do not change, so
`folded_weights` writes each weight's fake-quantized value into the weight itself once and
switches its weight quantizer off; activation and KV-cache quantizers still run per forward.

It is exact: each weight is replaced by `quantizer(weight)`, the very call (same quantizer, same
tensor, same dtype) the module's forward makes, so every forward inside the context computes the
same logits, bit for bit, as without it. (Model Optimizer's `mtq.temporarily_fold_weights` folds
`quantizer(weight.float())` instead, and writes through a weight tied to the embedding.)

On exit, also after an exception, the model is as it went in, bit for bit: each folded weight is
copied back in place from a copy of the original taken before folding (the Parameter objects stay
the same, so optimizer references hold), and every quantizer's properties are restored through
Model Optimizer's `preserve_quantizer_attributes_context` (calibrated amax buffers are never
touched). The originals are stashed on `stash` (default: host memory), so a model that fills its
GPUs does not need a second copy there: the device holds one extra weight at a time while folding.

Left fake-quantizing per forward (still exact, just not faster): a weight shared with another
parameter (an `lm_head` tied to the embedding table: its quantized view must never reach the
embedding lookup), a weight on the meta device (offloaded by accelerate: the forward reads the
original from the offload store), a tensor-parallel `DTensor`, a `SequentialQuantizer`, and a
quantizer in calibration mode.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

__all__ = ["FoldReport", "folded_weights"]


@dataclass
class FoldReport:
    """What `folded_weights` did: weights folded, bytes stashed, and why others were left."""

    folded: int = 0
    stashed_bytes: int = 0
    stash: str = "cpu"
    left: dict[str, str] = field(default_factory=dict)  # "<module>[<index>]" -> reason

    def summary(self) -> str:
        """One line for the log."""
        line = (f"{self.folded} weights fake-quantized once "
                f"({self.stashed_bytes / 2**20:.1f} MiB of originals on {self.stash})")
        if self.left:
            reasons = sorted(set(self.left.values()))
            line += f"; {len(self.left)} left quantizing per forward ({', '.join(reasons)})"
        return line


def _storage_key(t: torch.Tensor) -> tuple[str, int]:
    return str(t.device), t.untyped_storage().data_ptr()


def _shared_storages(model: torch.nn.Module) -> set[tuple[str, int]]:
    """Storages that more than one named parameter or buffer of the model refers to (tied weights)."""
    names: dict[tuple[str, int], int] = {}
    tensors = [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]
    for _, t in tensors:
        if t.device.type != "meta":
            key = _storage_key(t)
            names[key] = names.get(key, 0) + 1
    return {key for key, count in names.items() if count > 1}


def _foldable(model: torch.nn.Module, report: FoldReport) -> list[tuple[torch.Tensor, object]]:
    """(weight, weight quantizer) pairs to fold: Model Optimizer's `iter_weights_for_calibration`
    pairs (a linear's weight; each expert's slice of a fused 3-D MoE weight) whose quantizer
    transforms the weight in the forward; the others, with a reason, into `report.left`."""
    from modelopt.torch.quantization.nn import QuantModule, SequentialQuantizer, TensorQuantizer

    shared, pairs = None, []
    for name, module in model.named_modules():
        if not isinstance(module, QuantModule):
            continue
        for index, (weight, quantizer) in enumerate(module.iter_weights_for_calibration()):
            if not isinstance(weight, torch.Tensor):
                continue
            label = f"{name}[{index}]"
            if isinstance(quantizer, SequentialQuantizer):
                if any(q.is_enabled for q in quantizer):
                    report.left[label] = "sequential quantizer"
                continue
            if not isinstance(quantizer, TensorQuantizer) or not quantizer.fake_quant:
                continue
            if not (quantizer.is_enabled or quantizer.pre_quant_scale is not None or quantizer.rotate_is_enabled):
                continue  # the forward uses the weight as it is
            if quantizer.is_enabled and quantizer._if_calib:
                report.left[label] = "calibrating"
            elif weight.device.type == "meta":
                report.left[label] = "offloaded"
            elif hasattr(weight, "to_local"):
                report.left[label] = "DTensor"
            else:
                shared = _shared_storages(model) if shared is None else shared
                if _storage_key(weight) in shared:
                    report.left[label] = "tied to another parameter"
                else:
                    pairs.append((weight, quantizer))
    return pairs


@contextmanager
def folded_weights(model: torch.nn.Module, stash: str | torch.device = "cpu") -> Iterator[FoldReport]:
    """Within the context, `model`'s weight quantizers run once (their output written into the
    weights, the quantizers off); on exit the weights and quantizer states are restored bit for bit.

    For forwards without gradient and without optimizer steps (an evaluation). `stash` holds the
    original weights meanwhile (default: host memory; the model's own device doubles its
    quantized weights there). A no-op (an empty report) on a model without weight quantizers.
    """
    report = FoldReport(stash=str(stash))
    pairs = _foldable(model, report)
    if not pairs:
        yield report
        return
    from modelopt.torch.quantization.conversion import preserve_quantizer_attributes_context

    originals: list[tuple[torch.Tensor, torch.Tensor]] = []
    with preserve_quantizer_attributes_context(model):
        try:
            with torch.no_grad():
                for weight, quantizer in pairs:  # every weight first, then the quantizers off (one may serve several)
                    folded = quantizer(weight)  # what the module's forward computes from it
                    originals.append((weight, weight.detach().to(stash, copy=True)))
                    weight.copy_(folded)
                    del folded
                for _, quantizer in pairs:
                    quantizer.disable()
                    quantizer.disable_rotate()
                    quantizer._enable_pre_quant_scale = False  # already applied to the folded weight
            report.folded = len(pairs)
            report.stashed_bytes = sum(o.numel() * o.element_size() for _, o in originals)
            yield report
        finally:
            with torch.no_grad():
                for weight, original in originals:
                    weight.copy_(original)
