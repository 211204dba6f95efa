"""Learnable NVFP4 weight scales in QAD (`qad.learn_scales: lsq`), through Model Optimizer's LSQ.

Model Optimizer 0.47's LSQ (`StaticBlockScaleQuantizer.enable_lsq`, its `lsq` algorithm and its
`general/qad/nvfp4_lsq-mse_init-fp8_kv` recipe) makes each block's amax an `nn.Parameter`: the
forward is `Q_STE(w / s) * s` with `s` the block's FP8 scale from that amax, so AdamW trains the
scales beside the weights. What this module adds around it, so the QAD student the stage saves is
the same kind of checkpoint as any PTQ student:

- `enable` starts from the PTQ student's own scales, with no recalibration (the recipe's choice,
  MSE or four-over-six or GPTQ's, is the starting point). A weight quantizer with dynamic block
  scales (the max recipe) is first made static with the per-block amax it computes on every
  forward anyway (`make_static`): every weight keeps its FP4 value and FP8 block scale (the kernels
  multiply the two scales in different float32 orders, so a value may differ in its last place).
- The amax is tied (one tensor is both the quantizing and the dequantizing scale): Model
  Optimizer's QAD recipe does the same, and the export writes that one scale. Dual LSQ (separate
  scales) has no export path in Model Optimizer 0.47.
- `fold` turns the learned amax back into a plain static quantizer's `_amax` (what the export reads,
  `NVFP4QTensor.get_weights_scaling_factor_from_quantizer`), clamped to the range the forward
  could use (an amax above the global amax saturates at FP8's largest scale, one below FP8's
  smallest step is raised to it), so the export writes what QAD trained.
"""

from __future__ import annotations

from typing import get_args

import torch

from qad_pipeline.core.config import QADParams

MODES = get_args(QADParams.model_fields["learn_scales"].annotation)  # ("none", "lsq"), as params.yaml takes them
BLOCK = 16
LSQ_FLOOR = 2.0**-9  # LSQ's smallest block amax, as a fraction of the global amax (E4M3's smallest subnormal
                    # times its per-tensor unit, global / 6: FP8 code 0.21875 where the static kernel goes to 2^-9)


def _is_nvfp4_weight_quantizer(quantizer) -> bool:
    blocks = getattr(quantizer, "block_sizes", None) or {}
    return (getattr(quantizer, "is_enabled", False) and getattr(quantizer, "num_bits", None) == (2, 1)
            and blocks.get(-1) == BLOCK and blocks.get("scale_bits") == (4, 3))


def weight_quantizers(model):
    """(name, weight, quantizer) for every enabled NVFP4 weight quantizer of `model`, each once."""
    from modelopt.torch.quantization.nn import QuantModule

    seen = set()
    for name, module in model.named_modules():
        if not isinstance(module, QuantModule):
            continue
        for weight, quantizer in module.iter_weights_for_calibration():
            if id(quantizer) in seen or not _is_nvfp4_weight_quantizer(quantizer):
                continue
            seen.add(id(quantizer))
            yield name, weight, quantizer


def make_static(weight: torch.Tensor, quantizer) -> bool:
    """A dynamic NVFP4 weight quantizer made static, with the block amaxes it computes from `weight`
    on each forward and its calibrated amax as the global one. False when it is static already."""
    from modelopt.torch.quantization.nn import StaticBlockScaleQuantizer

    if isinstance(quantizer, StaticBlockScaleQuantizer):
        return False
    if weight.shape[-1] % BLOCK:
        raise ValueError(f"a weight of shape {tuple(weight.shape)} does not split into blocks of {BLOCK}")
    global_amax = quantizer.amax
    if global_amax is None:
        global_amax = weight.detach().abs().amax()
    blocks = weight.detach().float().reshape(-1, BLOCK).abs().amax(dim=-1, keepdim=True)
    quantizer.block_sizes = {**quantizer.block_sizes, "type": "static"}
    global_amax = global_amax.detach().float().reshape(())
    if hasattr(quantizer, "_amax"):
        delattr(quantizer, "_amax")  # a per-tensor amax becomes per-block: the setter refuses a new shape
    StaticBlockScaleQuantizer.from_tensor_quantizer(quantizer, global_amax=global_amax)
    quantizer.amax = blocks
    return True


def enable(model, mode: str) -> int:
    """Learnable tied block amaxes on every NVFP4 weight quantizer of `model` (mode "lsq"), from its
    current scales. Returns how many quantizers learn their scales (0 with mode "none")."""
    if mode not in MODES:
        raise ValueError(f"qad.learn_scales is {mode!r}; valid: {', '.join(MODES)}")
    if mode == "none":
        return 0
    count = 0
    for _, weight, quantizer in list(weight_quantizers(model)):
        make_static(weight, quantizer)
        if not quantizer._lsq:
            quantizer.enable_lsq(learnable_amax=["pre", "post"], tied_amax=True, quantize_pre_scale=True,
                                 dtype=weight.dtype)
        count += 1
    return count


def quantizers_learning(model) -> list:
    """The quantizers of `model` whose block scales are learnable now (LSQ mode)."""
    return [m for m in model.modules() if getattr(m, "_lsq", False)]


def fold(model) -> int:
    """Each learned amax back into a plain static quantizer's `_amax`, clamped to the range the forward
    uses, in float32. Returns how many quantizers were folded."""
    count = 0
    for _, _, quantizer in list(weight_quantizers(model)):
        if not getattr(quantizer, "_lsq", False):
            continue
        global_amax = quantizer.global_amax.detach().float()
        smallest = global_amax * LSQ_FLOOR
        amax = quantizer.amax_post.detach().float().clamp(min=float(smallest), max=float(global_amax))
        for attr in ("_amax_post", "_amax_pre"):
            if attr in quantizer._parameters:
                del quantizer._parameters[attr]
            elif attr in quantizer._buffers:
                del quantizer._buffers[attr]
        for attr in ("_lsq", "_learnable_amax", "_tied_amax", "_quantize_pre_scale"):
            quantizer.__dict__.pop(attr, None)
        quantizer.amax = amax
        count += 1
    return count
