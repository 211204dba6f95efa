"""Disk and wall time of each stage, from the model's shapes and the settings: the plan's
`disk_bytes` and `seconds` (`qad-pipeline plan`, above all with `--target`).

Each stage's cost model is the `CostModel` its `Stage.cost` names (below); the plan asks for it by the
stage's summary key, and an unknown stage, or one that declares no cost model, is an error.

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
tokens (`qad_pipeline.plan.eval_costs`: the project's tasks, the standard suite's estimated tokens; any
other registry task is not counted, the plan says so). With racing a PTQ recipe evaluates round 1's
items and the race stage is priced at its worst case (every recipe finishes every round).
The export is bounded by the disk: twice its bytes (written, read back) at DISK_BYTES_PER_S.
A GPTQ recipe adds its Hessian pass (one more calibration forward, and 2·in² FLOPs per token and
quantized weight for X·Xᵀ, at EVAL_MFU) and its weight update (`ModelShape.gptq_update_flops` at
GPTQ_UPDATE_MFU, plus GPTQ_COLUMN_S per weight column: the update rounds one column at a time).
Model Optimizer's MSE / four-over-six / local-Hessian scale searches and AutoQuantize's scoring are
not counted. EVAL_MFU, TRAIN_MFU, the GPTQ constants and the disk speed are assumptions, not
measurements.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from qad_pipeline.core.config import Params
from qad_pipeline.plan.eval_costs import EvalCost, stage_cost, summary
from qad_pipeline.plan.memory_model import DTYPE_BYTES, ModelShape, model_shape, recipe_algorithm, static_block_scales
from qad_pipeline.checks.serving_reference import PROMPT_LEN, PROMPTS, reference_bytes
from qad_pipeline.nvfp4.sizes import tokenizer_bytes
from qad_pipeline.core.stages import stage_of

EVAL_MFU = 0.25                # forwards through transformers with fake quantization (assumed)
TRAIN_MFU = 0.30               # QAD: FSDP2, fake quantization, a KD loss over the vocabulary (assumed)
GPTQ_UPDATE_MFU = 0.05         # GPTQ's float32 block updates and Cholesky, of the dense BF16 peak (assumed)
GPTQ_COLUMN_S = 1e-4           # per weight column: GPTQ rounds and propagates one column at a time (assumed)
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
    from qad_pipeline.core.targets import parse

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
    """The peak bytes one process of `stage` (`ptq/<recipe>`, `qad`, ...) writes under the out-root:
    its cost model's (`Stage.cost`); an unknown stage, or one without a cost model, is an error."""
    declared, item = stage_of(stage)
    return declared.load("cost").disk(params, shape, item)


def kept_bytes(stage: str, params: Params, shape: ModelShape) -> int:
    """The bytes `stage` leaves under the out-root when it is done: its peak, less what it removes
    (QAD's resume checkpoints: `CostModel.kept`)."""
    declared, item = stage_of(stage)
    model = declared.load("cost")
    return (model.kept or model.disk)(params, shape, item)


def seconds(stage: str, params: Params, shape: ModelShape, bf16_flops: float | None,
            gpu: str | None = None) -> float | None:
    """Estimated wall time of one process of `stage` on GPUs of `bf16_flops` dense BF16 peak each, named
    `gpu` where known (None: no GPU to estimate for; 0: a stage that loads no model)."""
    declared, item = stage_of(stage)
    model = declared.load("cost")
    if bf16_flops is None:
        return None
    return model.seconds(Work(params, shape, bf16_flops, gpu, eval_seconds(stage_cost(stage, params), shape, bf16_flops),
                              item))


# -- the cost models: each stage's `cost` names one ------------------------------------------------


@dataclass(frozen=True)
class Work:
    """What a cost model's wall time is computed from: the params, the model, the GPU (its dense BF16
    peak, its name where known) and the seconds of the stage's own evaluation (`Stage.eval_cost`)."""

    params: Params
    shape: ModelShape
    bf16_flops: float
    gpu: str | None
    evaluation: float
    item: str | None = None  # the stage's recipe (ptq), budget (sweep) or None

    @property
    def forward(self) -> float:
        return 2 * self.shape.active_matrix_params  # FLOPs per token

    @property
    def qad_tokens(self) -> int:
        q = self.params.qad
        return q.steps * rows_per_step(q) * q.seq_len


def rows_per_step(q) -> int:
    """What one QAD optimizer step trains on, whether the plan has settled `qad.batch_size` or not."""
    return q.effective_batch_size if q.batch_size == "auto" else q.batch_size * q.grad_accum


def _no_bytes(params: Params, shape: ModelShape, item: str | None) -> int:
    return 0


def _no_time(work: Work) -> float:
    return 0.0


@dataclass(frozen=True)
class CostModel:
    """A stage's plan cost: the peak bytes one process writes under the out-root, `(params, shape,
    item)`; what stays when it is done (None: its peak); its wall time, `(Work)`."""

    disk: Callable[[Params, ModelShape, str | None], int] = _no_bytes
    seconds: Callable[[Work], float] = _no_time
    kept: Callable[[Params, ModelShape, str | None], int] | None = None


