"""Quantization-aware distillation: `qad-pipeline stage qad`.

The student is the selected PTQ model, restored from its artifact with its quantizers and
calibrated scales (not calibrated again); the teacher is the BF16 base model, frozen, in eval
mode. The loss is Model Optimizer's `LogitsDistillationLoss`: KL divergence between the
teacher's and the student's next-token distributions at temperature T, with the student's
simulated quantization in every forward pass (straight-through gradients to its weights).

The loop, in full (`train_step`, `micro_step`): batch -> teacher (no grad) -> student -> KD loss ->
backward -> clip -> AdamW step -> schedule -> checkpoint. The student is saved in the base model's dtype.
`qad.chunked_loss` (default): the loss from the decoders' last hidden states, chunk by chunk of
positions, never [tokens x vocab] logits (`qad_pipeline/training/kd_loss.py`; FSDP2 keeps the full logits).
No host sync per step: the loss stays on the device and is read one step late (before a checkpoint is
written, all of it). `qad.compile`: `torch.compile` on each decoder block. benchmarks/qad_throughput.py
measures this loop.

Precision (`qad.compute_dtype`; `auto` is bfloat16 on CUDA and float32 on the CPU, where most
processors have no native bf16 and autocast is several times slower). The student's master weights
and AdamW state are float32 (a BF16 weight would swallow updates smaller than its 8-bit mantissa).
With `bfloat16` the student's forward and backward run under `torch.autocast(dtype=bfloat16)`:
matmuls in BF16 (the quantizers fake-quantize in float32 and hand BF16 on), gradients land in the
float32 weights. `float32` runs everything in float32. The teacher runs in the base model's dtype either way.

Memory (`qad.gradient_checkpointing`): transformers' gradient checkpointing, non-reentrant; each
decoder block's activations are recomputed in backward. A model class that transformers cannot
checkpoint is refused with a one-line error before training.

Several processes (`qad.num_gpus > 1`, or `qad.num_nodes > 1`; `qad_pipeline/training/distributed.py`).
`qad-pipeline stage qad` starts itself again under torchrun, one process per GPU (`--standalone`, or
a c10d rendezvous across nodes), so Prefect, `dvc repro`, a Kubeflow TrainJob and the tests run the
same command (`launch_processes`). Each process takes its own rows of each global batch
(`qad.batch_size` rows, split evenly), so the loss curve is the single-process one up to rounding;
the logged loss is the mean over processes. `qad.sharding` picks how both models are spread
(`load_spread`): `ddp` (the teacher and the student whole on every process; the student in torch's
DistributedDataParallel) or `fsdp` (FSDP2, `fully_shard` on each decoder block and the whole model,
for the student and for the frozen teacher; neither model is ever whole on a process's device;
`qad.offload` keeps the shards on the host). With `hardware.device: cpu` (or `auto` on a machine
without a GPU) the processes run on the CPU over gloo: that is the path the tests take
(tests/test_qad_distributed.py). Not tested here (no GPU): NCCL, and FSDP2 on GPUs.

torch's own DDP and `fully_shard`, not accelerate's `Accelerator`: accelerate (1.15) silently falls
back to DDP on CPU, so a CPU test through it would not exercise the sharded path at all.

Writes `<out>/model/` (the QAD student, with its quantizer state) and `<out>/loss.json`.
Checkpoints (`save_checkpoint`): every `qad.checkpoint_every` steps `<checkpoints>/last/` gets the
student's and AdamW's state through torch.distributed.checkpoint (each process writes its own
shard to `weights/`) and `state.pt` (step, loss curve, schedule, run key: tensors and plain values
only, loaded back with `weights_only=True`), whole or not at all.
Re-running after a crash resumes from it, with any number of processes (the checkpoint reader
reshards), as long as the training parameters and the student are the same. A NaN or infinite
loss stops training with the step named, keeping the last good checkpoint.
"""

from __future__ import annotations

import json
import math
import os
import random
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch.profiler import record_function
from tqdm import tqdm

