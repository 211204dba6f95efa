"""The memory plan (qad_pipeline/plan/memory.py): monotonic in its knobs, its JSON, its refusals, max_parallel.

Fast: only the demo model's config is read (a copy without weights proves that none are).
"""

import json
import shutil

import pytest
from typer.testing import CliRunner

from qad_pipeline.plan import capacity, memory
from qad_pipeline.cli import app
from qad_pipeline.core.config import PROJECT_ROOT, ConfigError, load_params

PARAMS = PROJECT_ROOT / "params.yaml"
BIG = capacity.Capacity("cpu", 1 << 50)  # the estimates alone, whatever this machine has free


@pytest.fixture(scope="module")
def config_only_model(tmp_path_factory, demo_model_path):
    """The demo model's config and tokenizer, without its weights."""
    folder = tmp_path_factory.mktemp("config-only")
    for f in demo_model_path.iterdir():
        if f.is_file() and f.suffix != ".safetensors":
            shutil.copy(f, folder)
    return folder


# params.yaml's values before `auto` (tests/test_auto_settings.py tests auto): these tests turn one knob at a time
FIXED = ["eval.batch_size=32", "qad.batch_size=8", "qad.num_gpus=1"]


def params_with(model, *overrides):
    return load_params(PARAMS, [f"base_model.path={model}", *FIXED, *overrides])


def host(stage, model, *overrides, cap=BIG):
    return memory.estimate(stage, params_with(model, *overrides), cap).host_bytes


PTQ = "ptq/nvfp4_4o6-mamba_w4a16-kv_nvfp4"


@pytest.mark.parametrize("stage, knob, low, high", [
    ("baseline", "eval.batch_size", 1, 64),
    ("baseline", "eval.seq_len", 64, 1024),
    (PTQ, "ptq.calib_batch_size", 1, 64),
    (PTQ, "calibration.seq_len", 64, 1024),
    (PTQ, "eval.batch_size", 1, 64),
    ("qad", "qad.batch_size", 1, 64),
    ("qad", "qad.seq_len", 64, 1024),
    ("final_eval", "eval.batch_size", 1, 64),
])
def test_estimate_grows_with_its_knobs(config_only_model, stage, knob, low, high):
    """No phase of the stage shrinks and one grows; so the peak (the largest phase) never shrinks."""
    def phases(value):
        p = params_with(config_only_model, f"{knob}={value}")
        shape = memory.model_shape(p.base_model)
        return [sum({**ph.resident, **ph.transient, **ph.host}.values())
                for ph in memory.stage_phases(stage, p, shape, "cpu")]

    small, large = phases(low), phases(high)
    assert all(a <= b for a, b in zip(small, large, strict=True)) and small != large
    assert host(stage, config_only_model, f"{knob}={low}") <= host(stage, config_only_model, f"{knob}={high}")


def test_estimate_grows_with_the_model_and_shrinks_with_the_memory_knobs(config_only_model):
    # the demo is an MoE: on the CPU its export's peak would be vLLM refusing its NVFP4 experts beside
    # it, the same for any size (planned apart, below); the export's own phases grow
    p = params_with(config_only_model, "qad.seq_len=1024", "export.serving_check=skip")
    shape = memory.model_shape(p.base_model)
    wider = shape.__class__(**{**shape.__dict__, "vocab": shape.vocab * 8})
    bigger = shape.__class__(**{**shape.__dict__, "params": shape.params * 8, "matrix_params": shape.matrix_params * 8})
    for stage in ("baseline", PTQ, "qad", "export"):
        base = memory.estimate(stage, p, BIG, shape).host_bytes
        assert memory.estimate(stage, p, BIG, bigger).host_bytes > base, stage
        assert memory.estimate(stage, p, BIG, wider).host_bytes > base, stage
    qad = memory.estimate("qad", p, BIG).host_bytes
    assert host("qad", config_only_model, "qad.seq_len=1024", "qad.gradient_checkpointing=true") < qad
    # activations (training's peak at a long sequence) are held in the compute dtype
    assert host("qad", config_only_model, "qad.seq_len=4096", "qad.compute_dtype=float32") > host(
        "qad", config_only_model, "qad.seq_len=4096", "qad.compute_dtype=bfloat16")
    # static NVFP4 block scales (four-over-six) keep more state than max calibration
    assert host(PTQ, config_only_model) > host("ptq/nvfp4_max-mamba_fp8-kv_fp8", config_only_model)


