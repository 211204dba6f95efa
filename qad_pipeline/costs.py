"""Disk and wall time of each stage, from the model's shapes and the settings: the plan's
`disk_bytes` and `seconds` (`qad-pipeline plan`, above all with `--target`).

Disk, per stage, what it writes under the out-root (its peak, while it runs):

    calibration   the token ids: (num_samples + ppl_samples) x seq_len x 8 (int64, Arrow)
    baseline      the BF16 reference: ppl_samples x eval.seq_len positions x
                  (kl_top_k + kl_tail_samples) x 8 (int32 id, float32 log-prob) + 4
    ptq, sweep    the fake-quantized checkpoint: N x d (+ Nw/16 x 4 of static block scales)
    qad           its resume checkpoint, student and AdamW state in float32 (N x 12), twice while a
                  new one is written beside the last; then the student, as its recipe's checkpoint
                  (`kept_bytes`: what stays once the checkpoints are removed)
    export        NVFP4 everywhere: Nw x 4.5 / 8 (+ the input embeddings at d); a recipe that keeps
                  layers in FP8 or BF16 writes more, up to the BF16 size; and the serving check's
                  reference log-probs (`serving_reference.reference_bytes`: before compression, the
                  bound the export itself reserves)
    the rest      their JSON files (counted as 0)

Every checkpoint (ptq, sweep, qad, export) holds the base model's tokenizer files too
(`sizes.tokenizer_bytes`).

Wall time, per stage, FLOPs over a throughput: 2 x Na FLOPs per token for a forward, 8 x Na for
a QAD token (the teacher's forward, the student's forward and backward; 6 x Na with a cached teacher,
whose forward is the teacher_cache stage's), Na the matrix weights a
token goes through (a MoE's routed experts: only its own). The throughput is the GPU's dense BF16
peak (`targets.GPUS`) times a model-FLOPs utilisation: EVAL_MFU for forwards (calibration,
evaluation); for QAD the figure measured on the target's GPU (MEASURED_QAD_MFU) where there is one,
else TRAIN_MFU (`train_mfu`; the plan says which), on its qad.num_gpus x qad.num_nodes GPUs at once
(qad.offload's host-side optimizer step is not modelled). A recipe spread over several GPUs
by `device_map: auto` runs them one after another (accelerate's pipeline): one GPU's throughput.
Tokens: the calibration samples (PTQ), and each evaluation's perplexity/KL windows and lm-eval
tokens (`qad_pipeline.eval_costs`: the project's tasks, the standard suite's estimated tokens; any
other registry task is not counted, the plan says so). With racing a PTQ recipe evaluates round 1's
items and the race stage is priced at its worst case (every recipe finishes every round).
The export is bounded by the disk: twice its bytes (written, read back) at DISK_BYTES_PER_S.
Model Optimizer's MSE / four-over-six scale searches and AutoQuantize's scoring are not counted.
EVAL_MFU, TRAIN_MFU and the disk speed are assumptions, not measurements.
"""

from __future__ import annotations

from qad_pipeline.config import Params
from qad_pipeline.eval_costs import EvalCost, stage_cost, summary
from qad_pipeline.memory_model import DTYPE_BYTES, ModelShape, model_shape, static_block_scales
from qad_pipeline.serving_reference import PROMPT_LEN, PROMPTS, reference_bytes
from qad_pipeline.sizes import tokenizer_bytes

EVAL_MFU = 0.25                # forwards through transformers with fake quantization (assumed)
TRAIN_MFU = 0.30               # QAD: FSDP2, fake quantization, a KD loss over the vocabulary (assumed)
DISK_BYTES_PER_S = 2e9         # a local NVMe or a parallel filesystem (assumed)
# QAD's MFU measured per GPU (a `targets.GPUS` name): `python benchmarks/qad_throughput.py --device cuda`
# (a ~1B Llama, sequence 4096, NVFP4 student, live teacher; MFU as that benchmark counts it). Each entry
# says where it comes from: date, tree, GPU, software, tokens/s. Empty: no GPU measurement yet.
MEASURED_QAD_MFU: dict[str, float] = {}


def train_mfu(gpu: str | None) -> tuple[float, str]:
    """(QAD's MFU on `gpu`, where the figure comes from): measured, else TRAIN_MFU, assumed."""
    if gpu in MEASURED_QAD_MFU:
        return MEASURED_QAD_MFU[gpu], f"measured on {gpu}"
    return TRAIN_MFU, "assumed"


def target_gpu(target: str | None) -> str | None:
    """The GPU name (`targets.GPUS`) of a plan's target node (None: this machine, not named)."""
    from qad_pipeline.targets import parse

    return parse(target).gpu if target else None


