"""QAD: resume after a kill, refuse a student of another model, stop on a non-finite loss; bf16 autocast
and gradient checkpointing. Several processes: tests/test_qad_distributed.py."""

import shutil
import signal
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest
import torch

from qad_pipeline.core.artifacts import read_json
from qad_pipeline.core.config import ConfigError, StageError, load_params
from qad_pipeline.core.layout import Layout
from qad_pipeline.training.distributed import World, check_processes, resume, save_checkpoint
from tasks.qad import CHECKPOINT, QADDiverged, enable_gradient_checkpointing, lr_lambda, run_qad


def stage_cmd(layout, overrides):
    cmd = [sys.executable, "-m", "qad_pipeline", "stage", "qad", "--out-root", str(layout.root)]
    for o in overrides:
        cmd += ["--set", o]
    return cmd


@pytest.fixture
def copy_of_run(pipeline_run, tmp_path):
    """A private copy of the flow run's outputs, so a test may break or re-run stages in it."""
    _, layout, overrides, _ = pipeline_run
    root = tmp_path / "run"
    shutil.copytree(layout.root, root, ignore=shutil.ignore_patterns("qad", "qad_checkpoints", "export"))
    return Layout(root), [*overrides, "qad.num_gpus=1"]  # as the run's plan settled auto for its stages (a CPU)


@pytest.mark.slow
def test_killed_qad_resumes_from_its_checkpoint(copy_of_run):
    layout, overrides = copy_of_run
    # float32: bf16 autocast is several times slower on a CPU without native bf16 (what is tested here is resume)
    overrides = overrides + ["qad.steps=8", "qad.checkpoint_every=2", "qad.compute_dtype=float32"]
    proc = subprocess.Popen(stage_cmd(layout, overrides), stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    checkpoint = layout.qad_checkpoints / CHECKPOINT / "state.pt"
    deadline = time.time() + 600
    while not checkpoint.is_file() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.2)
    assert checkpoint.is_file(), "no checkpoint appeared before the stage ended"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    saved_step = torch.load(checkpoint, weights_only=True)["step"]
    assert 0 < saved_step < 8 and not (layout.qad / "model").exists()

    rerun = subprocess.run(stage_cmd(layout, overrides), capture_output=True, text=True)
    assert rerun.returncode == 0, rerun.stdout[-2000:] + rerun.stderr[-2000:]
    assert f"resuming from the checkpoint at step {saved_step}" in rerun.stdout
    curve = read_json(layout.qad / "loss.json")
    assert curve["resumed_from"] == saved_step
    assert [p["step"] for p in curve["losses"]] == list(range(1, 9))
    assert not layout.qad_checkpoints.exists()  # a finished run leaves no checkpoint to resume


@pytest.mark.slow
def test_student_of_another_model_is_refused(copy_of_run, tmp_path):
    layout, overrides = copy_of_run
    params = load_params(overrides=overrides)
    selected = read_json(layout.selection_metrics)["selected"]
    student = tmp_path / "student"
    shutil.copytree(layout.ptq(selected) / "checkpoint", student)
    config = read_json(student / "config.json")
    config["vocab_size"] = 123
    (student / "config.json").write_text(__import__("json").dumps(config))
    with pytest.raises(ConfigError, match="vocab_size is 123 in the student"):
        run_qad(params, student, layout.data, tmp_path / "qad", tmp_path / "ckpt")


@pytest.mark.slow
def test_non_finite_loss_stops_with_the_step(copy_of_run, tmp_path):
    layout, overrides = copy_of_run
    params = load_params(overrides=overrides + ["qad.lr=1e30", "qad.warmup_steps=0", "qad.steps=6"])
    selected = read_json(layout.selection_metrics)["selected"]
    with pytest.raises(QADDiverged, match=r"at step \d+; training stopped"):
        run_qad(params, layout.ptq(selected) / "checkpoint", layout.data, tmp_path / "qad", tmp_path / "ckpt")
    assert not (tmp_path / "qad").exists()


def test_schedules():
    params = load_params(overrides=["qad.steps=10", "qad.warmup_steps=2"])
    f = lr_lambda(params.qad)
    assert f(0) < f(1) < f(2) == pytest.approx(1.0)
    assert f(9) < f(5) < f(2)
    const = lr_lambda(load_params(overrides=["qad.schedule=constant", "qad.warmup_steps=0"]).qad)
    assert const(0) == const(7) == 1.0


@pytest.mark.slow
def test_bf16_autocast_and_gradient_checkpointing(copy_of_run, tmp_path):
    """bf16 autocast starts within a few percent of float32; gradient checkpointing changes nothing."""
    layout, overrides = copy_of_run
    student = layout.ptq(read_json(layout.selection_metrics)["selected"]) / "checkpoint"

    def curve(*extra):
        params = load_params(overrides=overrides + ["qad.steps=2", "qad.warmup_steps=0", *extra])
        out = tmp_path / "-".join(extra)
        run_qad(params, student, layout.data, out, tmp_path / "ckpt")
        return read_json(out / "loss.json")

    fp32 = curve("qad.compute_dtype=float32", "qad.gradient_checkpointing=false")
    recomputed = curve("qad.compute_dtype=float32", "qad.gradient_checkpointing=true")
    bf16 = curve("qad.compute_dtype=bfloat16", "qad.gradient_checkpointing=false")
    assert (fp32["compute_dtype"], bf16["compute_dtype"], recomputed["gradient_checkpointing"]) == (
        "float32", "bfloat16", True)
    assert fp32["world_size"] == 1 and fp32["tokens_per_second"] > 0
    # The second loss follows one update, so it sees the gradients: recomputing activations in backward
    # must not change them (measured: equal to the last bit on the demo).
    assert [p["loss"] for p in recomputed["losses"]] == pytest.approx([p["loss"] for p in fp32["losses"]], rel=1e-6)
    # Measured on the demo (TINY settings): bf16 first loss 0.011694 vs float32 0.011437, 2.2 % apart.
    assert bf16["first_loss"] == pytest.approx(fp32["first_loss"], rel=0.07)