def test_fsdp_divides_the_per_gpu_training_memory(config_only_model):
    gpus = capacity.Capacity("cuda", 1 << 50, (80 * memory.GiB,) * 8)
    one = memory.estimate("qad", params_with(config_only_model, "qad.batch_size=1"), gpus)  # = rows per GPU of 8
    fsdp = memory.estimate("qad", params_with(config_only_model, "qad.num_gpus=8", "qad.sharding=fsdp"), gpus)
    ddp = memory.estimate("qad", params_with(config_only_model, "qad.num_gpus=8", "qad.sharding=ddp"), gpus)
    assert fsdp.device_bytes < one.device_bytes < ddp.device_bytes
    assert one.terms["student_fp32"] == 8 * fsdp.terms["student_fp32"]


def test_plan_json_lists_every_stage(config_only_model):
    result = CliRunner().invoke(app, ["plan", "--params", str(PARAMS), "--base-model", str(config_only_model),
                                      "--set", "hardware.host_memory_gb=64", "--json"])
    assert result.exit_code == 0, result.output
    rows = json.loads(result.output)
    p = params_with(config_only_model)
    assert [r["stage"] for r in rows] == ["calibration", "baseline", *(f"ptq/{r}" for r in p.ptq.recipes),
                                          "selection", "qad", "final_eval", "export"]
    for row in rows:
        assert {"stage", "host_bytes", "device_bytes", "max_parallel"} <= row.keys()
        assert row["host_bytes"] > 0 and row["device_bytes"] == 0 and row["max_parallel"] >= 1 and row["fits"]
    assert {r["max_parallel"] for r in rows if r["stage"].startswith("ptq/")} == {memory.recipe_parallelism(
        params_with(config_only_model, "hardware.host_memory_gb=64"))}


def test_a_setting_that_cannot_fit_is_refused_with_the_knob_and_the_largest_value_that_fits(config_only_model):
    overrides = ["hardware.host_memory_gb=2", "qad.batch_size=256"]
    result = CliRunner().invoke(app, ["plan", "--params", str(PARAMS), "--base-model", str(config_only_model),
                                      *[a for o in overrides for a in ("--set", o)]])
    assert result.exit_code == 2
    assert "qad.batch_size=256 at qad.seq_len 256 needs" in result.output
    fit = int(result.output.split("the largest that fits is ")[1].split()[0])
    cap = capacity.capacity(params_with(config_only_model, *overrides).hardware)
    fitting = memory.estimate("qad", params_with(config_only_model, *overrides, f"qad.batch_size={fit}"), cap)
    too_big = memory.estimate("qad", params_with(config_only_model, *overrides, f"qad.batch_size={fit + 1}"), cap)
    assert 1 <= fit < 256 and fitting.host_bytes <= cap.host_bytes < too_big.host_bytes


def test_check_fits_raises_for_what_does_not_fit(config_only_model):
    memory.check_fits(memory.plan(params_with(config_only_model), BIG))
    tiny = capacity.Capacity("cpu", 610 * memory.MiB)
    with pytest.raises(ConfigError, match=r"baseline: .*host memory.*even at batch size 1.*more host memory"):
        memory.check_fits(memory.plan(params_with(config_only_model), tiny))