from qad_pipeline.nvfp4 import learned_scales
from qad_pipeline.training import kd_loss
from qad_pipeline.core.artifacts import fingerprint, staged_dir
from qad_pipeline.core.config import ConfigError, Params, QADParams, StageError
from qad_pipeline.training.distributed import (
    World,
    held_bytes,
    join_world,
    launch_processes,
    load_spread,
    resume,
    save_checkpoint,
    submit_nodes,
    trained_student,
)
from qad_pipeline.core.layout import Layout
from qad_pipeline.core.modeling import input_device, load_tokenizer
from qad_pipeline.results.base import read_result, write_result
from qad_pipeline.results.qad_metrics import LossCurve, QADTraining
from qad_pipeline.results.selection_metrics import SelectionResult
from qad_pipeline.training.cached_teacher import TeacherCache
from qad_pipeline.training.trainjob import cluster_from_env
from qad_pipeline.training.training_text import batch_indices, training_windows

CHECKPOINT = "last"
# Parameters that change where and how fast QAD runs, not what it computes: a checkpoint made
# under one setting resumes under another.
# And the micro-batch (auto may choose another): steps are drawn whole, the run key holds their rows.
LAYOUT_KEYS = {"num_gpus", "sharding", "gradient_checkpointing", "checkpoint_every", "offload", "num_nodes",
               "rdzv_endpoint", "chunked_loss", "compile", "batch_size", "grad_accum", "effective_batch_size"}


class QADDiverged(StageError):
    """The loss became NaN or infinite."""


def check_student_matches_teacher(student_dir: Path, params: Params) -> None:
    """Architecture and vocabulary of the student artifact equal the teacher's, before training."""
    from transformers import AutoConfig, AutoTokenizer

    from qad_pipeline.core.modeling import load_config

    remote = params.base_model.trust_remote_code  # the student is the base model's class, with its code
    teacher_cfg = load_config(params.base_model)
    student_cfg = AutoConfig.from_pretrained(student_dir, trust_remote_code=remote)
    for key in ("model_type", "architectures", "vocab_size", "hidden_size", "num_hidden_layers"):
        t, s = getattr(teacher_cfg, key, None), getattr(student_cfg, key, None)
        if t != s:
            raise ConfigError(
                f"the student at {student_dir} does not belong to the teacher {params.base_model.path!r}: "
                f"{key} is {s!r} in the student and {t!r} in the teacher"
            )
    student_vocab = AutoTokenizer.from_pretrained(student_dir, trust_remote_code=remote).get_vocab()
    if student_vocab != load_tokenizer(params.base_model).get_vocab():
        raise ConfigError(f"the student at {student_dir} uses a different vocabulary than the teacher")


def lr_lambda(qad: QADParams):
    def factor(step: int) -> float:
        if step < qad.warmup_steps:
            return (step + 1) / (qad.warmup_steps + 1)
        progress = (step - qad.warmup_steps) / max(1, qad.steps - qad.warmup_steps)
        if qad.schedule == "cosine":
            return 0.5 * (1 + math.cos(math.pi * progress))
        if qad.schedule == "linear":
            return 1 - progress
        return 1.0

    return factor


def compute_dtype_for(qad: QADParams, device: torch.device) -> str:
    """`qad.compute_dtype`, with `auto` resolved: bfloat16 on CUDA, float32 on the CPU."""
    if qad.compute_dtype != "auto":
        return qad.compute_dtype
    return "bfloat16" if device.type == "cuda" else "float32"


def enable_gradient_checkpointing(student) -> None:
    if not student.supports_gradient_checkpointing:
        raise ConfigError(f"qad.gradient_checkpointing: transformers cannot checkpoint {type(student).__name__}; "
                          "set it to false")
    student.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


@dataclass
class QADStep:
    """What one optimizer step uses (`run_qad` builds it; so does benchmarks/qad_throughput.py)."""

    qad: QADParams
    student: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    student_device: torch.device
    teacher: torch.nn.Module | None = None  # None: the cached teacher
    teacher_device: torch.device | None = None
    cache: TeacherCache | None = None
    world: World = field(default_factory=World)
    sharded: bool = False  # FSDP2 over several processes
    compute_dtype: str = "float32"
    chunked: bool = True  # the chunked KD loss (qad_pipeline/training/kd_loss.py); False: from the full logits
    chunk_tokens: int = kd_loss.CHUNK_TOKENS