def test_a_model_transformers_cannot_checkpoint_is_refused():
    with pytest.raises(ConfigError, match="qad.gradient_checkpointing: transformers cannot checkpoint"):
        enable_gradient_checkpointing(SimpleNamespace(supports_gradient_checkpointing=False))


def test_a_batch_that_does_not_split_over_the_processes_is_refused():
    params = load_params(overrides=["qad.num_gpus=3", "qad.batch_size=4", "hardware.device=cpu"])
    with pytest.raises(ConfigError, match="qad.batch_size = 4 does not split evenly over qad.num_gpus = 3"):
        check_processes(params)


def tiny_training(seed: int):
    """A small model with AdamW and the QAD schedule, as `run_qad` builds them."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(load_params().qad))
    return model, optimizer, scheduler


def test_checkpoint_state_is_loaded_with_weights_only(tmp_path):
    """state.pt holds only tensors and plain values: it loads with weights_only=True and resumes exactly."""
    model, optimizer, scheduler = tiny_training(0)
    for _ in range(3):
        model(torch.randn(5, 4)).square().mean().backward()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
    losses = [{"step": i + 1, "loss": 0.5 / (i + 1), "lr": 1e-2} for i in range(3)]
    save_checkpoint(tmp_path / CHECKPOINT, World(), model, optimizer, scheduler, 3, losses, "key-1")
    state = torch.load(tmp_path / CHECKPOINT / "state.pt", weights_only=True)
    assert state["step"] == 3 and state["run_key"] == "key-1"

    fresh, fresh_optimizer, fresh_scheduler = tiny_training(1)
    step, curve = resume(tmp_path / CHECKPOINT, World(), fresh, fresh_optimizer, fresh_scheduler, "key-1")
    assert (step, curve) == (3, losses)
    for ours, theirs in zip(fresh.state_dict().values(), model.state_dict().values()):
        assert torch.equal(ours, theirs)
    assert fresh_scheduler.state_dict()["last_epoch"] == scheduler.state_dict()["last_epoch"] == 3
    assert fresh_optimizer.state_dict()["state"][0]["step"] == optimizer.state_dict()["state"][0]["step"]
    other, other_optimizer, other_scheduler = tiny_training(2)  # another run's checkpoint: ignored
    assert resume(tmp_path / CHECKPOINT, World(), other, other_optimizer, other_scheduler, "key-2") == (0, [])


class _Payload:
    ran = False

    def __reduce__(self):
        return (_mark_ran, ())


def _mark_ran():
    _Payload.ran = True
    return "ran"


def test_a_checkpoint_state_with_arbitrary_objects_is_refused_unexecuted(tmp_path):
    folder = tmp_path / CHECKPOINT
    folder.mkdir()
    torch.save({"step": 2, "losses": [], "run_key": "key", "payload": _Payload()}, folder / "state.pt")
    model, optimizer, scheduler = tiny_training(0)
    with pytest.raises(StageError, match=r"refusing to load the checkpoint state .*state.pt.*delete"):
        resume(folder, World(), model, optimizer, scheduler, "key")
    assert not _Payload.ran  # weights_only never called the pickled function


def test_the_student_checks_honour_trust_remote_code(demo_model_path, monkeypatch):
    """With base_model.trust_remote_code the student's config and tokenizer are read with it too (a model
    with its own code would otherwise fail at QAD, after PTQ worked)."""
    import transformers

    from tasks.qad import check_student_matches_teacher

    seen = []
    for cls in (transformers.AutoConfig, transformers.AutoTokenizer):
        original = cls.from_pretrained.__func__

        def recording(klass, *args, _original=original, **kwargs):
            seen.append((klass.__name__, kwargs.get("trust_remote_code")))
            return _original(klass, *args, **kwargs)

        monkeypatch.setattr(cls, "from_pretrained", classmethod(recording))
    params = load_params(overrides=["base_model.trust_remote_code=true"])
    check_student_matches_teacher(demo_model_path, params)
    # teacher and student, each: config and tokenizer (which reads the config again)
    assert [name for name, _ in seen].count("AutoTokenizer") == 2 and {name for name, _ in seen} == {
        "AutoConfig", "AutoTokenizer"}
    assert all(remote is True for _, remote in seen), seen


def test_the_plan_prices_qad_with_a_measured_mfu_where_there_is_one(monkeypatch):
    """costs.MEASURED_QAD_MFU replaces the assumed TRAIN_MFU for its GPU, and the plan says which it used."""
    from qad_pipeline.plan import costs
    from qad_pipeline.plan.memory_model import model_shape

    params = load_params(overrides=["qad.batch_size=8", "qad.num_gpus=1"])  # settled, as the plan passes them
    shape, flops = model_shape(params.base_model), 989e12
    assumed = costs.seconds("qad", params, shape, flops, "H200")
    assert costs.train_mfu("H200") == (costs.TRAIN_MFU, "assumed")
    monkeypatch.setitem(costs.MEASURED_QAD_MFU, "H200", costs.TRAIN_MFU / 2)
    assert costs.train_mfu("H200") == (costs.TRAIN_MFU / 2, "measured on H200")
    assert costs.seconds("qad", params, shape, flops, "H200") == pytest.approx(2 * assumed)
    assert costs.seconds("qad", params, shape, flops, "H100") == pytest.approx(assumed)
    assert costs.target_gpu("8xH200") == "H200" and costs.target_gpu(None) is None
