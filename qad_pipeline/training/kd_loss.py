"""QAD's distillation loss without [tokens x vocab] logits held for backward (`qad.chunked_loss`).

What it computes is what `tasks/qad.py` computed from the full logits: the mean over the micro-batch's
positions of Model Optimizer's `LogitsDistillationLoss(temperature=T, reduction="none")`, i.e. per
position T^2 KL(p || q) with p = softmax(teacher / T), q = softmax(student / T) (forward KL, the
teacher's distribution as the target, T^2 applied); or, with the cached teacher, the same estimate
`TeacherCache.loss` computes (`teacher_cache.py`'s docstring). The full-logits path built a float32
[tokens x vocab] tensor for the student and one for the teacher, and autograd kept several of that
size until backward: at 16K tokens and a 128K vocabulary, 8 GiB each.

How. The decoder runs to its last hidden state (the model's `base_model`); the student's output
embedding is applied here, the way Model Optimizer's `QuantLinear` applies it: its input quantizer on
the hidden states, its weight quantizer on the weight (once per micro-batch, not once per chunk; its
straight-through gradient reaches the weight through autograd, outside this module), then
`F.linear`. The positions are taken `chunk_tokens` at a time (`_ChunkedKD`): each chunk's student
logits, its teacher logits (from the teacher's hidden states and output embedding, or the cache's
rows), the per-position loss and, through a local autograd graph of exactly those operations, the
gradients of (loss / positions) with respect to the chunk's hidden states, the weight and the bias,
all in forward. Only those gradients ([tokens x hidden] and [vocab x hidden]) are kept for backward,
which scales them by the incoming gradient. No logits are recomputed (torch.utils.checkpoint per
chunk would run the student's and the teacher's output embedding twice: ~10 % more FLOPs on a 1B
Llama with a 128K vocabulary). The same operations as the full-logits path, in the same dtypes (the
student's under the caller's autocast, the teacher's output embedding outside it): with one chunk the
loss and the gradients are equal to the last bit on a CPU (tests/test_kd_loss.py), with several
chunks the weight's gradient is summed chunk by chunk (float32 rounding).

Why not liger-kernel's `LigerFusedLinearJSD` (jsd_beta=0, what Model Optimizer's QAD trainer uses
with `use_liger_kernel`): it requires triton (a multi-hundred-MB dependency CI's CPU torch must not
pull in), takes the student's raw weight (no place for the fake quantization of the output embedding
between the weight and the matmul) and is not `LogitsDistillationLoss` (no T^2); this is ~100 lines.

Where it does not apply (`unsupported`; tasks/qad.py then keeps the full logits): a model whose
forward changes the logits after the output embedding (soft-capping, logit scales: `reference.py`),
an output quantizer on the embedding, and FSDP2 (`qad.sharding: fsdp` with several processes: the
root's parameters are gathered only inside the model's own forward).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from qad_pipeline.scoring.reference import _head_only, kl_estimate

# Positions per chunk: a float32 logits chunk of a 128K vocabulary is 1 GiB; a chunk holds about
# five such tensors at once (student and teacher logits, log-softmax, softmax, their gradient).
CHUNK_TOKENS = 2048


def unsupported(model) -> str | None:
    """Why the chunked loss cannot stand in for `model(...).logits` (None: it can)."""
    inner = getattr(model, "module", model)  # DDP wraps it
    head = inner.get_output_embeddings()
    if not isinstance(head, torch.nn.Linear):
        return f"its output embedding is a {type(head).__name__}, not a Linear"
    if not _head_only(inner):
        return "its forward changes the logits after the output embedding"
    quantizer = getattr(head, "output_quantizer", None)
    if quantizer is not None and quantizer.is_enabled:
        return "its output embedding quantizes its output"
    return None


def applies(qad, student, teacher, sharded: bool) -> bool:
    """Whether `qad.chunked_loss` is asked for and stands in for the full logits here (it says why not)."""
    if not qad.chunked_loss:
        return False
    reason = "FSDP2 shards the output embedding" if sharded else unsupported(student) or (
        teacher is not None and unsupported(teacher))
    if reason:
        print(f"qad: the KD loss from the full logits (qad.chunked_loss: {reason})", flush=True)
    return not reason


def decoder_states(model, input_ids: torch.Tensor) -> torch.Tensor:
    """The last hidden state ([batch, positions, hidden]) the model's output embedding would read.

    A DistributedDataParallel student runs through DDP's own forward (its gradient all-reduce is
    armed there), asking transformers for the last position's logits only; a hook on the decoder
    takes its output."""
    inner = getattr(model, "module", model)
    if inner is model:
        return inner.base_model(input_ids=input_ids, use_cache=False).last_hidden_state
    taken = []
    hook = inner.base_model.register_forward_hook(lambda _m, _a, out: taken.append(out.last_hidden_state))
    try:
        model(input_ids=input_ids, use_cache=False, logits_to_keep=1)
    finally:
        hook.remove()
    return taken[0]


def live_targets(teacher, teacher_hidden: torch.Tensor, temperature: float):
    """per_token(student_logits, start, end) for a live teacher: `LogitsDistillationLoss` against the
    teacher's logits for those positions, from its hidden states ([tokens, hidden])."""
    from modelopt.torch.distill.losses import LogitsDistillationLoss

    head, kd = teacher.get_output_embeddings(), LogitsDistillationLoss(temperature=temperature, reduction="none")

    def per_token(student_logits: torch.Tensor, start: int, end: int) -> torch.Tensor:
        with torch.no_grad():
            teacher_logits = head(teacher_hidden[start:end]).float()
        return kd(student_logits, teacher_logits.to(student_logits.device))

    return per_token