def token_bytes(params: Params, shape: ModelShape, item: str | None) -> int:
    return (params.calibration.num_samples + params.eval.ppl_samples) * params.calibration.seq_len * 8


def reference_bytes_bf16(params: Params, shape: ModelShape, item: str | None) -> int:
    ev = params.eval
    return ev.ppl_samples * ev.seq_len * ((ev.kl_top_k + ev.kl_tail_samples) * 8 + 4)


def checkpoint_bytes(params: Params, shape: ModelShape, recipe: str) -> int:
    """A fake-quantized checkpoint of `recipe`, with its static block scales and the tokenizer."""
    scales = shape.matrix_params // 16 * 4 if static_block_scales(params.recipe_path(recipe)) else 0
    return shape.params * DTYPE_BYTES[params.base_model.dtype] + scales + tokenizer_bytes(params.base_model)


def recipe_checkpoint(params: Params, shape: ModelShape, item: str | None) -> int:
    return checkpoint_bytes(params, shape, item)


def sweep_checkpoint(params: Params, shape: ModelShape, item: str | None) -> int:
    return checkpoint_bytes(params, shape, params.sweep.recipe)


def qad_kept(params: Params, shape: ModelShape, item: str | None) -> int:
    """The student in the format of the candidate it trained: the largest of the recipes' checkpoints."""
    return max(checkpoint_bytes(params, shape, recipe) for recipe in params.ptq.recipes)


def qad_bytes(params: Params, shape: ModelShape, item: str | None) -> int:
    return 2 * shape.params * 12 + qad_kept(params, shape, item)


def teacher_cache_bytes(params: Params, shape: ModelShape, item: str | None) -> int:
    """Per token of the windows QAD draws (at most all its steps' tokens)."""
    q = params.qad
    return q.steps * rows_per_step(q) * q.seq_len * (8 * (q.teacher_top_k + q.teacher_tail_samples) + 4)


def export_disk(params: Params, shape: ModelShape, item: str | None) -> int:
    return (export_bytes(params, shape) + tokenizer_bytes(params.base_model)
            + reference_bytes(PROMPTS, PROMPT_LEN, shape.vocab))


def export_bytes(params: Params, shape: ModelShape) -> int:
    embeddings = shape.params - shape.matrix_params
    return shape.matrix_params * 9 // 16 + embeddings * DTYPE_BYTES[params.base_model.dtype]


def evaluating(work: Work) -> float:
    """Its evaluation (the race: its worst case; the served eval: the BF16 model and the export)."""
    return work.evaluation


def calibrating(work: Work) -> float:
    """Calibration's forwards, then its evaluation (with racing, a recipe's round 1)."""
    calib = work.params.calibration.num_samples * work.params.calibration.seq_len
    return work.forward * calib / (work.bf16_flops * EVAL_MFU) + work.evaluation


def quantizing(work: Work) -> float:
    """A PTQ recipe: `calibrating`, and a GPTQ recipe's Hessian pass and weight update."""
    path = work.params.recipe_path(work.item)
    if not path.is_file() or recipe_algorithm(path)["method"] != "gptq":  # (the preflight refuses a missing one)
        return calibrating(work)
    shape, calib = work.shape, work.params.calibration.num_samples * work.params.calibration.seq_len
    hessian_pass = (work.forward + 2 * shape.hessian_elems) * calib / (work.bf16_flops * EVAL_MFU)
    return (calibrating(work) + hessian_pass + shape.gptq_update_flops / (work.bf16_flops * GPTQ_UPDATE_MFU)
            + shape.quantized_inputs * GPTQ_COLUMN_S)


def training(work: Work) -> float:
    """The teacher's forward, the student's forward and backward; 3 forwards' worth without the teacher."""
    q = work.params.qad
    flops = (4 if q.teacher == "live" else 3) * work.forward * work.qad_tokens
    return flops / (work.bf16_flops * train_mfu(work.gpu)[0] * q.processes)


def teacher_forward(work: Work) -> float:
    return work.forward * work.qad_tokens / (work.bf16_flops * EVAL_MFU)


def disk_bound(work: Work) -> float:
    return 2 * export_bytes(work.params, work.shape) / DISK_BYTES_PER_S


CALIBRATION = CostModel(disk=token_bytes)
BASELINE = CostModel(disk=reference_bytes_bf16, seconds=evaluating)
PTQ = CostModel(disk=recipe_checkpoint, seconds=quantizing)
SWEEP_SEARCH = CostModel(seconds=calibrating)
SWEEP = CostModel(disk=sweep_checkpoint, seconds=calibrating)
TEACHER_CACHE = CostModel(disk=teacher_cache_bytes, seconds=teacher_forward)
QAD = CostModel(disk=qad_bytes, seconds=training, kept=qad_kept)
EVALUATION = CostModel(seconds=evaluating)
EXPORT = CostModel(disk=export_disk, seconds=disk_bound)
JSON_ONLY = CostModel()  # a stage that writes JSON files (counted as 0) and loads no model
