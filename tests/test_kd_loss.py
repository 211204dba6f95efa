"""The chunked KD loss (qad_pipeline/training/kd_loss.py) against the full-logits loss QAD computed before it,
on a tiny Llama whose student is NVFP4-quantized with the project's default recipe (CPU kernels).

Measured (float32, CPU): with one chunk the loss and every parameter's gradient equal the full-logits
path's to the last bit (live and cached teacher, through `micro_step` too); with chunks of 16 of the
64 positions the largest gradient difference was 2.8e-7 of the gradient's scale (float32 sums in
another order), asserted within 1e-5.
"""

import copy
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from modelopt.torch.distill.losses import LogitsDistillationLoss

from qad_pipeline.training import kd_loss
from qad_pipeline.core.config import PROJECT_ROOT, load_params
from qad_pipeline.training.distributed import World
from qad_pipeline.scoring.reference import reference_terms
from qad_pipeline.training.cached_teacher import TeacherCache
from tasks.qad import QADStep, micro_step

VOCAB, BATCH, SEQ, T = 512, 2, 48, 2.0
RECIPE = PROJECT_ROOT / "recipes" / "nvfp4_max-mamba_fp8-kv_fp8.yaml"  # ptq.recipes' first: W4A4, lm_head W4A16


@pytest.fixture(scope="module")
def models():
    """(teacher, NVFP4 student of it, a batch of token ids, the window indices of its rows)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from tasks.ptq import quantize_model

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False, use_cache=False)
    teacher = LlamaForCausalLM(config).eval().requires_grad_(False)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ))
    student = quantize_model(copy.deepcopy(teacher).requires_grad_(True), Path(RECIPE), ids, BATCH).train()
    assert student.lm_head.weight_quantizer.is_enabled  # the fake-quantized weight is on the chunked path
    return teacher, student, ids, np.array([5, 2])


def fake_cache(teacher, ids, windows, k=32, m=16):
    """A TeacherCache's reading side (rows, arrays as the teacher_cache stage stores them) for `windows`."""
    with torch.no_grad():
        logprobs = torch.log_softmax(teacher(input_ids=ids).logits.float() / T, dim=-1)
    terms = reference_terms(logprobs, k, m, torch.Generator().manual_seed(0))
    arrays = [t.numpy().astype(np.int32 if t.dtype == torch.int64 else np.float32) for t in terms]
    return SimpleNamespace(row={int(w): r for r, w in enumerate(windows)}, arrays=arrays)


def gradients(model):
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return grads


def full_logits(student, teacher, ids, cache=None, windows=None):
    """What tasks/qad.py computed before the chunked loss: the loss and its gradients."""
    student_logits = student(input_ids=ids).logits.float()
    if cache is None:
        with torch.no_grad():
            teacher_logits = teacher(input_ids=ids).logits.float()
        per_token = LogitsDistillationLoss(temperature=T, reduction="none")(student_logits, teacher_logits)
    else:
        per_token = TeacherCache.loss(cache, windows, student_logits, T)
    loss = per_token.mean()
    loss.backward()
    return loss.detach(), gradients(student)


def chunked(student, teacher, ids, chunk, cache=None, windows=None):
    if cache is None:
        with torch.inference_mode():
            hidden = teacher.base_model(input_ids=ids).last_hidden_state
        targets = kd_loss.live_targets(teacher, hidden.flatten(0, -2), T)
    else:
        targets = kd_loss.cached_targets(cache, windows, T, ids.device)
    inner = getattr(student, "module", student)  # DDP wraps it
    loss = kd_loss.chunked_kd_mean(inner.lm_head, kd_loss.decoder_states(student, ids), targets, chunk)
    loss.backward()
    return loss.detach(), gradients(inner)


def assert_same(reference, ours, exact: bool):
    (loss, grads), (our_loss, our_grads) = reference, ours
    assert grads.keys() == our_grads.keys() and "lm_head.weight" in grads
    if exact:
        assert torch.equal(loss, our_loss)
        assert [n for n in grads if not torch.equal(grads[n], our_grads[n])] == []
        return
    torch.testing.assert_close(our_loss, loss, rtol=1e-6, atol=0)
    for name, grad in grads.items():
        scale = grad.abs().max().clamp_min(1e-30)
        assert (our_grads[name] - grad).abs().max() / scale < 1e-5, name


