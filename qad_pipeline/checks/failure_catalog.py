"""A catalog of the ways an NVFP4 export goes wrong, each a corrupted copy of a real export.

Every entry is a function `(export folder, destination) -> destination` that writes a copy of the
export with one failure class applied, as a buggy exporter or a hand edit would write it (shapes,
dtypes and file layout stay valid), and a row of `CATALOG`: the class, the vLLM issue that reports
it, the model it applies to (`smollm2`: the real SmolLM2-135M export of `tests/test_serving.py`;
`demo`: the bundled Nemotron-H, for the MoE entries) and the export check that refuses it
(`qad_pipeline.checks.export_checks`). tests/test_failure_catalog.py applies each one and asserts that check
refuses it; docs/export.md, "Failure catalog", has the figures measured.
"""

from __future__ import annotations

import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from qad_pipeline.core.artifacts import read_json, write_json
from qad_pipeline.checks.export_checks import dequantize, read_tensors

Tensors = dict[str, torch.Tensor]


# -- writing a corrupted copy ---------------------------------------------------------------------


def rewrite(folder: Path, dest: Path, tensors: Callable[[Tensors], None] | None = None,
            config: Callable[[dict], None] | None = None, quantization: Callable[[dict], None] | None = None) -> Path:
    """Copy `folder` to `dest` and edit it in place: `tensors` (the state dict, one safetensors file
    written back), `config` (config.json) and `quantization` (the quantization section, applied to
    hf_quant_config.json's and config.json's alike: an exporter writes both)."""
    folder, dest = Path(folder), Path(dest)
    shutil.copytree(folder, dest)
    if tensors is not None:
        state = read_tensors(folder)
        tensors(state)
        for shard in dest.glob("*.safetensors"):
            shard.unlink()
        (dest / "model.safetensors.index.json").unlink(missing_ok=True)
        save_file(state, str(dest / "model.safetensors"), metadata={"format": "pt"})
    data = read_json(dest / "config.json")
    if config is not None:
        config(data)
    if quantization is not None:
        quantization(data["quantization_config"])
        hf_quant = read_json(dest / "hf_quant_config.json")
        quantization(hf_quant["quantization"])
        write_json(dest / "hf_quant_config.json", hf_quant)
    write_json(dest / "config.json", data)
    return dest


def quantize_nvfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(packed weight, FP8 block scales, FP32 global scale) of a BF16 weight, its global scale from
    its own amax: Model Optimizer's NVFP4 code, as its export calls it."""
    from modelopt.torch.quantization.qtensor import NVFP4QTensor

    q, block, glob = NVFP4QTensor.quantize(weight, 16)
    return q._quantized_data, block, glob.float()


def next_fp8_step(scales: torch.Tensor, index: int) -> torch.Tensor:
    """FP8 (E4M3) block scales with entry `index` one representable step up."""
    raw = scales.view(torch.uint8).clone()
    raw.view(-1)[index] += 1
    return raw.view(torch.float8_e4m3fn)


def mlp_layers(state: Tensors, proj: str) -> list[str]:
    return sorted((n.removesuffix(".weight") for n in state if n.endswith(f".mlp.{proj}.weight")),
                  key=lambda n: int(re.search(r"layers\.(\d+)\.", n).group(1)))


# -- the failure classes --------------------------------------------------------------------------


def fused_scales_unshared(folder: Path, dest: Path) -> Path:
    """gate_proj and up_proj of every layer quantized each with a global scale from its own amax, as
    an exporter without Model Optimizer's `requantize_resmooth_fused_llm_layers` writes them: vLLM
    fuses the two into one GEMM with one global scale (the largest), the other half runs scaled."""
    def edit(state: Tensors) -> None:
        for proj in ("gate_proj", "up_proj"):
            for module in mlp_layers(state, proj):
                weight = dequantize(f"{module}.weight", state)
                state[f"{module}.weight"], state[f"{module}.weight_scale"], state[f"{module}.weight_scale_2"] = (
                    quantize_nvfp4(weight))
    return rewrite(folder, dest, tensors=edit)


def input_scale_fp8_formula(folder: Path, dest: Path, module: str = "model.layers.29.mlp.down_proj") -> Path:
    """One NVFP4 layer's input scale written with the FP8 formula (amax / 448, not amax / (6 x 448)):
    the activations are quantized 6x coarser than the student's."""
    def edit(state: Tensors) -> None:
        state[f"{module}.input_scale"] = state[f"{module}.input_scale"] * 6
    return rewrite(folder, dest, tensors=edit)


