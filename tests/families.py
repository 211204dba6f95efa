"""The architecture matrix: a small model of each family the users bring, built from its transformers
config class (random weights, two layers, four experts for the MoE), and the whole DAG run on it at
the tests' tiny settings, in one process (`run_family`).

Every family has the demo tokenizer's 4,096-token vocabulary (a stated reduction: Gemma 3's is
262,144, Qwen3's 151,936; the plan's vocabulary terms are tested on the real configs in
tests/test_targets.py) and head_dim 64 (vLLM's CPU attention has no kernel for head_dim 16). The
demo model is the Nemotron-H family (Mamba, MoE and attention layers) and runs the same DAG in
tests/test_flow_e2e.py, so it is not repeated here.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import transformers as T

from qad_pipeline.core.artifacts import read_json
from qad_pipeline.core.config import load_params
from qad_pipeline.core.layout import Layout
from tests.conftest import TINY

VOCAB = 4096
SHAPE = dict(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
             num_key_value_heads=1, head_dim=64, max_position_embeddings=512)
STAGES = ["calibration", "baseline", "ptq", "selection", "qad", "final_eval", "export"]
AGGRESSIVE = "nvfp4_4o6-mamba_w4a16-kv_nvfp4"
SEED_RECIPES = load_params().ptq.recipes  # params.yaml's five


def beside_the_five(recipe: str) -> tuple[str, ...]:
    """Run `recipe` after the seed's five and export its checkpoint, not the QAD student's, so that the
    export checks and vLLM's serving check read what it wrote."""
    return f"ptq.recipes=[{', '.join([*SEED_RECIPES, recipe])}]", f"export.source=ptq/{recipe}"



@dataclass(frozen=True)
class Family:
    name: str
    model: type
    config: type
    settings: dict
    overrides: tuple[str, ...] = ()  # what the matrix sets for this family beyond the tiny settings

    def build(self):
        torch.manual_seed(0)
        return self.model(self.config(**SHAPE, **self.settings))


FAMILIES = {f.name: f for f in [
    # Model Optimizer's layerwise calibration, and GPTQ's sequential mode with it (each layer's Hessian
    # from the quantized layers before it), exported: its block scales come from the base weights'
    # amax, not from the weights GPTQ wrote (the weights check's tie test reads the student's amax)
    Family("llama", T.LlamaForCausalLM, T.LlamaConfig, {},
           ("ptq.layerwise=true", *beside_the_five("nvfp4_gptq-mamba_fp8-kv_fp8"))),
    Family("gemma3", T.Gemma3ForCausalLM, T.Gemma3TextConfig, dict(sliding_window=32)),  # tied, sliding + global
    # QAD with learned block scales (qad.learn_scales lsq): exported and served from the learned scales
    Family("qwen3", T.Qwen3ForCausalLM, T.Qwen3Config, dict(tie_word_embeddings=True),  # q/k norms, tied
           ("qad.learn_scales=lsq",)),
    Family("qwen3_moe", T.Qwen3MoeForCausalLM, T.Qwen3MoeConfig,
           dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64),  # fused experts, router
           ("qad.learn_scales=lsq",)),
    Family("mistral", T.MistralForCausalLM, T.MistralConfig, dict(sliding_window=32),
           beside_the_five("nvfp4_headroom-mamba_fp8-kv_fp8")),
    Family("phi3", T.Phi3ForCausalLM, T.Phi3Config, dict(pad_token_id=0),  # fused qkv_proj, gate_up_proj
           beside_the_five("nvfp4_lhessian-mamba_fp8-kv_fp8")),
]}


def run_family(family: Family, folder: Path, tokenizer_dir: Path):
    """Build the family's model into `folder/model` and run every stage of the DAG on it, as
    `qad-pipeline stage` runs each (the five recipes one after another), with the defaults' `auto`
    settled for this machine as it does; returns (params, layout)."""
    from transformers import AutoTokenizer

    from qad_pipeline.cli import Stage, run_stage
    from qad_pipeline.plan.memory import settled_here

    model_dir = folder / "model"
    family.build().save_pretrained(model_dir)
    AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(model_dir)
    params = load_params(overrides=TINY + [f"base_model.path={model_dir}", "eval.tasks=[heldout_continuation]",
                                           *family.overrides])
    params = settled_here(params)  # each `auto` for this machine, as `qad-pipeline stage` settles it
    layout = Layout(folder / "out")
    for stage in STAGES:
        for recipe in (params.ptq.recipes if stage == "ptq" else [None]):
            run_stage(Stage(stage), params, layout, recipe)
    return params, layout


def expected_formats(model_dir: Path) -> dict[str, str]:
    """weight name -> the format every recipe gives it, by role: attention and routers BF16, MLPs and
    experts NVFP4, the output projection NVFP4 (weight-only) unless tied to the embeddings."""
    from qad_pipeline.core.modeling import tied_embeddings
    from qad_pipeline.nvfp4.roles import module_roles

    with torch.device("meta"):
        model = T.AutoModelForCausalLM.from_config(T.AutoConfig.from_pretrained(model_dir))
    fmt = {"attention": "bf16", "router": "bf16", "mlp": "nvfp4", "experts": "nvfp4",
           "lm_head": "bf16" if tied_embeddings(model) else "nvfp4"}
    out = {}
    for name, role in module_roles(model).items():
        if role == "lm_head" and tied_embeddings(model):
            continue  # one tensor, the embedding's
        if role == "experts":
            out.update({f"{name}.{p}": fmt[role] for p, _ in model.get_submodule(name).named_parameters(recurse=False)})
        else:
            out[f"{name}.weight"] = fmt[role]
    return out


def ptq_scores(layout: Layout, recipe: str) -> dict:
    return read_json(layout.ptq(recipe) / "scores.json")
