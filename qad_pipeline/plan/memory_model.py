"""The memory model: what each stage process holds in each of its phases, term by term, from
the model's shapes and the settings (`stage_phases`); `qad_pipeline.plan.memory` turns it into a plan.

The formula. N parameters, Nw of them in weight matrices a recipe may quantize (all but the input
embeddings), Nmax the largest matrix, d bytes per element of `base_model.dtype`, V the
vocabulary, H the hidden size, F the MLP width per token, L layers, B and T a stage's batch size
and sequence length, a the bytes of `qad.compute_dtype`. A stage's peak is its largest phase; a
phase is a sum of named terms (`StageEstimate.terms` are the peak phase's), in bytes:

    process           PROCESS_BASE: Python, torch, transformers, Model Optimizer, lm-eval imported
    weights           N·d;  quantizer_state Nw/16·4 for static NVFP4 recipes (MSE, four-over-six:
                      a float32 amax per 16-element block; max calibration keeps one per tensor)
    fake_quant        a quantized forward fake-quantizes one weight at a time: Nmax·4·copies
                      (FAKE_QUANT_COPIES: the CPU emulation's float32 temporaries, more for static
                      block scales than for dynamic ones; one output on CUDA)
    activations       one layer at a time in a no-grad forward: B·T·(ACT_EVAL_H·H + ACT_EVAL_F·F)·d,
    mamba_scan        and for Mamba-2 mixers the torch scan's B·T·chunk·heads·4·MAMBA_COPIES
    eval_stream       the streamed perplexity/KL pass (reference.py), chunks of c = LOGIT_CHUNK_TOKENS
                      positions (rounded to B): hidden_states B·T·H·d + the forward above (the
                      allocator keeps its freed blocks) + eval_logits c·V·(d + EVAL_LOGIT_BYTES)
                      + previous_chunk c·V·PREVIOUS_CHUNK_BYTES (still held by the loop), or in the
                      baseline reference_terms c·V·REFERENCE_WRITE_BYTES (top-k, tail samples)
    folded_originals  a quantized model's weights are fake-quantized once per evaluation, their
                      originals kept on the host: (Nw - V·H if the LM head is tied)·d
    lm_eval           lm_eval_harness LM_EVAL_HARNESS + B·R·V·d·LM_EVAL_LOGIT_COPIES + the forward,
                      R the longest request: LM_EVAL_PROJECT_TOKENS for the project's tasks, else
                      LM_EVAL_FOREIGN_TOKENS (lm-eval's default), capped by the model's maximum
    calibrate         PTQ's forward loop: B_c·T_c·V·d logits + the forward + fake_quant;
    mse_search        static recipes' per-block scale search: S·4·MSE_COPIES, or S·4·MSE_SWEEP_COPIES
                      when it also sweeps the FP8 scale (fp8_scale_sweep), S the elements searched at
                      once: ptq.mse_chunk_rows x the widest row, at most Nmax (null: Nmax, whole
                      weights; qad_pipeline/nvfp4/mse_chunks.py), + mse_block_amax Nmax/16·4·3 when
                      chunked (the largest weight's initial, chunked and concatenated block amax);
                      local_hessian searches whole weights (S = Nmax) and adds local_hessians
                      Σin·16·4 (a 16 x 16 Hessian per block)
    gptq              GPTQ's Hessians: Σin² · 4 over the weights the recipes quantize, all at once
                      (the largest decoder layer's with ptq.layerwise true), + the calibration
                      forward + per weight its inverse (in² · 4 · 2) and GPTQ_UPDATE_COPIES of it;
                      on the host original_weights Nw·d (the weight error is measured against them)
    qad (per process) teacher N·d + student_fp32 N·4 + grads N·4 + adamw 2·N·4 (all four divided by
                      the W = qad.num_gpus x qad.num_nodes processes with fsdp, plus two gathered
                      blocks and the gathered embeddings/LM head of both models (V·H once when
                      tied), and on the host with qad.offload; ddp adds ddp_buckets N·4); loading
                      under fsdp, the first process's host holds both whole models (rank0_ terms); + the
                      fake-quantized weights saved for backward Nw·a + activations
                      L·b·T·(ACT_TRAIN_H·H + ACT_TRAIN_F·F)·a (gradient checkpointing: Nw·a/L and
                      L·b·T·H·a + one layer) + kd_logits b·T·V·4·KD_LOGIT_COPIES, b the rows per
                      process, qad.batch_size / W
    export            the student + the exported tensors read back (at most N·d) + the weights
                      check's BF16 copy of the student's NVFP4 weights (at most Nw·2) + the
                      dequantized BF16 reload N·2 of the check (on the host whatever the device);
                      on the CPU, the serving check's vLLM process beside it (unless
                      export.serving_check is skip): VLLM_CPU_PROCESS + its KV-cache space
                      (VLLM_CPU_KVCACHE_SPACE) + the checkpoint's weights (at most N·d) + its
                      prompt logits and their log-softmax (prompts·positions·V·4·2); for an MoE
                      VLLM_CPU_MOE_REFUSED alone (vLLM's CPU build refuses NVFP4 experts before
                      it allocates: the check stops at the config level). On CUDA
                      vLLM's engine takes its share of the GPU (gpu_memory_utilization): not planned

On CUDA the model's terms go to `device_bytes` (per GPU, + CUDA_CONTEXT) and the host keeps the
process (+ CUDA_HOST_EXTRA) and what is copied to it (a checkpoint shard while saving, the
export's read-back); on the CPU everything is `host_bytes`. `hardware.device_map: auto` spreads
one model over the GPUs its process gets and offloads what they cannot hold to the host. The constants
were fitted on the CPU with `python benchmarks/memory_bench.py` (the demo model and a
100M-parameter Llama, each stage within 30 % of its measured peak RSS); the CUDA ones are
assumptions, not measurements. Memory-mapped files (the BF16 reference, checkpoints being read)
are reclaimable page cache and left out.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from qad_pipeline.core.config import Params, resolve
from qad_pipeline.core.stage_types import load_reference
from qad_pipeline.core.stages import STAGES
from qad_pipeline.plan.model_shape import ModelShape, model_shape  # noqa: F401  (re-exported: the plan's callers)
from qad_pipeline.nvfp4.recipe_algorithms import recipe_algorithm, weight_scale_algorithm  # also the plan's callers'

GiB, MiB = 2**30, 2**20
# Fitted on the CPU (torch 2.13, benchmarks/memory_bench.py); the module docstring names each term.
PROCESS_BASE = 600 * MiB          # a model stage's process before it loads anything
LIGHT_PROCESS_BASE = 540 * MiB    # calibration: tokenizer and datasets, no model
SELECTION_PROCESS = 620 * MiB     # selection: re-checks recipe aliases with Model Optimizer on the meta device (605 MB measured)
ACT_EVAL_H, ACT_EVAL_F = 6, 3     # one layer's live activations per token, no grad (x H, x F)
ACT_TRAIN_H, ACT_TRAIN_F = 16, 6  # saved for backward per layer per token (quantizer inputs included)
MAMBA_COPIES = 6
EVAL_LOGIT_BYTES = 8              # per [chunk, vocab] element: its float32 copy and the log-probs
PREVIOUS_CHUNK_BYTES = 2
REFERENCE_WRITE_BYTES = 7
LM_EVAL_HARNESS = 150 * MiB       # lm-eval's tasks, requests and results
LM_EVAL_LOGIT_COPIES = 2          # the logits and their log_softmax, in the model's dtype
LM_EVAL_PROJECT_TOKENS = 128      # heldout_cloze / heldout_continuation: 40 words + the continuation
LM_EVAL_FOREIGN_TOKENS = 2048     # lm-eval's default maximum length
KD_LOGIT_COPIES = 8               # float32 [tokens, vocab] blocks through the KD loss and its backward
FAKE_QUANT_COPIES = {"static": 2, "dynamic": 1}  # the CPU emulation's float32 temporaries (CUDA: 1)
MSE_COPIES = 6
MSE_SWEEP_COPIES = 22             # fitted (whole weights): nvfp4_mse on the 100M Llama peaked at 2,957 MiB
GPTQ_UPDATE_COPIES = 4            # per weight: its float32 copy, the quantized one, the errors, the update
LOGIT_CHUNK_TOKENS = 2048         # = qad_pipeline.scoring.reference.LOGIT_CHUNK_TOKENS (that module imports torch)
# CUDA, not measured: a process's context and workspaces per GPU, the host side of the CUDA
# runtime, and transformers' default checkpoint shard (each is copied to the host while saving).
CUDA_CONTEXT = 1 * GiB
CUDA_HOST_EXTRA = 1 * GiB
# the serving check's vLLM 0.32 process on the CPU without its KV cache: its two-layer models (the
# architecture matrix's families, benchmarks/memory_bench.py) peaked at 2,174-2,176 MiB with 1 GiB of KV cache
VLLM_CPU_PROCESS = 1150 * MiB
# ... and where it refuses the model as it builds it (an MoE: vLLM 0.32's CPU build has no NVFP4 fused-MoE
# kernel, serving/vllm_check.py CPU_LIMITS), before its KV cache or weights: the check stops at the config
# level. Fitted: the matrix's Qwen3-MoE export peaked at 1,532 MiB, its process and vLLM's summed
VLLM_CPU_MOE_REFUSED = 900 * MiB
SAVE_SHARD = 50 * 10**9
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


# -- each stage's phases --------------------------------------------------------------------------


@dataclass(frozen=True)
class Phase:
    """One moment of a stage: `resident` and `transient` terms live where the model runs, `host`
    terms on the host whatever the device; `knob` is the setting that scales the phase."""

    name: str
    knob: str | None
    resident: dict[str, int]
    transient: dict[str, int] = field(default_factory=dict)
    host: dict[str, int] = field(default_factory=dict)


def static_block_scales(recipe_path: Path) -> bool:
    """The recipe calibrates NVFP4 block scales statically (MSE, four-over-six, local Hessian,
    GPTQ), not by max (an AutoQuantize recipe: one of its candidate formats does)."""
    from qad_pipeline.nvfp4 import autoquant

    if autoquant.is_auto_quantize(recipe_path):
        return any(autoquant.format_algorithm(f) != "max" for f in autoquant.load_recipe(recipe_path).formats)
    return weight_scale_algorithm(recipe_path)["method"] != "max"


def scale_search(recipe_path: Path) -> bool:
    """The recipe searches each block's scale (MSE, local Hessian), not GPTQ's max then rounding."""
    return weight_scale_algorithm(recipe_path)["method"] in ("mse", "local_hessian")


def scale_sweep(recipe_path: Path) -> bool:
    """The recipe's scale search also sweeps the FP8 per-block scale (`fp8_scale_sweep: true`)."""
    return bool(weight_scale_algorithm(recipe_path).get("fp8_scale_sweep"))