def test_max_parallel_auto_on_cpu_fits_the_recipes_into_host_memory(config_only_model):
    p = params_with(config_only_model)
    peak = max(memory.estimate(f"ptq/{r}", p, BIG).host_bytes for r in p.ptq.recipes)
    for k in (1, 2, 3):
        assert memory.recipe_parallelism(p, capacity.Capacity("cpu", k * peak + peak // 2)) == k
    assert memory.recipe_parallelism(p, BIG) == len(p.ptq.recipes)
    assert memory.recipe_parallelism(params_with(config_only_model, "ptq.max_parallel=2"), BIG) == 2
    # hardware.host_memory_gb replaces what the machine has free
    cap = capacity.capacity(params_with(config_only_model, "hardware.host_memory_gb=4").hardware)
    assert cap.host_bytes == int(4 * memory.GiB * capacity.HEADROOM)
    # a fixed ptq.max_parallel that does not fit names the knob and what fits
    two = capacity.Capacity("cpu", 2 * peak + peak // 2)
    with pytest.raises(ConfigError, match=r"ptq.max_parallel=5 .*the largest that fits is 2"):
        memory.check_fits(memory.plan(params_with(config_only_model, "ptq.max_parallel=5"), two))


def test_max_parallel_auto_on_gpus_is_one_recipe_per_gpu(config_only_model):
    p = params_with(config_only_model)
    four = capacity.Capacity("cuda", 1 << 50, (80 * memory.GiB,) * 4)
    assert memory.recipe_parallelism(p, four) == 4  # device_map auto: the plan gives each recipe the one GPU it needs
    assert memory.recipe_parallelism(params_with(config_only_model, "hardware.device_map=single"), four) == 4
    assert memory.recipe_parallelism(params_with(config_only_model, "ptq.gpus_per_recipe=4"), four) == 1
    busy = capacity.Capacity("cuda", 1 << 50, (80 * memory.GiB, 1 * memory.MiB))
    assert memory.recipe_parallelism(p, busy) == 1
    # CUDA stages planned where no GPU is seen (a flow's control node) run on GPU workers: no check
    elsewhere = capacity.Capacity("cuda", 1 * memory.GiB)
    huge = params_with(config_only_model, "qad.batch_size=4096")
    assert memory.recipe_parallelism(p, elsewhere) == len(p.ptq.recipes)
    memory.check_fits(memory.plan(huge, elsewhere))


def test_a_stage_that_does_not_fit_one_gpu_is_refused_with_its_knob(config_only_model):
    one_gpu = capacity.Capacity("cuda", 1 << 50, (2 * memory.GiB,))
    with pytest.raises(ConfigError, match=r"qad: qad.batch_size=512 at qad.seq_len 256 needs .* per GPU.*"
                                          r"the largest that fits is \d+"):
        memory.check_fits(memory.plan(params_with(config_only_model, "qad.batch_size=512"), one_gpu))
    with pytest.raises(ConfigError, match=r"qad: runs on qad.num_gpus = 2 GPUs, this machine sees 1"):
        memory.check_fits(memory.plan(params_with(config_only_model, "qad.num_gpus=2"), one_gpu))


def test_run_refuses_a_setting_that_cannot_fit_before_anything_starts(config_only_model, tmp_path):
    result = CliRunner().invoke(app, ["run", "--params", str(PARAMS), "--out-root", str(tmp_path),
                                      "--base-model", str(config_only_model),
                                      "--set", "hardware.host_memory_gb=2", "--set", "qad.batch_size=256"])
    assert result.exit_code == 2
    assert "qad.batch_size=256 at qad.seq_len 256 needs" in result.output and "the largest that fits is" in result.output
    assert not (tmp_path / "artifacts").exists()


def test_a_stage_peak_is_its_own_not_its_parents():
    """wait_with_peak reads the child's own high-water mark: a 600 MB parent does not show in it."""
    import subprocess
    import sys

    from flows.stage_process import wait_with_peak

    parent = bytearray(600 * 2**20)  # resident: every page written
    parent[::4096] = b"x" * len(parent[::4096])
    child = subprocess.Popen([sys.executable, "-c",
                              "import time; b = bytearray(300 * 2**20); b[::4096] = b'y' * len(b[::4096]); time.sleep(1.5)"])
    status, peak_kb = wait_with_peak(child.pid)
    child.returncode = 0
    assert status == 0
    assert 300 <= peak_kb / 1024 < 450, peak_kb / 1024
    del parent


def test_the_serving_checks_vllm_is_planned_as_it_runs_here_and_quantized_evals_keep_the_originals(tmp_path):
    """On the CPU the export's serving check plans vLLM's engine beside the export for a dense model;
    for an MoE, whose NVFP4 experts vLLM's CPU build refuses as it builds the model, that process
    alone. An evaluation of a quantized model holds its folded weights' originals on the host (all
    quantized matrices, a tied LM head left out); the BF16 baseline none."""
    from qad_pipeline.plan import memory_model
    from tests.families import FAMILIES, SHAPE

    phases = {}
    for name in ("qwen3", "qwen3_moe"):
        family = FAMILIES[name]
        family.config(**SHAPE, **family.settings).save_pretrained(tmp_path / name)
        params = load_params(PARAMS, [f"base_model.path={tmp_path / name}", *FIXED])
        shape = memory.model_shape(params.base_model)
        phases[name] = {ph.name: ph for stage in ("export", PTQ)
                        for ph in memory_model.stage_phases(stage, params, shape, "cpu")}, shape
        assert all(not ph.host for ph in memory_model.stage_phases("baseline", params, shape, "cpu"))
    (dense, dense_shape), (moe, moe_shape) = phases["qwen3"], phases["qwen3_moe"]
    assert moe_shape.routed_experts == 4 and dense_shape.routed_experts == 0
    assert dense["serving_check"].host["vllm_process"] == memory_model.VLLM_CPU_PROCESS
    assert {"vllm_kv_cache", "vllm_weights", "vllm_prompt_logits"} <= set(dense["serving_check"].host)
    assert moe["serving_check"].host == {"exported_read_back": moe["serving_check"].host["exported_read_back"],
                                         "vllm_process": memory_model.VLLM_CPU_MOE_REFUSED}
    tied = dense_shape.vocab * dense_shape.hidden  # qwen3 here ties its LM head to the embeddings
    assert dense["eval_stream"].host == {"folded_originals": (dense_shape.matrix_params - tied) * 2}
    assert moe["lm_eval"].host == {"folded_originals": moe_shape.matrix_params * 2}