def lm_head_w4a4_without_input_scale(folder: Path, dest: Path) -> Path:
    """The (untied, NVFP4) lm_head declared NVFP4 W4A4 in the quantization config, no input scale
    written for it (vLLM #45102): a server quantizes the head's input with a scale it never loaded."""
    def edit(quant: dict) -> None:
        quant["quantized_layers"]["lm_head"]["quant_algo"] = "NVFP4"
    return rewrite(folder, dest, quantization=edit)


def tied_embedding_written_twice(folder: Path, dest: Path) -> Path:
    """A tied model (tie_word_embeddings) with its output layer also stored as lm_head.weight."""
    def edit(state: Tensors) -> None:
        state["lm_head.weight"] = state["model.embed_tokens.weight"].clone()
    return rewrite(folder, dest, tensors=edit)


def tied_embedding_untied(folder: Path, dest: Path) -> Path:
    """config.json says the embedding is not tied and the checkpoint stores no lm_head."""
    def edit(config: dict) -> None:
        config["tie_word_embeddings"] = False
    return rewrite(folder, dest, config=edit)


def expert(state: Tensors, layer_expert: tuple[int, int] = (5, 3)) -> list[str]:
    layer, index = layer_expert
    return sorted(n.removesuffix(".weight") for n in state
                  if re.search(rf"\.layers\.{layer}\.mixer\.experts\.{index}\.\w+_proj\.weight$", n))


def expert_never_routed_zero_scales(folder: Path, dest: Path) -> Path:
    """An expert calibration never routed a token to, exported with zero input scales (vLLM #45212:
    1/0 is its activation global scale, NaN for every token routed to it)."""
    def edit(state: Tensors) -> None:
        for module in expert(state):
            state[f"{module}.input_scale"] = torch.zeros_like(state[f"{module}.input_scale"])
    return rewrite(folder, dest, tensors=edit)


def expert_never_routed_scales_missing(folder: Path, dest: Path) -> Path:
    """The same expert with its input scales left out (vLLM #45212: vLLM loads the missing keys as zero)."""
    def edit(state: Tensors) -> None:
        for module in expert(state):
            del state[f"{module}.input_scale"]
    return rewrite(folder, dest, tensors=edit)


def weight_only_moe(folder: Path, dest: Path) -> Path:
    """The experts quantized weight-only (W4A16_NVFP4, no input scales), a valid checkpoint that vLLM's
    NVFP4 fused MoE serves with every expert zeroed (vLLM #54189)."""
    def tensors(state: Tensors) -> None:
        for name in [n for n in state if ".experts." in n and n.endswith(".input_scale")]:
            del state[name]

    def quantization(quant: dict) -> None:
        for name, spec in quant["quantized_layers"].items():
            if name.endswith(".experts"):
                spec["quant_algo"] = "W4A16_NVFP4"
    return rewrite(folder, dest, tensors=tensors, quantization=quantization)


def global_scale_off(folder: Path, dest: Path, module: str = "model.layers.10.mlp.down_proj",
                     factor: float = 1.05) -> Path:
    """One layer's global scale (weight_scale_2) 5 % off the student's: the whole layer scaled."""
    def edit(state: Tensors) -> None:
        state[f"{module}.weight_scale_2"] = state[f"{module}.weight_scale_2"] * factor
    return rewrite(folder, dest, tensors=edit)


def block_scale_one_step(folder: Path, dest: Path, module: str = "model.layers.10.mlp.down_proj",
                         block: int = 100) -> Path:
    """One block's FP8 scale one E4M3 step up: 16 values 6-12 % too large."""
    def edit(state: Tensors) -> None:
        state[f"{module}.weight_scale"] = next_fp8_step(state[f"{module}.weight_scale"], block)
    return rewrite(folder, dest, tensors=edit)


def bf16_layer_quantized(folder: Path, dest: Path, module: str = "model.layers.0.self_attn.o_proj") -> Path:
    """A layer the recipe keeps in BF16 (attention) written as NVFP4 anyway, the config unchanged."""
    def edit(state: Tensors) -> None:
        state[f"{module}.weight"], state[f"{module}.weight_scale"], state[f"{module}.weight_scale_2"] = (
            quantize_nvfp4(state[f"{module}.weight"]))
    return rewrite(folder, dest, tensors=edit)


