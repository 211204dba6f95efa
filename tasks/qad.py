"""Quantization-aware distillation: `qad-pipeline stage qad`.

The student is the selected PTQ model, restored from its artifact with its quantizers and
calibrated scales (not calibrated again); the teacher is the BF16 base model, frozen, in eval
mode. The loss is Model Optimizer's `LogitsDistillationLoss`: KL divergence between the
teacher's and the student's next-token distributions at temperature T, with the student's
simulated quantization in every forward pass (straight-through gradients to its weights).

The loop, in full: batch -> teacher logits (no grad) -> student logits -> KD loss -> backward
-> clip -> AdamW step -> schedule. The student trains in float32 (a BF16 weight would swallow
updates smaller than its 8-bit mantissa) and is saved in the base model's dtype.

Writes `<out>/model/` (the QAD student, with its quantizer state) and `<out>/loss.json`.
A checkpoint is kept every `qad.checkpoint_every` steps in `<checkpoints>/`; re-running after a
crash resumes from the last complete one. A NaN or infinite loss stops training with the step
named, keeping the last good checkpoint.
"""

from __future__ import annotations

import json
import math
import random
import shutil
import time
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from qad_pipeline.artifacts import fingerprint, read_json, staged_dir, write_json
from qad_pipeline.config import ConfigError, Params, StageError, QADParams
from qad_pipeline.modeling import DTYPES, load_model, load_tokenizer

CHECKPOINT = "last"


class QADDiverged(StageError):
    """The loss became NaN or infinite."""


def check_student_matches_teacher(student_dir: Path, params: Params) -> None:
    """Architecture and vocabulary of the student artifact equal the teacher's, before training."""
    from transformers import AutoConfig, AutoTokenizer

    from qad_pipeline.modeling import load_config

    teacher_cfg, student_cfg = load_config(params.base_model), AutoConfig.from_pretrained(student_dir)
    for key in ("model_type", "architectures", "vocab_size", "hidden_size", "num_hidden_layers"):
        t, s = getattr(teacher_cfg, key, None), getattr(student_cfg, key, None)
        if t != s:
            raise ConfigError(
                f"the student at {student_dir} does not belong to the teacher {params.base_model.path!r}: "
                f"{key} is {s!r} in the student and {t!r} in the teacher"
            )
    if AutoTokenizer.from_pretrained(student_dir).get_vocab() != load_tokenizer(params.base_model).get_vocab():
        raise ConfigError(f"the student at {student_dir} uses a different vocabulary than the teacher")


def training_windows(params: Params, tokenizer, data_dir: Path) -> np.ndarray:
    """QAD training text at qad.seq_len: the calibration documents unless qad.source is set."""
    from qad_pipeline.tasks.calibration import read_documents, token_windows

    cal = params.calibration
    if params.qad.source is None:
        docs = read_documents(cal)
        docs = [docs[i] for i in read_json(Path(data_dir) / "manifest.json")["calibration_documents"]]
    else:
        docs = read_documents(cal.model_copy(update={"source": params.qad.source}))
    windows = token_windows(docs, tokenizer, params.qad.seq_len)
    if len(windows) < params.qad.batch_size:
        raise ConfigError(
            f"QAD training text yields {len(windows)} windows of qad.seq_len = {params.qad.seq_len} tokens, "
            f"fewer than one batch of {params.qad.batch_size}"
        )
    return windows


def batches(windows: np.ndarray, batch_size: int, seed: int, skip: int):
    """An endless, seeded stream of batches, reshuffled every epoch; `skip` fast-forwards (resume)."""
    rng = np.random.default_rng(seed)
    n = 0
    while True:
        order = rng.permutation(len(windows))
        for i in range(0, len(order) - batch_size + 1, batch_size):
            if n >= skip:
                yield torch.from_numpy(windows[order[i : i + batch_size]])
            n += 1


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


def load_student(student_dir: Path):
    """The PTQ model with its quantizers and calibrated scales, in float32 for training."""
    import modelopt.torch.opt as mto
    from transformers import AutoModelForCausalLM

    mto.enable_huggingface_checkpointing()
    student = AutoModelForCausalLM.from_pretrained(student_dir, dtype=torch.float32)
    student.config.use_cache = False
    return student