@pytest.mark.parametrize("teacher_kind", ["live", "cached"])
def test_equals_the_full_logits_loss_and_gradients(models, teacher_kind):
    teacher, student, ids, windows = models
    cache = fake_cache(teacher, ids, windows) if teacher_kind == "cached" else None
    reference = full_logits(student, teacher, ids, cache, windows)
    assert reference[0] > 0
    assert_same(reference, chunked(student, teacher, ids, BATCH * SEQ, cache, windows), exact=True)  # one chunk
    assert_same(reference, chunked(student, teacher, ids, 16, cache, windows), exact=False)  # 6 chunks


def test_no_tokens_by_vocabulary_tensor_is_saved_for_backward(models):
    """Autograd's saved tensors still alive when forward is done: the full-logits path holds
    [tokens x vocab] ones until backward; the chunked one none (a chunk's are freed within its forward)."""
    import gc
    import weakref

    teacher, student, ids, _ = models
    with torch.no_grad():
        teacher_logits = teacher(input_ids=ids).logits.float()
        hidden = teacher.base_model(input_ids=ids).last_hidden_state.flatten(0, -2)

    def saved_logits_rows(forward) -> int:
        """The most positions of any [..., vocab] tensor saved in `forward` and alive after it."""
        saved = []

        def pack(t):
            if t.dim() and t.shape[-1] == VOCAB:
                saved.append(weakref.ref(t))
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = forward()
        gc.collect()
        rows = max([t.numel() // VOCAB for ref in saved if (t := ref()) is not None], default=0)
        loss.backward()
        gradients(student)
        return rows

    kd = LogitsDistillationLoss(temperature=T, reduction="none")
    full = saved_logits_rows(lambda: kd(student(input_ids=ids).logits.float(), teacher_logits).mean())
    ours = saved_logits_rows(lambda: kd_loss.chunked_kd_mean(
        student.lm_head, kd_loss.decoder_states(student, ids), kd_loss.live_targets(teacher, hidden, T), 16))
    assert (full, ours) == (BATCH * SEQ, 0)


def test_micro_step_equals_the_full_logits_step(models):
    """tasks/qad.py's micro_step, chunked and not: the same loss and gradients (one chunk), and the
    loss comes back on the device, unread."""
    teacher, student, ids, windows = models
    q = load_params(overrides=["qad.batch_size=4", "qad.grad_accum=2", f"qad.temperature={T}"]).qad
    step = QADStep(q, student, None, None, torch.device("cpu"), teacher, torch.device("cpu"), world=World())
    results = []
    for chunked_loss in (False, True):
        step.chunked = chunked_loss
        loss = micro_step(step, windows, ids)
        assert isinstance(loss, torch.Tensor) and not loss.requires_grad
        results.append((loss, gradients(student)))
    assert_same(*results, exact=True)


def test_bfloat16_autocast_stays_close(models):
    """Under bf16 autocast both paths run the output embedding in bf16; they agree to bf16 rounding."""
    teacher, student, ids, _ = models
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ours = chunked(student, teacher, ids, 32)
        reference = full_logits(student, teacher, ids)
    torch.testing.assert_close(ours[0], reference[0], rtol=1e-2, atol=0)
    torch.testing.assert_close(ours[1]["lm_head.weight"], reference[1]["lm_head.weight"], rtol=0.05, atol=1e-6)


def test_models_whose_forward_changes_the_logits_keep_the_full_logits(models):
    teacher, student, _, _ = models
    assert kd_loss.unsupported(student) is None
    capped = copy.deepcopy(teacher)
    capped.config.final_logit_softcapping = 30.0
    assert "changes the logits" in kd_loss.unsupported(capped)
    off = load_params(overrides=["qad.chunked_loss=false"]).qad
    assert kd_loss.applies(load_params().qad, student, teacher, sharded=False)
    assert not kd_loss.applies(off, student, teacher, sharded=False)
    assert not kd_loss.applies(load_params().qad, student, teacher, sharded=True)


def test_through_distributed_data_parallel(models):
    """A DDP student (one gloo process here) runs through DDP's own forward: same loss and gradients."""
    import socket

    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    teacher, student, ids, _ = models
    reference = full_logits(student, teacher, ids)
    with socket.socket() as s:
        s.bind(("localhost", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://localhost:{port}", rank=0, world_size=1)
    try:
        ours = chunked(DistributedDataParallel(student), teacher, ids, BATCH * SEQ)
    finally:
        dist.destroy_process_group()
    assert_same(reference, ours, exact=True)