def nvfp4_layer_left_bf16(folder: Path, dest: Path, module: str = "model.layers.3.mlp.down_proj") -> Path:
    """A layer the recipe quantizes written back in BF16 (its dequantized values) and excluded in the
    quantization config: consistent on its own, not the model that was evaluated."""
    def tensors(state: Tensors) -> None:
        state[f"{module}.weight"] = dequantize(f"{module}.weight", state)
        for suffix in ("weight_scale", "weight_scale_2", "input_scale"):
            del state[f"{module}.{suffix}"]

    def quantization(quant: dict) -> None:
        key = "exclude_modules" if "exclude_modules" in quant else "ignore"
        quant[key] = sorted(quant[key] + [module])
    return rewrite(folder, dest, tensors=tensors, quantization=quantization)


def kv_scale_missing(folder: Path, dest: Path, module: str = "model.layers.7.self_attn.k_proj") -> Path:
    """One attention layer's K-cache scale left out of a checkpoint with a quantized KV cache."""
    def edit(state: Tensors) -> None:
        del state[f"{module}.k_scale"]
    return rewrite(folder, dest, tensors=edit)


def nibbles_swapped(folder: Path, dest: Path) -> Path:
    """Every packed FP4 weight with its two nibbles swapped: every shape and scale valid, the values
    not (the serving check's own corruption: both views fail by orders of magnitude)."""
    def edit(state: Tensors) -> None:
        for name, t in state.items():
            if t.dtype == torch.uint8 and name.endswith(".weight"):
                state[name] = ((t >> 4) | (t << 4)).to(torch.uint8)
    return rewrite(folder, dest, tensors=edit)


def mlp_scaled(folder: Path, dest: Path, factor: float = 1.015) -> Path:
    """A bug at a fraction of the fused-scale bug's strength: every layer's gate_proj and up_proj
    global scales `factor` off the student's, the pair kept equal (so vLLM's fused GEMM serves
    exactly these values: scaling up_proj alone would also set off the fused-scale class)."""
    def edit(state: Tensors) -> None:
        for proj in ("gate_proj", "up_proj"):
            for module in mlp_layers(state, proj):
                state[f"{module}.weight_scale_2"] = state[f"{module}.weight_scale_2"] * factor
    return rewrite(folder, dest, tensors=edit)


# -- the catalog ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Entry:
    name: str
    failure: str  # the class, in words
    issue: str  # the vLLM issue that reports the class ("" where none)
    model: str  # smollm2 | demo
    check: str  # the export check that refuses it: lint (static), lint+student, formats, weights
    corrupt: Callable[[Path, Path], Path]


CATALOG = [
    Entry("fused_scales_unshared", "fused q/k/v or gate/up exported with different global scales, of which "
          "the engine uses one", "vllm#54974", "smollm2", "lint", fused_scales_unshared),
    Entry("lm_head_w4a4_without_input_scale", "lm_head input_scale missing", "vllm#45102", "demo", "lint",
          lm_head_w4a4_without_input_scale),
    Entry("input_scale_fp8_formula", "an input_scale wrong (FP8 formula on an NVFP4 layer)", "vllm#45102", "smollm2",
          "lint+student", input_scale_fp8_formula),
    Entry("tied_embedding_written_twice", "a tied embedding written twice", "vllm#48238", "smollm2", "lint",
          tied_embedding_written_twice),
    Entry("tied_embedding_untied", "a tied embedding untied", "vllm#48238", "smollm2", "lint", tied_embedding_untied),
    Entry("expert_never_routed_zero_scales", "an expert never routed in calibration, zero input scales",
          "vllm#45212", "demo", "lint", expert_never_routed_zero_scales),
    Entry("expert_never_routed_scales_missing", "an expert never routed in calibration, input scales missing",
          "vllm#45212", "demo", "lint", expert_never_routed_scales_missing),
    Entry("weight_only_moe", "a weight-only NVFP4 MoE (served zeroed)", "vllm#54189", "demo", "lint", weight_only_moe),
    Entry("global_scale_off", "one layer's weight_scale_2 off by 5 %", "", "smollm2", "lint+student",
          global_scale_off),
    Entry("block_scale_one_step", "one block's scale off by one FP8 step", "", "smollm2", "weights",
          block_scale_one_step),
    Entry("bf16_layer_quantized", "a layer the recipe keeps in BF16 quantized", "", "smollm2", "formats",
          bf16_layer_quantized),
    Entry("nvfp4_layer_left_bf16", "a layer the recipe quantizes left in BF16", "", "smollm2", "formats",
          nvfp4_layer_left_bf16),
    Entry("kv_scale_missing", "a KV-cache scale missing", "", "smollm2", "lint", kv_scale_missing),
    Entry("mlp_scaled", "a bug ~1/6 of the fused-scale bug's KL (gate/up global scales 1.5 % off)", "", "smollm2",
          "lint+student", mlp_scaled),
]