def save_checkpoint(folder: Path, student, optimizer, scheduler, step: int, losses: list[dict], run_key: str) -> None:
    """Everything needed to resume, written whole or not at all."""
    with staged_dir(folder) as tmp:
        torch.save(
            {"model": student.state_dict(), "optimizer": optimizer.state_dict(),
             "scheduler": scheduler.state_dict(), "step": step, "losses": losses, "run_key": run_key},
            tmp / "state.pt",
        )


def run_qad(params: Params, student_dir: Path, data_dir: Path, out_dir: Path, checkpoint_dir: Path) -> dict:
    """Stage core: distil the BF16 teacher into the selected PTQ student; save it and its loss curve."""
    import qad_pipeline  # noqa: F401  (CPU NVFP4 kernels when there is no GPU)
    from modelopt.torch.distill.losses import LogitsDistillationLoss

    qad = params.qad
    check_student_matches_teacher(student_dir, params)
    torch.manual_seed(qad.seed)
    random.seed(qad.seed)
    tokenizer = load_tokenizer(params.base_model)
    windows = training_windows(params, tokenizer, data_dir)

    teacher = load_model(params.base_model, params.hardware).requires_grad_(False).eval()
    student = load_student(student_dir).train()
    optimizer = torch.optim.AdamW(
        [p for p in student.parameters() if p.requires_grad], lr=qad.lr, weight_decay=qad.weight_decay
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(qad))
    kd_loss = LogitsDistillationLoss(temperature=qad.temperature, reduction="none")  # per token

    # A checkpoint resumes only the run that made it: same parameters, same student files.
    student_files = [f"{f.name}:{f.stat().st_size}:{f.stat().st_mtime_ns}" for f in sorted(student_dir.iterdir())]
    run_key = fingerprint([json.dumps(params.model_dump(include={"base_model", "qad"}), sort_keys=True),
                           str(student_dir), *student_files])
    start, losses = 0, []
    last = checkpoint_dir / CHECKPOINT
    if (last / "state.pt").is_file():
        state = torch.load(last / "state.pt", weights_only=False)
        if state.get("run_key") != run_key:
            print(f"qad: ignoring the checkpoint in {last}: it was made with other parameters or another student")
        else:
            student.load_state_dict(state["model"])
            optimizer.load_state_dict(state["optimizer"])
            scheduler.load_state_dict(state["scheduler"])
            start, losses = state["step"], state["losses"]
            print(f"qad: resuming from the checkpoint at step {start} ({last})", flush=True)

    stream = batches(windows, qad.batch_size, qad.seed, skip=start * qad.grad_accum)
    started = time.time()
    bar = tqdm(range(start, qad.steps), initial=start, total=qad.steps, desc="qad", unit="step")
    for step in bar:
        total = 0.0
        for _ in range(qad.grad_accum):
            batch = next(stream)
            with torch.no_grad():
                teacher_logits = teacher(input_ids=batch).logits.float()
            student_logits = student(input_ids=batch).logits.float()
            loss = kd_loss(student_logits, teacher_logits).mean() / qad.grad_accum
            loss.backward()
            total += loss.item()
        if not math.isfinite(total):
            saved = f"the last good checkpoint is {last}" if (last / "state.pt").is_file() else "no checkpoint yet"
            raise QADDiverged(
                f"QAD loss is {total} at step {step + 1}; training stopped ({saved}). "
                "Lower qad.lr or check the training text."
            )
        torch.nn.utils.clip_grad_norm_(student.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append({"step": step + 1, "loss": total, "lr": scheduler.get_last_lr()[0]})
        bar.set_postfix(loss=f"{total:.5f}")
        if (step + 1) % qad.checkpoint_every == 0 and step + 1 < qad.steps:
            save_checkpoint(last, student, optimizer, scheduler, step + 1, losses, run_key)
    seconds = time.time() - started

    student = student.to(DTYPES[params.base_model.dtype]).eval()
    result = {
        "steps": qad.steps,
        "resumed_from": start,
        "final_loss": losses[-1]["loss"],
        "first_loss": losses[0]["loss"],
        "steps_per_second": (qad.steps - start) / seconds if seconds > 0 else None,
        "tokens_per_step": qad.batch_size * qad.grad_accum * qad.seq_len,
        "seconds": seconds,
    }
    from qad_pipeline.tasks.ptq import save_quantized

    with staged_dir(out_dir) as tmp:
        save_quantized(student, tokenizer, tmp / "model")
        write_json(tmp / "loss.json", {"losses": losses, **result})
    shutil.rmtree(checkpoint_dir, ignore_errors=True)  # done: the next run starts afresh
    return result
