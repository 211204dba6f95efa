"""Planning for a node that is not this one (`qad-pipeline plan --target`, qad_pipeline/core/targets.py),
on the real models' configs shipped in profiles/configs/ (no weights, no hub access)."""

import json
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from qad_pipeline.core import targets
from qad_pipeline.plan import capacity, memory
from qad_pipeline.cli import app
from qad_pipeline.core.config import PROJECT_ROOT, BaseModelParams, ConfigError, load_params
from qad_pipeline.plan.memory_model import model_shape

PROFILE_8B = PROJECT_ROOT / "profiles" / "llama-3.1-8b_8xh100.yaml"


def test_targets_are_read_with_their_defaults_and_bad_ones_name_the_form():
    h100 = targets.parse("8xH100-80GB")
    assert (h100.count, h100.gpu, h100.gpu_bytes, h100.host_bytes) == (8, "H100", 80 * 2**30, 8 * targets.HOST_PER_GPU)
    b200 = targets.parse("4xB200-180GB,2TiB-host")
    assert (b200.count, b200.gpu_bytes, b200.host_bytes, b200.host_given) == (4, 180 * 2**30, 2 * 2**40, True)
    assert targets.parse("8xh200").gpu_bytes == 141 * 2**30
    with pytest.raises(ValueError, match=r"unknown GPU 'V100'; known: A100, H100, H200, B200"):
        targets.parse("8xV100-32GB")
    with pytest.raises(ValueError, match=r"is not <count>x<GPU>\[-<memory>\]\[,<memory>-host\], e.g. 8xH100-80GB"):
        targets.parse("eight H100s")
    with pytest.raises(ConfigError, match=r"hardware.target .*unknown GPU 'H900'"):
        load_params(PROFILE_8B, ["hardware.target=8xH900"])


def test_the_shipped_configs_have_the_published_sizes():
    published = {"meta-llama/Llama-3.1-8B": 8.0, "meta-llama/Llama-3.1-70B": 70.6, "Qwen/Qwen3-30B-A3B": 30.5,
                 "nvidia/Nemotron-H-8B-Base-8K": 8.1, "google/gemma-3-27b-it": 27.4}  # Gemma: with its vision tower
    sizes = {m: model_shape(BaseModelParams(path=m)) for m in published}
    assert {m: round(s.params / 1e9, 1) for m, s in sizes.items()} == published
    gemma = sizes["google/gemma-3-27b-it"]  # the text tower's shapes; one [vocab, hidden] matrix, tied
    assert (gemma.vocab, gemma.layers, gemma.hidden, gemma.tied_embeddings) == (262_208, 62, 5376, True)
    # a MoE token goes through 8 of its 128 experts: ~3B active matrix weights of 30.5B
    assert 2.5e9 < sizes["Qwen/Qwen3-30B-A3B"].active_matrix_params < 3.5e9
    assert sizes["nvidia/Nemotron-H-8B-Base-8K"].mamba_layers == 24


def test_plan_of_the_8b_profile_for_its_node_passes_offline_with_gpus_disk_and_time():
    result = CliRunner().invoke(app, ["plan", "--params", str(PROFILE_8B), "--json"])
    assert result.exit_code == 0, result.output
    rows = {r["stage"]: r for r in json.loads(result.output)}
    recipes = [s for s in rows if s.startswith("ptq/")]
    assert [rows[r]["gpus"] for r in recipes] == [["0"], ["1"], ["2"], ["3"]]
    assert rows["qad"]["gpus"] == [str(i) for i in range(8)] and rows["qad"]["max_parallel"] == 8
    # a fake-quantized BF16 checkpoint per recipe; QAD's float32 checkpoint with AdamW, twice
    # 8.0B x 2 bytes (+ block scales, + the tokenizer: a hub model's counted at 64 MiB at most)
    assert all(16e9 < rows[r]["disk_bytes"] < 18.1e9 for r in recipes)
    assert rows["qad"]["disk_bytes"] > 12 * 2 * 8e9
    assert rows["qad"]["seconds"] > rows[recipes[0]]["seconds"] > 0 and rows["calibration"]["seconds"] == 0
    text = CliRunner().invoke(app, ["plan", "--params", str(PROFILE_8B)]).output
    assert "usable (target 8xH100-80GB)" in text and "not counted" not in text  # the standard suite is priced
    assert rows["baseline"]["evaluation"]["requests"] == 104_877 and rows["qad"]["evaluation"] is None
    assert "  final_eval" in text and "104,877 requests" in text


@pytest.mark.parametrize("profile", sorted((PROJECT_ROOT / "profiles").glob("*.yaml")), ids=lambda p: p.stem)
def test_each_profile_plans_and_fits_on_its_target(profile):
    params = load_params(profile)
    assert params.hardware.target, f"{profile.name} names no hardware.target"
    memory.check_fits(memory.plan(params, capacity.target_capacity(params.hardware.target)))


