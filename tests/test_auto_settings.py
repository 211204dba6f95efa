"""`auto` settings the memory plan settles (qad_pipeline/plan/memory.py: `settled`): QAD's micro-batch
and accumulation, its GPUs, eval's batch. Fast: models are configs only (no weights)."""

import numpy as np
import pytest
from typer.testing import CliRunner

from qad_pipeline.cli import app
from qad_pipeline.core.config import ConfigError, load_params
from qad_pipeline.plan import capacity, memory, plan_table
from qad_pipeline.plan.memory import settled_overrides
from qad_pipeline.training.cached_teacher import used_windows
from qad_pipeline.training.distributed import pinned

# what `qad-pipeline plan` found usable on the 24 GiB machine where Gemma3-270M's QAD at batch 8 was refused
SMALL_HOST = capacity.Capacity("cpu", int(19.1 * memory.GiB))
H100 = capacity.target_capacity("8xH100-80GB")


@pytest.fixture(scope="module")
def gemma_270m(tmp_path_factory):
    """Gemma3-270M's shapes (a 262K vocabulary on 270M parameters), as a folder with config.json only."""
    from transformers import Gemma3TextConfig

    folder = tmp_path_factory.mktemp("gemma3-270m")
    Gemma3TextConfig(vocab_size=262144, hidden_size=640, num_hidden_layers=18, intermediate_size=2048,
                     num_attention_heads=4, num_key_value_heads=1, head_dim=256,
                     architectures=["Gemma3ForCausalLM"]).save_pretrained(folder)
    return folder


def test_auto_takes_the_largest_micro_batch_that_fits_and_accumulates_to_the_effective_batch(gemma_270m):
    params = load_params(overrides=[f"base_model.path={gemma_270m}"])
    chosen = memory.settled(params, SMALL_HOST)
    q = chosen.qad
    assert (q.num_gpus, q.batch_size, q.grad_accum) == (1, 4, 2)  # 5 rows would fit: 4 is the largest divisor of 8
    assert q.batch_size * q.grad_accum == params.qad.effective_batch_size == 8
    assert memory.estimate("qad", chosen, SMALL_HOST).host_bytes <= SMALL_HOST.host_bytes
    eight = load_params(overrides=[f"base_model.path={gemma_270m}", "qad.batch_size=8"])
    assert memory.estimate("qad", eight, SMALL_HOST).host_bytes > SMALL_HOST.host_bytes
    assert plan_table.settled_line(params, chosen) == ("chosen for auto: qad.num_gpus=1, qad.batch_size=4, "
                                                   "qad.grad_accum=2, eval.batch_size=32 (4 x 2 = 8 rows a step)")
    roomy = memory.settled(params, capacity.Capacity("cpu", 200 * memory.GiB)).qad
    assert (roomy.batch_size, roomy.grad_accum) == (8, 1)  # today's 8 x 1 where it fits
    wide = memory.settled(load_params(overrides=[f"base_model.path={gemma_270m}", "qad.effective_batch_size=32"]),
                          SMALL_HOST).qad
    assert (wide.batch_size, wide.grad_accum) == (4, 8)


def test_an_explicit_batch_is_kept_and_refused_when_it_does_not_fit(gemma_270m):
    params = load_params(overrides=[f"base_model.path={gemma_270m}", "qad.batch_size=8"])
    assert (params.qad.batch_size, params.qad.grad_accum) == (8, 1)  # an explicit batch: no accumulation
    with pytest.raises(ConfigError, match=r"^qad: qad.batch_size=8 at qad.seq_len 256 needs ~\d+.\d GiB of host "
                                          r"memory, ~19.1 GiB is usable; the largest that fits is 5"):
        memory.check_fits(memory.plan(params, SMALL_HOST))
    memory.check_fits(memory.plan(load_params(overrides=[f"base_model.path={gemma_270m}"]), SMALL_HOST))


def test_eval_auto_is_the_largest_batch_every_evaluating_stage_fits(gemma_270m):
    params = load_params(overrides=[f"base_model.path={gemma_270m}"])
    tight = capacity.Capacity("cpu", 5 * memory.GiB)  # 4 GiB no longer holds the export with vLLM's check beside it
    rows = memory.settled(params, tight).eval.batch_size
    assert 1 <= rows < memory.AUTO_EVAL_BATCH
    at = lambda n: load_params(overrides=[f"base_model.path={gemma_270m}", f"eval.batch_size={n}"])  # noqa: E731
    assert memory.estimate("baseline", at(rows), tight).host_bytes <= tight.host_bytes
    assert any(memory.estimate(stage, at(rows + 1), tight).host_bytes > tight.host_bytes
               for stage in memory.stages(params) if stage.split("/")[0] in ("baseline", "ptq", "final_eval"))