def cached_targets(cache, indices, temperature: float, device: torch.device):
    """per_token(student_logits, start, end) for the cached teacher: `TeacherCache.loss`'s estimate for
    the windows `indices`, positions flattened; the rows cross to the device pinned, without a wait."""
    import numpy as np

    rows = [cache.row[int(w)] for w in indices]
    pinned = device.type == "cuda"
    arrays = []
    for array in cache.arrays:
        host = torch.from_numpy(np.ascontiguousarray(array[rows]))
        host = host.pin_memory() if pinned else host
        arrays.append(host.to(device, non_blocking=pinned).flatten(0, 1))
    top_ids, top_lp, tail_ids, tail_lp, rest = arrays
    top_ids, tail_ids = top_ids.long(), tail_ids.long()

    def per_token(student_logits: torch.Tensor, start: int, end: int) -> torch.Tensor:
        student = F.log_softmax(student_logits / temperature, dim=-1)
        part = slice(start, end)
        return temperature**2 * kl_estimate(top_ids[part], top_lp[part], tail_ids[part], tail_lp[part], rest[part],
                                            student)

    return per_token


def chunked_kd_mean(head, hidden: torch.Tensor, per_token, chunk_tokens: int = CHUNK_TOKENS) -> torch.Tensor:
    """The mean over positions of `per_token(head(hidden) as float32, start, end)`, chunk by chunk.

    `head` is the student's output embedding (a Linear, Model Optimizer's `QuantLinear` or not),
    `hidden` its input [..., hidden]; call it under the autocast the model runs in."""
    quantize_input = getattr(head, "input_quantizer", None)
    quantize_weight = getattr(head, "weight_quantizer", None)
    with torch.profiler.record_function("qad.kd_loss"):
        h = quantize_input(hidden) if quantize_input is not None else hidden
        weight = quantize_weight(head.weight) if quantize_weight is not None else head.weight  # the raw weight, once
        return _ChunkedKD.apply(h.flatten(0, -2), weight, head.bias, per_token, chunk_tokens, tuple(hidden.shape[:-1]))


class _ChunkedKD(torch.autograd.Function):
    """Forward: the loss, and its gradients with respect to (hidden, weight, bias) chunk by chunk;
    backward: those, times the incoming gradient."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, per_token, chunk_tokens, shape):
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        count = hidden.shape[0]
        w = weight.detach().requires_grad_(need_w)
        b = bias.detach().requires_grad_(need_b) if bias is not None else None
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w = grad_b = None
        losses = []
        for start in range(0, count, chunk_tokens):
            end = min(count, start + chunk_tokens)
            h = hidden[start:end].detach().requires_grad_(need_h)
            with torch.enable_grad():
                logits = F.linear(h, w, b).float()  # under the caller's autocast, as the model's forward
                with torch.autocast(h.device.type, enabled=False):  # the loss outside it, as before
                    loss = per_token(logits, start, end)
            wanted = [t for t, need in ((h, need_h), (w, need_w), (b, need_b)) if need]
            if wanted:  # d(mean)/d(per-position loss) = 1 / count, as `.mean()`'s backward gives it
                grads = list(torch.autograd.grad(loss, wanted, grad_outputs=torch.full_like(loss, 1 / count)))
                if need_h:
                    grad_h[start:end] = grads.pop(0)
                if need_w:
                    grad_w = grads.pop(0) if grad_w is None else grad_w.add_(grads.pop(0))
                if need_b:
                    grad_b = grads.pop(0) if grad_b is None else grad_b.add_(grads.pop(0))
            losses.append(loss.detach())
        ctx.save_for_backward(grad_h, grad_w, grad_b)
        return torch.cat(losses).view(shape).mean()

    @staticmethod
    def backward(ctx, grad_output):
        grads = [g.mul_(grad_output) if g is not None else None for g in ctx.saved_tensors]
        return (*grads, None, None, None)