def eval_seconds(cost: EvalCost | None, shape: ModelShape, bf16_flops: float | None) -> float | None:
    """Estimated seconds of one GPU running `cost`'s tokens (None: no GPU to estimate for)."""
    if bf16_flops is None or cost is None:
        return None if bf16_flops is None else 0.0
    return 2 * shape.active_matrix_params * cost.total_tokens / (bf16_flops * EVAL_MFU)


def eval_lines(estimates: list, params: Params, bf16_flops: float | None) -> list[str]:
    """The plan's lines on evaluation (`eval_costs.summary`): each evaluating stage process of
    `estimates` (the plan's), its GPU-hours of evaluation its seconds times the GPUs it holds."""
    shape, rows = model_shape(params.base_model), []
    for est in estimates:
        cost = stage_cost(est.stage, params)
        if cost is not None:
            seconds = eval_seconds(cost, shape, bf16_flops)
            rows.append((est.stage, cost, None if seconds is None else seconds * max(1, len(est.gpus)) / 3600))
    return summary(params, rows)


def disk_bytes(stage: str, params: Params, shape: ModelShape) -> int:
    """The peak bytes `stage` (`ptq/<recipe>`, `qad`, ...) writes under the out-root."""
    name, _, item = stage.partition("/")
    d = DTYPE_BYTES[params.base_model.dtype]
    if name == "calibration":
        return (params.calibration.num_samples + params.eval.ppl_samples) * params.calibration.seq_len * 8
    if name == "baseline":
        ev = params.eval
        return ev.ppl_samples * ev.seq_len * ((ev.kl_top_k + ev.kl_tail_samples) * 8 + 4)
    if name in ("ptq", "sweep"):
        recipe = item if name == "ptq" else params.sweep.recipe
        scales = shape.matrix_params // 16 * 4 if static_block_scales(params.recipe_path(recipe)) else 0
        return shape.params * d + scales + tokenizer_bytes(params.base_model)
    if name == "qad":
        return 2 * shape.params * 12 + kept_bytes(name, params, shape)
    if name == "teacher_cache":  # per token of the windows QAD draws (at most all its steps' tokens)
        q = params.qad
        return q.steps * q.grad_accum * q.batch_size * q.seq_len * (8 * (q.teacher_top_k + q.teacher_tail_samples) + 4)
    if name == "export":
        return (export_bytes(params, shape) + tokenizer_bytes(params.base_model)
                + reference_bytes(PROMPTS, PROMPT_LEN, shape.vocab))
    return 0


def kept_bytes(stage: str, params: Params, shape: ModelShape) -> int:
    """The bytes `stage` leaves under the out-root when it is done: its peak, less QAD's resume
    checkpoints (artifacts/qad_checkpoints/, removed once the student is saved in the format of the
    candidate it trained: the largest of the recipes' checkpoints)."""
    if stage == "qad":
        return max(disk_bytes(f"ptq/{recipe}", params, shape) for recipe in params.ptq.recipes)
    return disk_bytes(stage, params, shape)


def export_bytes(params: Params, shape: ModelShape) -> int:
    embeddings = shape.params - shape.matrix_params
    return shape.matrix_params * 9 // 16 + embeddings * DTYPE_BYTES[params.base_model.dtype]


def seconds(stage: str, params: Params, shape: ModelShape, bf16_flops: float | None,
            gpu: str | None = None) -> float | None:
    """Estimated wall time of one process of `stage` on GPUs of `bf16_flops` dense BF16 peak each, named
    `gpu` where known (None: no GPU to estimate for; 0: a stage that loads no model)."""
    name = stage.partition("/")[0]
    if bf16_flops is None:
        return None
    forward = 2 * shape.active_matrix_params  # FLOPs per token
    per_gpu_eval = bf16_flops * EVAL_MFU
    evaluation = eval_seconds(stage_cost(stage, params), shape, bf16_flops)
    # the race: its worst case (every recipe finishes); the served eval: the BF16 model and the export
    if name in ("baseline", "final_eval", "race", "served_eval"):
        return evaluation
    if name in ("ptq", "sweep", "sweep_search"):  # with racing, a recipe's round 1
        calib = params.calibration.num_samples * params.calibration.seq_len
        return forward * calib / per_gpu_eval + evaluation
    q = params.qad
    tokens = q.steps * q.batch_size * q.grad_accum * q.seq_len
    if name == "qad":  # the teacher's forward, the student's forward and backward; 3 without the teacher
        return (4 if q.teacher == "live" else 3) * forward * tokens / (bf16_flops * train_mfu(gpu)[0] * q.processes)
    if name == "teacher_cache":
        return forward * tokens / per_gpu_eval
    if name == "export":
        return 2 * export_bytes(params, shape) / DISK_BYTES_PER_S
    return 0.0