def _any_static(params: Params) -> bool:
    """Whether the selected recipe (unknown before selection) may be a static one."""
    return any(static_block_scales(params.recipe_path(r)) for r in params.ptq.recipes)


def _weights(params: Params, shape: ModelShape, static: bool) -> dict[str, int]:
    out = {"weights": shape.params * DTYPE_BYTES[params.base_model.dtype]}
    return {**out, "quantizer_state": shape.matrix_params // 16 * 4} if static else out


def _forward(tokens: int, shape: ModelShape, nbytes: int) -> dict[str, int]:
    """The live activations of a no-grad forward (one layer at a time)."""
    out = {"activations": tokens * (ACT_EVAL_H * shape.hidden + ACT_EVAL_F * shape.ffn) * nbytes}
    if shape.mamba_layers:
        out["mamba_scan"] = tokens * shape.mamba_scan * 4 * MAMBA_COPIES
    return out


def _fake_quant(shape: ModelShape, device: str, static: bool) -> dict[str, int]:
    copies = FAKE_QUANT_COPIES["static" if static else "dynamic"] if device == "cpu" else 1
    return {"fake_quant": shape.largest_matrix * 4 * copies}


def _save_copy(params: Params, shape: ModelShape, device: str) -> dict[str, int]:
    """Saving from a GPU copies each checkpoint shard to the host (CPU tensors are written in place)."""
    weights = shape.params * DTYPE_BYTES[params.base_model.dtype]
    return {"save_shard": min(weights, SAVE_SHARD)} if device == "cuda" else {}


def _request_tokens(params: Params, shape: ModelShape) -> int:
    foreign = min(LM_EVAL_FOREIGN_TOKENS, shape.max_positions or LM_EVAL_FOREIGN_TOKENS)
    ours = resolve(params.eval.task_dir)
    return max(LM_EVAL_PROJECT_TOKENS if (ours / f"{t}.yaml").is_file() else foreign for t in params.eval.tasks)


def eval_phases(params: Params, shape: ModelShape, device: str, resident: dict[str, int],
                static: bool | None, writes_reference: bool = False) -> list[Phase]:
    """`evaluate_model` with `resident` loaded: the streamed perplexity/KL pass, then lm-eval.
    `static`: the model is quantized with static (True) or dynamic (False) block scales; None: BF16."""
    d, ev = DTYPE_BYTES[params.base_model.dtype], params.eval
    rows = min(ev.batch_size, ev.ppl_samples)
    step = min(ev.seq_len - 1, max(1, LOGIT_CHUNK_TOKENS // rows))
    chunk, chunks = rows * step, math.ceil(ev.ppl_samples / rows) * math.ceil((ev.seq_len - 1) / step)
    logits = {"eval_logits": chunk * shape.vocab * (d + EVAL_LOGIT_BYTES)}
    if writes_reference:
        logits["reference_terms"] = chunk * shape.vocab * REFERENCE_WRITE_BYTES
    elif chunks > 1:
        logits["previous_chunk"] = chunk * shape.vocab * PREVIOUS_CHUNK_BYTES
    fake_quant = _fake_quant(shape, device, static) if static is not None else {}
    # a quantized model's weights are fake-quantized once for the evaluation (weight_folding), their
    # originals stashed on the host: every quantized matrix but an LM head tied to the embeddings
    folded = shape.matrix_params - (shape.vocab * shape.hidden if shape.tied_embeddings else 0)
    host = {"folded_originals": folded * d} if static is not None else {}
    stream = {"hidden_states": rows * ev.seq_len * shape.hidden * d, **_forward(rows * ev.seq_len, shape, d),
              **logits, **fake_quant}
    r = _request_tokens(params, shape)
    lm_eval = {"lm_eval_harness": LM_EVAL_HARNESS, "lm_eval_logits": ev.batch_size * r * shape.vocab * d
               * LM_EVAL_LOGIT_COPIES, **_forward(ev.batch_size * r, shape, d), **fake_quant}
    return [Phase("eval_stream", "eval.batch_size", resident, stream, host),
            Phase("lm_eval", "eval.batch_size", resident, lm_eval, host)]


def baseline_phases(params: Params, shape: ModelShape, device: str, item: str | None = None) -> list[Phase]:
    return eval_phases(params, shape, device, _weights(params, shape, False), None, writes_reference=True)


def teacher_cache_phases(params: Params, shape: ModelShape, device: str, item: str | None = None) -> list[Phase]:
    """The BF16 teacher over QAD's training windows, eval.batch_size at a time, its logits in
    chunks of LOGIT_CHUNK_TOKENS positions written as top-k + tail (tasks/teacher_cache.py)."""
    d, rows, seq = DTYPE_BYTES[params.base_model.dtype], params.eval.batch_size, params.qad.seq_len
    chunk = rows * min(seq, max(1, LOGIT_CHUNK_TOKENS // rows))
    return [Phase("teacher_forward", "eval.batch_size", _weights(params, shape, False), {
        "hidden_states": rows * seq * shape.hidden * d, **_forward(rows * seq, shape, d),
        "eval_logits": chunk * shape.vocab * (d + EVAL_LOGIT_BYTES), "reference_terms": chunk * shape.vocab
        * REFERENCE_WRITE_BYTES})]


def _mse_search(params: Params, shape: ModelShape, recipe: str) -> dict[str, int]:
    """The scale search over one chunk of `ptq.mse_chunk_rows` rows (or the largest weight whole)."""
    path = params.recipe_path(recipe)
    copies = MSE_SWEEP_COPIES if scale_sweep(path) else MSE_COPIES
    # the local-Hessian metric is searched whole (qad_pipeline/nvfp4/mse_chunks.py chunks plain MSE only)
    rows = None if weight_scale_algorithm(path)["method"] == "local_hessian" else params.ptq.mse_chunk_rows
    searched = shape.largest_matrix if rows is None else min(shape.largest_matrix, rows * shape.widest_row)
    out = {"mse_search": searched * 4 * copies}
    if searched < shape.largest_matrix:
        out["mse_block_amax"] = shape.largest_matrix // 16 * 4 * 3
    return out


def _gptq(params: Params, shape: ModelShape) -> dict[str, int]:
    """GPTQ (Model Optimizer's `gptq`): an in x in float32 Hessian per quantized weight, filled by a
    calibration forward, all at once (one decoder layer's with ptq.layerwise true); then per weight
    the Hessian's inverse and the weight's float32 working copies."""
    held = shape.layer_hessian_elems if params.ptq.layerwise is True else shape.hessian_elems
    d, tokens = DTYPE_BYTES[params.base_model.dtype], params.ptq.calib_batch_size * params.calibration.seq_len
    return {"gptq_hessians": held * 4, "gptq_inverse": shape.widest_row ** 2 * 4 * 2,
            "gptq_update": shape.largest_matrix * 4 * GPTQ_UPDATE_COPIES,
            "calib_logits": tokens * shape.vocab * d, **_forward(tokens, shape, d)}


def ptq_phases(params: Params, shape: ModelShape, device: str, recipe: str) -> list[Phase]:
    static = static_block_scales(params.recipe_path(recipe))
    resident, d = _weights(params, shape, static), DTYPE_BYTES[params.base_model.dtype]
    tokens = params.ptq.calib_batch_size * params.calibration.seq_len
    phases = [Phase("calibrate", "ptq.calib_batch_size", resident, {
        "calib_logits": tokens * shape.vocab * d, **_forward(tokens, shape, d), **_fake_quant(shape, device, static)})]
    path = params.recipe_path(recipe)
    if scale_search(path):
        search = _mse_search(params, shape, recipe)
        if weight_scale_algorithm(path)["method"] == "local_hessian":  # a 16 x 16 Hessian per block, float32
            search["local_hessians"] = shape.quantized_inputs * 16 * 4
        chunked = weight_scale_algorithm(path)["method"] != "local_hessian"
        phases.append(Phase("mse_search", "ptq.mse_chunk_rows" if chunked else None, resident, search))
    if recipe_algorithm(path)["method"] == "gptq":
        originals = {"original_weights": shape.matrix_params * d}  # the weights before GPTQ rewrites them, on the host
        phases.append(Phase("gptq", "ptq.layerwise", resident, _gptq(params, shape), host=originals))
    return [*phases, *eval_phases(params, shape, device, resident, static),
            Phase("save", None, resident, host=_save_copy(params, shape, device))]


def _compute_dtype(setting: str, device: str) -> str:
    """`qad.compute_dtype` with `auto` resolved as tasks/qad.py does: bfloat16 on CUDA, float32 on CPU."""
    return setting if setting != "auto" else ("bfloat16" if device == "cuda" else "float32")


def qad_phases(params: Params, shape: ModelShape, device: str, item: str | None = None) -> list[Phase]:
    """One of the qad.num_gpus x qad.num_nodes processes (tasks/qad.py, qad_pipeline/training/distributed.py).

    ddp (or one process): each loads the whole teacher and the whole float32 student onto its
    device. fsdp: the first process reads both into host memory (`rank0_` terms, which the other
    processes do not have) and broadcasts them tensor by tensor; every process keeps a 1/W shard of
    the teacher, the student, its gradients and AdamW state (on the host with qad.offload), and
    gathers one decoder block at a time (the next prefetched) plus the root unit (embeddings and LM
    head) in the forward. Each trains on its qad.batch_size / W rows of every batch."""
    q = params.qad
    n, d, a, w = shape.params, DTYPE_BYTES[params.base_model.dtype], DTYPE_BYTES[_compute_dtype(q.compute_dtype, device)], q.processes
    sharded = w > 1 and q.sharding == "fsdp"
    shards, offload = (w, q.offload) if sharded else (1, False)
    tokens = max(1, q.batch_size // w) * q.seq_len
    state = {"quantizer_state": shape.matrix_params // 16 * 4} if _any_static(params) or q.learn_scales != "none" else {}
    live = q.teacher == "live"  # a cached teacher is read from disk, a batch at a time: no teacher, no teacher logits
    owned = {"teacher": n * d // shards if live else 0, "student_fp32": n * 4 // shards, "grads": n * 4 // shards,
             "adamw": 2 * n * 4 // shards}
    if q.learn_scales != "none":  # one float32 amax per block of 16 weights, learned: its gradient and AdamW state
        owned["learned_scales"] = shape.matrix_params // 16 * 4 * 3 // shards
    offloaded = {f"offloaded_{k}": v for k, v in owned.items()} if offload else {}
    trained = {**({} if offload else owned), **state}
    if w > 1 and q.sharding == "ddp":
        trained["ddp_buckets"] = n * 4
    if sharded:
        both = 4 + (d if live else 0)  # the student's float32 and the teacher's bytes per parameter
        trained["fsdp_gathered_blocks"] = 2 * (n // shape.layers) * both  # two blocks of each
        # the embeddings and the LM head (one matrix when tied, as Gemma's are)
        trained["fsdp_gathered_root"] = (1 if shape.tied_embeddings else 2) * shape.vocab * shape.hidden * both
    per_layer = tokens * (ACT_TRAIN_H * shape.hidden + ACT_TRAIN_F * shape.ffn) * a
    mamba = tokens * shape.mamba_scan * 4 * MAMBA_COPIES
    # Autograd keeps every fake-quantized weight for backward (also where FSDP has resharded the
    # weight itself); gradient checkpointing keeps each layer's input and recomputes one layer.
    if q.gradient_checkpointing:
        fake_quant_saved = shape.matrix_params * a // shape.layers
        activations = shape.layers * tokens * shape.hidden * a + per_layer + (mamba if shape.mamba_layers else 0)
    else:
        fake_quant_saved = shape.matrix_params * a
        activations = shape.layers * per_layer + shape.mamba_layers * mamba
    train = {"fake_quant_saved": fake_quant_saved, "activations": activations,
             "kd_logits": tokens * shape.vocab * 4 * (KD_LOGIT_COPIES - (0 if live else 1))}
    if not sharded:
        load = Phase("load", None, {"teacher": owned["teacher"], "student_fp32": n * 4, **state})
        save = _save_copy(params, shape, device)
    else:  # the first process reads both models on its host and broadcasts them, one tensor at a time
        load = Phase("load", None, {**({} if offload else {"teacher": owned["teacher"],
                                                            "student_fp32": owned["student_fp32"]}), **state},
                     {"broadcast_tensor": shape.largest_matrix * 4},
                     host={"rank0_teacher": owned["teacher"] * shards, "rank0_student_fp32": n * 4,
                           **{k: v for k, v in offloaded.items() if k in ("offloaded_teacher", "offloaded_student_fp32")}})
        # at the end FSDP gathers the full float32 state on rank 0's host, into a student it loads there
        save = {"rank0_full_state_dict": n * 4, "rank0_student_copy": n * 4}
    return [load, Phase("train", "qad.batch_size", trained, train, host=offloaded),
            Phase("save", None, trained, host={**offloaded, **save})]


def final_eval_phases(params: Params, shape: ModelShape, device: str, item: str | None = None) -> list[Phase]:
    static = _any_static(params)
    return eval_phases(params, shape, device, _weights(params, shape, static), static)


def export_phases(params: Params, shape: ModelShape, device: str, item: str | None = None) -> list[Phase]:
    resident = _weights(params, shape, _any_static(params))
    exported = shape.params * DTYPE_BYTES[params.base_model.dtype]  # at most: NVFP4 packs 4x smaller
    check_logits = 2 * params.eval.seq_len * shape.vocab * 4 * 3  # two windows, student and reload
    # the weights check's copy of the student's fake-quantized NVFP4 weights (at most the matrices,
    # BF16), held from before the export until the check, freed before the reload's model
    student_weights = shape.matrix_params * 2
    return [Phase("export", None, resident, host={"exported": exported, "student_nvfp4_weights": student_weights,
                                                  **_save_copy(params, shape, device)}),
            Phase("reload_check", None, resident, host={"exported_read_back": exported,
                                                        "dequantized_reload": shape.params * 2,
                                                        "check_logits": check_logits}),
            *_serving_check(params, shape, device, resident, exported)]


def _serving_check(params: Params, shape: ModelShape, device: str, resident: dict, exported: int) -> list[Phase]:
    """The export process holding the student and the exported tensors while the serving check's
    vLLM process serves the checkpoint beside it, on the CPU (on CUDA vLLM's memory is the GPU's)."""
    from qad_pipeline.checks.serving_reference import PROMPT_LEN, PROMPTS
    from qad_pipeline.checks.vllm_setup import cpu_kv_cache_gib

    if device != "cpu" or params.export.serving_check == "skip":
        return []
    if shape.routed_experts:  # every recipe quantizes the experts: vLLM refuses them as it builds the model
        vllm = {"vllm_process": VLLM_CPU_MOE_REFUSED}
    else:
        vllm = {"vllm_process": VLLM_CPU_PROCESS, "vllm_kv_cache": cpu_kv_cache_gib() * GiB, "vllm_weights": exported,
                # the prompt log-probs: float32 logits over the vocabulary at every prompt position, and their log-softmax
                "vllm_prompt_logits": PROMPTS * PROMPT_LEN * shape.vocab * 4 * 2}
    return [Phase("serving_check", None, resident, host={"exported_read_back": exported, **vllm})]


def sweep_phases(params: Params, shape: ModelShape, device: str, item: str | None = None) -> list[Phase]:
    """The sweep's search and each budget's point: PTQ with the sweep's AutoQuantize recipe."""
    return ptq_phases(params, shape, device, params.sweep.recipe)


def stage_memory(name: str) -> Callable[..., list[Phase]] | int:
    """A stage's memory model as its registry entry names it (`Stage.memory`): its phase function,
    or the bytes of a process that loads no model."""
    declared = STAGES.get(name)
    if declared is None or declared.memory is None:
        raise ValueError(f"no memory model for stage {name!r}: give its Stage a `memory` (qad_pipeline/core/stages.py)")
    return load_reference(declared.memory)


def stage_phases(stage: str, params: Params, shape: ModelShape, device: str) -> list[Phase]:
    """The phases of one stage process (`ptq/<recipe>`, `sweep/<budget>`, or a stage's name)."""
    name, _, item = stage.partition("/")
    model = stage_memory(name)
    if isinstance(model, int):
        raise ValueError(f"stage {name!r} loads no model: it has no phases")
    return model(params, shape, device, item or None)