def test_llama_8b_on_8xh100_with_the_defaults_fits_qad_on_the_fewest_gpus():
    params = load_params(overrides=["base_model.path=meta-llama/Llama-3.1-8B", "hardware.target=8xH100-80GB"])
    chosen = memory.settled(params, H100)
    assert (chosen.qad.num_gpus, chosen.qad.batch_size, chosen.qad.grad_accum, chosen.ptq.gpus_per_recipe) == (4, 8, 1, 1)
    three = load_params(overrides=["base_model.path=meta-llama/Llama-3.1-8B", "qad.num_gpus=3", "qad.batch_size=6"])
    assert not [e for e in memory.plan(three, H100) if e.stage == "qad"][0].fits  # one GPU fewer does not fit
    one = load_params(overrides=["base_model.path=meta-llama/Llama-3.1-8B", "qad.num_gpus=1", "qad.batch_size=8"])
    with pytest.raises(ConfigError, match=r"qad: .*per GPU"):  # today's default: refused
        memory.check_fits([e for e in memory.plan(one, H100) if e.stage == "qad"])
    result = CliRunner().invoke(app, ["plan", "--base-model", "meta-llama/Llama-3.1-8B", "--set", "hardware.target=8xH100-80GB"])
    assert result.exit_code == 0, result.output
    assert "chosen for auto: qad.num_gpus=4, qad.batch_size=8, qad.grad_accum=1" in result.output
    qad_row = next(line for line in result.output.splitlines() if line.startswith("qad "))
    assert " 0-3 " in qad_row and qad_row.endswith("yes")
    assert "baseline 1, ptq 1 each x5, qad 4, final_eval 1, export 1" in result.output  # the pool's Jobs


def test_without_gpus_auto_is_todays_cpu_run(demo_model_path):
    params = load_params()
    chosen = memory.settled(params, capacity.Capacity("cpu", 200 * memory.GiB))
    assert settled_overrides(params, chosen) == ["qad.num_gpus=1", "qad.batch_size=8", "qad.grad_accum=1",
                                                 "eval.batch_size=32"]
    assert chosen.ptq.gpus_per_recipe == "auto" and chosen.hardware.device_map == "auto"
    # CUDA stages planned where no GPU is seen run on GPU workers: nothing to fit, today's values
    elsewhere = memory.settled(params, capacity.Capacity("cuda", 1 * memory.GiB))
    assert (elsewhere.qad.num_gpus, elsewhere.qad.batch_size, elsewhere.eval.batch_size) == (1, 8, 32)


def test_a_step_draws_the_same_windows_however_it_is_split():
    """QAD draws whole steps of batch_size x grad_accum rows (training_text.batch_indices): the micro-batch
    auto chooses changes no window a step trains on, nor what the teacher cache holds."""
    def windows(*overrides):
        return used_windows(1000, load_params(overrides=["qad.steps=150", *overrides]))  # past the first epoch

    assert np.array_equal(windows("qad.batch_size=8"), windows("qad.batch_size=4", "qad.grad_accum=2"))
    assert np.array_equal(windows("qad.batch_size=8"), windows("qad.batch_size=1", "qad.grad_accum=8"))
    assert len(windows("qad.batch_size=4")) < len(windows("qad.batch_size=8"))  # 4 rows a step: fewer windows


def test_the_choice_is_passed_on_not_made_again():
    params = load_params(overrides=["qad.offload=false"])
    chosen = memory.settled(params, capacity.Capacity("cpu", 200 * memory.GiB))
    assert pinned(chosen) == ["--set", "qad.num_gpus=1", "--set", "qad.batch_size=8", "--set", "qad.grad_accum=1"]
    again = load_params(overrides=settled_overrides(params, chosen))
    assert again.qad.settled and again.eval.batch_size == 32
    explicit = load_params(overrides=["qad.batch_size=2", "qad.num_gpus=1", "eval.batch_size=4"])
    assert settled_overrides(explicit, memory.settled(explicit, SMALL_HOST)) == []


@pytest.mark.parametrize("items, message", [
    (["qad.batch_size=auto", "qad.grad_accum=2"], "qad.grad_accum = 2: Value error, must be auto with qad.batch_size auto"),
    (["qad.batch_size=-1"], "qad.batch_size = -1: Value error, must be auto or a positive integer, got -1"),
    (["qad.num_gpus=many"], "qad.num_gpus = 'many': Value error, must be auto or a positive integer, got 'many'"),
    (["qad.effective_batch_size=0"], "qad.effective_batch_size = 0: Input should be greater than 0"),
])
def test_bad_values_are_refused_in_one_line(items, message):
    with pytest.raises(ConfigError) as err:
        load_params(overrides=items)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_an_effective_batch_that_does_not_split_over_the_gpus_is_refused():
    params = load_params(overrides=["base_model.path=meta-llama/Llama-3.1-8B", "qad.effective_batch_size=6",
                                    "qad.num_gpus=4"])
    with pytest.raises(ConfigError, match=r"^qad.effective_batch_size = 6 does not split evenly over qad.num_gpus = 4"):
        memory.settled(params, H100)


def test_the_report_says_what_the_plan_chose():
    from qad_pipeline.reporting.report import report_text
    from qad_pipeline.results.run import RunSummary
    from tests import samples

    tasks = {"heldout_cloze": samples.score(0.5, recovery=0.98, recovery_ci=(0.96, 1.0))}
    summary = RunSummary(selection=samples.selection("a", []), recipes=[],
                         qad=samples.qad_metrics("a", tasks, 0.98, batch_size=4, grad_accum=2, world_size=1),
                         settled=["qad.num_gpus=1", "qad.batch_size=4", "qad.grad_accum=2"])
    text = report_text(summary)
    assert "QAD (5 steps of 8 rows (4 x 2 micro-batches), KD loss" in text
    assert "For the settings left at auto: qad.num_gpus=1, qad.batch_size=4, qad.grad_accum=2." in text
