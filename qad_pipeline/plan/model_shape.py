"""The model's shapes, from its config alone (`model_shape`): what the memory plan and the cost model
need to know about it (parameters, matrices, layers, widths, vocabulary, experts, Mamba mixers, and
the Hessians GPTQ and the local-Hessian search hold). The model is built on the meta device: no
weight is read or allocated."""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache

from qad_pipeline.core.config import BaseModelParams


@dataclass(frozen=True)
class ModelShape:
    """What the formula needs to know about the model, from its config alone."""

    params: int
    matrix_params: int  # Nw
    largest_matrix: int  # Nmax
    layers: int
    hidden: int
    ffn: int  # F: the MLP width per token (routed experts per token x their width + shared ones)
    vocab: int
    max_positions: int | None
    mamba_layers: int = 0
    mamba_scan: int = 0  # chunk size x heads of the widest Mamba-2 mixer
    active_matrix_params: int = 0  # the matrix weights one token goes through (MoE: its experts only)
    widest_row: int = 0  # the longest row (last dimension) of a matrix: what one row of a weight holds
    tied_embeddings: bool = False  # the LM head is the input embedding (one [vocab, hidden] matrix, not two)
    # GPTQ's input Hessians (in x in float32 per weight) of the 2-D weights the recipes may quantize
    # (every role but attention and routers): all of them, and the largest decoder layer's (layerwise)
    hessian_elems: int = 0
    layer_hessian_elems: int = 0
    quantized_inputs: int = 0  # the summed input widths of those weights (local_hessian keeps 16 x 16 per block)
    gptq_update_flops: int = 0  # GPTQ's weight update over those weights: Σ 2·out·in² + in³/3 (Cholesky)
    routed_experts: int = 0  # experts per MoE layer (0: a dense model)


@lru_cache(maxsize=8)
def _shape(path: str, revision: str | None, trust_remote_code: bool) -> ModelShape:
    import torch
    from transformers import AutoModelForCausalLM

    from qad_pipeline.core.modeling import load_config, max_positions

    config = load_config(BaseModelParams(path=path, revision=revision, trust_remote_code=trust_remote_code))
    text = config.get_text_config()
    with torch.device("meta"):  # every tensor on the meta device: shapes only, nothing allocated or read
        model = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
    embeddings = model.get_input_embeddings().weight
    head = model.get_output_embeddings()
    matrices = [p.numel() for p in model.parameters() if p.ndim >= 2 and p is not embeddings]
    widest = max(p.shape[-1] for p in model.parameters() if p.ndim >= 2 and p is not embeddings)
    ffn = getattr(text, "intermediate_size", None) or 4 * text.hidden_size
    if getattr(text, "num_experts_per_tok", None) and getattr(text, "moe_intermediate_size", None):
        shared = (getattr(text, "moe_shared_expert_intermediate_size", None)
                  or getattr(text, "shared_expert_intermediate_size", None) or 0)
        ffn = max(ffn, text.num_experts_per_tok * text.moe_intermediate_size + shared)
    mamba = [m for m in model.modules() if "Mamba" in type(m).__name__ and hasattr(m, "chunk_size")]
    # routed experts: a token goes through num_experts_per_tok of them (shared experts are not ".experts.")
    routed = sum(p.numel() for name, p in model.named_parameters() if ".experts." in f".{name}")
    total = next((getattr(text, k) for k in ("num_experts", "n_routed_experts", "num_local_experts")
                  if isinstance(getattr(text, k, None), int)), 0)
    per_token = getattr(text, "num_experts_per_tok", None) or total
    idle = routed - routed * per_token // total if routed and total else 0
    hessians, per_layer, inputs, update = _hessians(model, embeddings)
    return ModelShape(
        params=sum(p.numel() for p in model.parameters()), matrix_params=sum(matrices),
        largest_matrix=max(matrices), layers=text.num_hidden_layers, hidden=text.hidden_size, ffn=ffn,
        vocab=text.vocab_size, max_positions=max_positions(text), mamba_layers=len(mamba),
        mamba_scan=max((m.chunk_size * m.num_heads for m in mamba), default=0),
        active_matrix_params=sum(matrices) - idle, widest_row=widest,
        tied_embeddings=head is not None and head.weight is embeddings,
        hessian_elems=hessians, layer_hessian_elems=per_layer, quantized_inputs=inputs, gptq_update_flops=update,
        routed_experts=total if routed else 0,
    )


def _hessians(model, embeddings) -> tuple[int, int, int, int]:
    """(the sum of in_features² over the 2-D weights the recipes may quantize, the largest decoder
    layer's sum, the summed in_features of all of them, GPTQ's update FLOPs). Model Optimizer's GPTQ
    rounds linear layers' 2-D weights only: fused 3-D experts keep their max scales and hold no
    Hessian (its local-Hessian search does cover them: their inputs count)."""
    from qad_pipeline.nvfp4.roles import module_roles

    total, inputs, update, layers = 0, 0, 0, {}
    for name, role in module_roles(model).items():
        if role in ("attention", "router"):
            continue
        module = model.get_submodule(name)
        for w in module.parameters(recurse=False):
            if w.ndim < 2 or w is embeddings:
                continue
            width = w.shape[-1]
            inputs += width * (w.shape[0] if w.ndim == 3 else 1)  # fused experts: [experts, out, in]
            if w.ndim != 2:
                continue
            total, update = total + width**2, update + 2 * w.shape[0] * width**2 + width**3 // 3
            layer = re.search(r"\.(\d+)\.", f".{name}.")
            key = layer.group(1) if layer else name
            layers[key] = layers.get(key, 0) + width**2
    return total, max(layers.values(), default=0), inputs, update


def model_shape(base: BaseModelParams) -> ModelShape:
    """The model's shapes from its config (`modeling.load_config`: offline for the profiles' models)."""
    return _shape(base.path, base.revision, base.trust_remote_code)