def test_the_mse_search_is_priced_by_its_chunk_and_the_logits_by_the_vocabulary():
    """The MSE recipe's scale search is a chunk of ptq.mse_chunk_rows rows, not the largest weight
    (Llama-3.1-70B's LM head: ~87 GiB searched whole); QAD's KD logits are rows x seq_len x vocab x
    float32 copies, and a tied embedding is gathered once."""
    from qad_pipeline.plan.memory_model import KD_LOGIT_COPIES, MSE_SWEEP_COPIES, stage_phases

    mse = ["ptq.recipes=[nvfp4_mse-mamba_fp8-kv_fp8]", "hardware.device_map=auto"]
    big = load_params(PROFILE_8B, ["base_model.path=meta-llama/Llama-3.1-70B", *mse])
    shape = model_shape(big.base_model)
    search = next(p for p in stage_phases("ptq/nvfp4_mse-mamba_fp8-kv_fp8", big, shape, "cuda") if p.name == "mse_search")
    assert search.transient["mse_search"] == 1024 * shape.widest_row * 4 * MSE_SWEEP_COPIES < 3 * 2**30
    whole = load_params(PROFILE_8B, ["base_model.path=meta-llama/Llama-3.1-70B", *mse, "ptq.mse_chunk_rows=null"])
    h100 = capacity.target_capacity("8xH100-80GB")
    assert memory.estimate("ptq/nvfp4_mse-mamba_fp8-kv_fp8", whole, h100,
                           shape).terms["mse_search"] == shape.largest_matrix * 4 * MSE_SWEEP_COPIES > 80 * 2**30
    with pytest.raises(ConfigError, match=r"ptq/nvfp4_mse-mamba_fp8-kv_fp8: ptq.mse_chunk_rows=null needs ~87.1 GiB per "
                                          r"GPU, ~72.0 GiB is usable; the largest that fits is \d+"):
        memory.check_fits([e for e in memory.plan(whole, h100) if e.stage.startswith("ptq/")])
    gemma = load_params(PROJECT_ROOT / "profiles" / "gemma-3_8xh100.yaml")
    g = model_shape(gemma.base_model)
    train = next(p for p in stage_phases("qad", gemma, g, "cuda") if p.name == "train")
    assert train.transient["kd_logits"] == 1 * 4096 * 262_208 * 4 * KD_LOGIT_COPIES  # one row per GPU
    assert train.resident["fsdp_gathered_root"] == 262_208 * 5376 * (4 + 2)


def test_the_moe_profile_plans_and_a_setting_that_does_not_fit_names_its_knob():
    moe = CliRunner().invoke(app, ["plan", "--params", str(PROJECT_ROOT / "profiles" / "qwen3-30b-a3b_8xb200.yaml")])
    assert moe.exit_code == 0, moe.output
    h100 = capacity.target_capacity("8xH100-80GB")
    big = load_params(PROFILE_8B, ["base_model.path=meta-llama/Llama-3.1-70B", "qad.offload=true",
                                   "ptq.recipes=[nvfp4_4o6-mamba_fp8-kv_fp8]"])
    with pytest.raises(ConfigError, match=r"qad: qad.seq_len=8192 needs ~\d+.\d GiB per GPU, ~72.0 GiB is usable; "
                                          r"the largest that fits is \d+"):
        memory.check_fits([e for e in memory.plan(big, h100) if e.stage == "qad"])
    # 8B on 2 GPUs: nothing fits without offload; with it, one row per GPU
    two = load_params(PROFILE_8B, ["qad.num_gpus=2"])
    with pytest.raises(ConfigError, match=r"qad: qad.batch_size=8 at qad.seq_len 8192 needs ~\d+.\d GiB per GPU, "
                                          r"~72.0 GiB is usable; the largest that fits is 2 with qad.offload=true; set both"):
        memory.check_fits([e for e in memory.plan(two, h100) if e.stage == "qad"])
    fits = load_params(PROFILE_8B, ["qad.num_gpus=2", "qad.offload=true", "qad.batch_size=2", "qad.grad_accum=16"])
    assert memory.estimate("qad", fits, h100).device_bytes < h100.gpu_bytes[0]
    bad = CliRunner().invoke(app, ["plan", "--params", str(PROFILE_8B), "--target", "8xH100-80"])
    assert bad.exit_code == 2 and "is not <count>x<GPU>" in bad.output


def test_a_model_larger_than_a_gpu_gets_the_fewest_gpus_it_fits_on():
    params = load_params(PROFILE_8B, ["base_model.path=Qwen/Qwen3-30B-A3B", "hardware.device_map=auto"])
    assert memory.settled(params, capacity.target_capacity("8xH100-80GB")).ptq.gpus_per_recipe == 2
    assert memory.settled(params, capacity.target_capacity("8xB200-180GB")).ptq.gpus_per_recipe == 1


def test_the_docs_table_is_the_plan_of_the_shipped_configs():
    out = subprocess.run([sys.executable, str(PROJECT_ROOT / "scripts" / "plan_targets.py")], capture_output=True,
                         text=True, check=True).stdout.strip()
    page = (PROJECT_ROOT / "docs" / "memory-plan.md").read_text()
    assert out in page, "docs/memory-plan.md's plan table differs: run scripts/plan_targets.py"


def test_a_deployment_run_is_checked_against_its_target_before_any_work(tmp_path, monkeypatch):
    """The run's own machine (a CPU-only control node) says nothing about its GPU workers;
    hardware.target does: QAD on more GPUs than the node has is refused up front."""
    from flows import runtime
    from qad_pipeline.plan import pools

    # the pools' own limits come from Prefect's server (tests/test_pools.py); here, process pools without one
    monkeypatch.setattr(pools, "server_limits", lambda deployments: dict.fromkeys(deployments))

    overrides = ["hardware.device=cuda", "export.serving_check=skip", "hardware.target=1xH100-80GB", "qad.num_gpus=2"]
    with pytest.raises(ConfigError, match=r"qad: runs on qad.num_gpus = 2 GPUs, the target 1xH100-80GB has 1"):
        runtime.start_job(str(PROJECT_ROOT / "params.yaml"), overrides, str(tmp_path), "ptq-recipe/gpu", "gpu-stage/gpu")
    params, job = runtime.start_job(str(PROJECT_ROOT / "params.yaml"), overrides[:-1], str(tmp_path), "ptq-recipe/gpu",
                                    "gpu-stage/gpu")
    assert job.gpus == ()  # the stages' GPUs are the workers' to hand out