def to_device(batch: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Token ids on `device`; to a GPU through pinned memory, without waiting for the copy."""
    if device.type != "cuda":
        return batch.to(device)
    return batch.pin_memory().to(device, non_blocking=True)


def micro_step(s: QADStep, rows: np.ndarray, batch: torch.Tensor) -> torch.Tensor:
    """One micro-batch: the teacher's targets, the student's forward, the KD loss (its mean over
    positions / qad.grad_accum), backward. Returns that loss, detached, where it is: no host sync."""
    q, ids, teacher_out = s.qad, to_device(batch, s.student_device), None
    if s.cache is None:  # the live teacher: its last hidden state (chunked) or its logits
        teacher_ids = ids if s.teacher_device == s.student_device else to_device(batch, s.teacher_device)
        with torch.no_grad() if s.sharded else torch.inference_mode(), record_function("qad.teacher"):
            if s.chunked:
                teacher_out = s.teacher.base_model(input_ids=teacher_ids, use_cache=False).last_hidden_state
            else:
                teacher_out = s.teacher(input_ids=teacher_ids).logits.float()
        if s.sharded:
            s.teacher.reshard()  # FSDP2 keeps the root's gathered parameters for a backward that never comes
    autocast = torch.autocast(s.student_device.type, dtype=torch.bfloat16, enabled=s.compute_dtype == "bfloat16")
    with autocast, record_function("qad.student_forward"):  # with the chunked loss: the loss too (qad.kd_loss)
        if s.chunked:
            if s.cache is None:
                targets = kd_loss.live_targets(s.teacher, teacher_out.flatten(0, -2), q.temperature)
            else:
                targets = kd_loss.cached_targets(s.cache, rows, q.temperature, s.student_device)
            hidden = kd_loss.decoder_states(s.student, ids)
            head = getattr(s.student, "module", s.student).get_output_embeddings()
            loss = kd_loss.chunked_kd_mean(head, hidden, targets, s.chunk_tokens)
        else:
            student_logits = s.student(input_ids=ids).logits.float()
    if not s.chunked:
        with record_function("qad.kd_loss"):
            loss = full_logits_loss(s, rows, student_logits, teacher_out).mean()
    loss = loss / q.grad_accum
    with record_function("qad.backward"):
        loss.backward()
    return loss.detach()


def full_logits_loss(s: QADStep, rows: np.ndarray, student_logits, teacher_logits) -> torch.Tensor:
    """The per-position KD loss from the full logits (without `qad.chunked_loss`)."""
    if s.cache is None:
        from modelopt.torch.distill.losses import LogitsDistillationLoss

        kd = LogitsDistillationLoss(temperature=s.qad.temperature, reduction="none")  # per token
        return kd(student_logits, teacher_logits.to(student_logits.device))
    return s.cache.loss(rows, student_logits, s.qad.temperature)


def train_step(s: QADStep, windows: np.ndarray, stream) -> torch.Tensor:
    """One optimizer step over qad.grad_accum micro-batches of `stream`: [the global batch's loss, the
    gradient's norm before clipping] (float64, on the device: read it with `host_copy`), then clip,
    AdamW, schedule. The norm is what tells a summed gradient from an averaged one: AdamW and the
    clipping make the loss curve all but blind to the gradient's scale."""
    device = s.world.device if s.world.size > 1 else s.student_device
    total = torch.zeros((), dtype=torch.float64, device=device)
    step_rows, b = next(stream), s.qad.batch_size  # the step's rows (window indices), in micro-batches of b
    for i in range(s.qad.grad_accum):
        rows = s.world.rows(step_rows[i * b:(i + 1) * b])  # this process's rows of the micro-batch
        total += micro_step(s, rows, torch.from_numpy(windows[rows])).to(device)
    if s.world.size > 1:
        dist.all_reduce(total)
        total /= s.world.size  # the mean over the processes
    with record_function("qad.optimizer"):
        norm = torch.nn.utils.clip_grad_norm_(s.student.parameters(), 1.0)
        norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm  # FSDP2: a DTensor
        s.optimizer.step()
        s.scheduler.step()
        s.optimizer.zero_grad(set_to_none=True)
    return torch.stack([total, norm.to(total)])


def host_copy(value: torch.Tensor):
    """(`value`'s host copy, on its way; an event to wait for it or None): waiting for it later does not
    wait for the work queued after it."""
    if value.device.type != "cuda":
        return value, None
    copy, event = value.to("cpu", non_blocking=True), torch.cuda.Event()
    event.record()
    return copy, event


def compile_blocks(model) -> None:
    """`torch.compile` each decoder block (transformers' own block classes), in place."""
    blocks = set(getattr(model, "module", model)._no_split_modules or [])
    for module in model.modules():
        if type(module).__name__ in blocks:
            module.compile()


def run_qad(params: Params, student_dir: Path, data_dir: Path, out_dir: Path, checkpoint_dir: Path,
            teacher_cache: Path | None = None) -> dict:
    """Stage core: distil the BF16 teacher into the selected PTQ student; save it and its loss curve.
    `params` come settled (`qad-pipeline stage` settles each `auto` for its machine, a run passes its plan's)."""
    if not params.qad.settled:
        raise ConfigError("QAD's params hold auto: settle them first (qad_pipeline.plan.memory.settled_here)")
    qad = params.qad
    check_student_matches_teacher(student_dir, params)
    world = join_world(params)
    torch.manual_seed(qad.seed)
    random.seed(qad.seed)
    tokenizer = load_tokenizer(params.base_model)
    windows = training_windows(params, tokenizer, data_dir)

    # fsdp: the teacher and the student sharded over the processes; ddp: both whole on every process.
    # A cached teacher is read from the teacher_cache stage's files instead (qad_pipeline/training/cached_teacher.py).
    cache = TeacherCache(teacher_cache, params, windows) if qad.teacher == "cached" else None
    teacher = load_spread(params, world).requires_grad_(False).eval() if cache is None else None
    student = load_spread(params, world, folder=student_dir, dtype=torch.float32).train()
    if qad.gradient_checkpointing:
        enable_gradient_checkpointing(getattr(student, "module", student))  # DDP wraps it
    sharded = world.size > 1 and qad.sharding == "fsdp"
    student_device = world.device if sharded else input_device(getattr(student, "module", student))
    teacher_device = world.device if sharded or teacher is None else input_device(teacher)
    held = {"teacher_bytes": held_bytes(teacher) if teacher is not None else 0, "student_bytes": held_bytes(student)}
    optimizer = torch.optim.AdamW(  # fused: one kernel per step on a GPU (not with FSDP2's sharded tensors)
        [p for p in student.parameters() if p.requires_grad], lr=qad.lr, weight_decay=qad.weight_decay,
        fused=student_device.type == "cuda" and not sharded or None)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(qad))
    compute_dtype = compute_dtype_for(qad, student_device)
    for model in [m for m in (student, teacher) if m is not None and qad.compile]:
        compile_blocks(model)
    qad_step = QADStep(qad, student, optimizer, scheduler, student_device, teacher, teacher_device, cache, world,
                       sharded, compute_dtype, kd_loss.applies(qad, student, teacher, sharded))

    # A checkpoint resumes only the run that made it: same training parameters, same student files.
    student_files = [f"{f.name}:{f.stat().st_size}:{f.stat().st_mtime_ns}" for f in sorted(student_dir.iterdir())]
    run_key = fingerprint([json.dumps(params.model_dump(include={"base_model", "qad"}, exclude={"qad": LAYOUT_KEYS}),
                                      sort_keys=True), str(qad.batch_size * qad.grad_accum), str(student_dir),
                           *student_files])
    last = checkpoint_dir / CHECKPOINT
    start, losses = resume(last, world, student, optimizer, scheduler, run_key)

    stream = batch_indices(len(windows), qad.batch_size * qad.grad_accum, qad.seed, skip=start)
    started = time.time()
    bar = tqdm(range(start, qad.steps), initial=start, total=qad.steps, desc="qad", unit="step",
               disable=world.rank != 0)
    pending = []  # (step, its loss on its way to the host, event, lr): read one step late, not waited for

    def read_losses(upto: int) -> None:
        """Move the pending losses of steps <= `upto` into the curve; a NaN or infinite one stops training."""
        while pending and pending[0][0] <= upto:
            step_no, value, event, lr = pending.pop(0)
            if event is not None:
                event.synchronize()
            total, grad_norm = value.tolist()
            if not math.isfinite(total):
                saved = f"the last good checkpoint is {last}" if (last / "state.pt").is_file() else "no checkpoint yet"
                raise QADDiverged(
                    f"QAD loss is {total} at step {step_no}; training stopped ({saved}). "
                    "Lower qad.lr or check the training text."
                )
            losses.append({"step": step_no, "loss": total, "grad_norm": grad_norm, "lr": lr})
            bar.set_postfix(loss=f"{total:.5f}")

    for step in bar:
        total = train_step(qad_step, windows, stream)
        pending.append((step + 1, *host_copy(total), scheduler.get_last_lr()[0]))
        read_losses(step)  # the steps before this one: finished on the device by now
        if (step + 1) % qad.checkpoint_every == 0 and step + 1 < qad.steps:
            read_losses(step + 1)  # every loss up to the checkpoint is finite before it is written
            save_checkpoint(last, world, student, optimizer, scheduler, step + 1, losses, run_key)
    read_losses(qad.steps)
    seconds = time.time() - started

    tokens_per_step = qad.batch_size * qad.grad_accum * qad.seq_len
    result = {
        "steps": qad.steps,
        "resumed_from": start,
        "final_loss": losses[-1]["loss"],
        "first_loss": losses[0]["loss"],
        "steps_per_second": (qad.steps - start) / seconds if seconds > 0 else None,
        "tokens_per_step": tokens_per_step,
        "tokens_per_second": (qad.steps - start) * tokens_per_step / seconds if seconds > 0 else None,
        "seconds": seconds,
        "batch_size": qad.batch_size, "grad_accum": qad.grad_accum,
        "world_size": world.size,
        "sharding": qad.sharding if world.size > 1 else None,
        "compute_dtype": compute_dtype,
        "gradient_checkpointing": qad.gradient_checkpointing,
        "peak_gpu_memory_gb": torch.cuda.max_memory_allocated() / 2**30 if student_device.type == "cuda" else None,
        "offload": qad.offload if sharded else None,
        "teacher": qad.teacher,
        "num_nodes": qad.num_nodes,
        "learn_scales": qad.learn_scales, "learned_scales": len(learned_scales.quantizers_learning(student)),
        **held,
    }
    final = trained_student(student, world, params, student_dir)
    if world.rank == 0:
        from qad_pipeline.core.modeling import save_quantized

        with staged_dir(out_dir) as tmp:
            save_quantized(final, tokenizer, tmp / "model")
            write_result(tmp / "loss.json", QADTraining(losses=losses, **result))
        shutil.rmtree(checkpoint_dir, ignore_errors=True)  # done: the next run starts afresh
    world.barrier()
    if world.size > 1:
        dist.destroy_process_group()
    return result


def main(params: Params, layout: Layout, recipe: str | None = None) -> str | None:
    """The QAD stage: `qad-pipeline stage qad`; with qad.num_gpus > 1, torchrun runs this same
    command in that many processes."""
    selected = read_result(layout.selection_metrics, SelectionResult).selected
    if selected is None:
        raise ConfigError("no PTQ recipe was selected (see metrics/selection.json); QAD has no student")
    if params.qad.processes > 1 and "WORLD_SIZE" not in os.environ:
        cluster = cluster_from_env() if params.qad.num_nodes > 1 else None
        if cluster is None:  # torchrun here: this node's processes (joined with the others' with num_nodes > 1)
            launch_processes(params, layout.root)
        else:  # a pod of a cluster: the same command on num_nodes nodes, as a Kubeflow TrainJob
            submit_nodes(params, layout.root, cluster)
        return None
    result = run_qad(params, layout.candidate(selected) / "checkpoint", layout.data, layout.qad, layout.qad_checkpoints,
                     layout.teacher_cache)
    if int(os.environ.get("RANK", "0")) != 0:  # only the first of the torchrun processes reports
        return None
    write_result(layout.qad_loss, LossCurve(read_result(layout.qad / "loss.json", QADTraining).losses))
    return (f"qad: {result['steps']} steps, KD loss {result['first_loss']:.5f} -> {result['final_loss']:.5f}"
            + (f" ({result['world_size']} processes)" if result["world_size"] > 1 else ""))
