"""The stage registry (qad_pipeline/core/stages.py): dvc.yaml is what it generates, and each stage's
code dependencies are what its modules import."""

import ast
import dataclasses
import json
import subprocess
import sys

import pytest
import yaml

from qad_pipeline.cli import Stage
from qad_pipeline.core.config import PROJECT_PARAMS, PROJECT_ROOT, load_params
from qad_pipeline.core.code_deps import PACKAGES, code_modules, module_file
from qad_pipeline.core.stages import CACHED_TEACHER, EXPORTING, RACING, SERVED, STAGES, SWEEPING, planned
from qad_pipeline.platform.versioning import dvc_yaml, stage_names


def test_dvc_yaml_is_generated_from_the_registry():
    assert (PROJECT_ROOT / "dvc.yaml").read_text() == dvc_yaml(), "dvc.yaml is stale: run `qad-pipeline dvc-yaml`"


def test_dvc_yaml_declares_every_stage_with_its_code_and_outputs():
    stages = yaml.safe_load(dvc_yaml())["stages"]
    assert list(STAGES) == [s.value for s in Stage]
    # the project's params.yaml does not sweep, race or cache the teacher: none of those stages, and
    # nothing waits for their files
    optional = {n for n, s in STAGES.items() if any(map(s.gated_by, (SWEEPING, RACING, CACHED_TEACHER, SERVED)))}
    assert list(stages) == [name for name in STAGES if name not in optional]
    deps = {dep for stage in stages.values() for dep in stage.get("do", stage)["deps"]}
    assert not deps & {"artifacts/sweep", "artifacts/sweep_search", "metrics/bpe_sweep.json", "artifacts/teacher_cache"}
    swept = yaml.safe_load(dvc_yaml(load_params(PROJECT_PARAMS, {"selection.sweep": "knee", "qad.teacher": "cached"})))
    swept = swept["stages"]
    assert list(swept) == [n for n, s in STAGES.items() if not s.gated_by(RACING) and not s.gated_by(SERVED)]
    assert "metrics/bpe_sweep.json" in swept["selection"]["deps"] and "artifacts/teacher_cache" in swept["qad"]["deps"]
    assert not deps & {"artifacts/race", "metrics/race.json"} and "race" in stages["ptq"]["do"]["params"]
    raced = yaml.safe_load(dvc_yaml(load_params(PROJECT_PARAMS, {"race.enabled": True})))["stages"]
    assert list(raced) == [n for n, s in STAGES.items() if not any(map(s.gated_by, (SWEEPING, CACHED_TEACHER, SERVED)))]
    assert {"metrics/race.json", "artifacts/race"} <= set(raced["selection"]["deps"])
    assert raced["race"]["outs"] == [{"artifacts/race": {"persist": True}}]  # DVC keeps the scored items
    served = yaml.safe_load(dvc_yaml(load_params(PROJECT_PARAMS, {"eval.backend": "vllm"})))["stages"]
    assert list(served)[-2:] == ["export", "served_eval"] and "artifacts/export" in served["served_eval"]["deps"]
    ptq = stages["ptq"]["do"]
    assert stages["ptq"]["foreach"] == "${ptq.recipes}" and ptq["cmd"] == "qad-pipeline stage ptq ${item} --out-root ."
    # what tasks/ptq.py imports, directly or not, is a dependency: an edit to load_model re-runs PTQ
    assert {"qad_pipeline/core/modeling.py", "qad_pipeline/core/calibration_data.py", "qad_pipeline/nvfp4/nvfp4_cpu.py"} <= set(ptq["deps"])
    # and only that: the calibration stage's own module, or QAD's, is not
    assert {"tasks/calibration.py", "tasks/baseline.py", "tasks/qad.py"}.isdisjoint(ptq["deps"])
    assert "qad" not in ptq["params"]
    assert "artifacts/ptq/${item}" in ptq["outs"]
    for name, stage in stages.items():
        body = stage.get("do", stage)
        for dep in body["deps"]:
            if "$" not in dep:
                assert (PROJECT_ROOT / dep).exists() or dep.startswith(("artifacts/", "metrics/")), (name, dep)


# The registry's modules, where stages are named; tasks/ (one module per stage) is not scanned.
REGISTRY = {"qad_pipeline/core/stages.py", "qad_pipeline/core/stage_types.py", "qad_pipeline/core/code_deps.py"}
# Where a string equal to a stage's name means something else: file -> (the values, why).
NOT_A_STAGE = {
    "qad_pipeline/core/layout.py": (set(STAGES) - {"selection"}, "artifact folder names (`artifacts/<stage>/`), paths on "
                               "disk as dvc.yaml's outputs spell them; the registry imports Layout, so Layout cannot "
                               "read the registry without a cycle"),
    "qad_pipeline/core/config.py": ({"qad"}, "a param value: selection.policy and export.source `qad` (config.py is not "
                               "this module's to edit)"),
    "qad_pipeline/checks/export_verify.py": ({"qad"}, "a param value: export.source `qad`, the student"),
    "qad_pipeline/tracking/registry.py": ({"qad"}, "a param value: the export's source `qad`, the student"),
    "qad_pipeline/core/calibration_data.py": ({"calibration"}, "the dataset folder inside the calibration artifact"),
    "qad_pipeline/tracking/datasets.py": ({"calibration"}, "the MLflow dataset's name and context"),
    "qad_pipeline/cli.py": ({"selection", "sweep"}, "keys of the flows' results (RunSummary.selection, the sweep's)"),
    "flows/sweep_flow.py": ({"sweep"}, "a key of the sweep flow's result"),
    "qad_pipeline/tracking/sweep_runs.py": ({"sweep"}, "the sweep's parent run kind, an MLflow tag value"),
    "qad_pipeline/results/sweep_metrics.py": ({"sweep"}, "a BPE point's kind (a searched point, not a fixed recipe)"),
    "qad_pipeline/reporting/report.py": ({"export"}, "the served eval's model key (`bf16`, `export`)"),
    "qad_pipeline/plan/memory_model.py": ({"export"}, "a memory phase's name, as the plan prints it"),
    "qad_pipeline/platform/dvc_remote.py": ({"qad"}, "the DVC remote's name"),
    "qad_pipeline/training/trainjob.py": ({"qad"}, "the Kubernetes namespace"),
}


def test_no_module_outside_the_registry_and_the_tasks_names_a_stage():
    """A stage is spelt in qad_pipeline/core/stages.py (and its own tasks/ module) only: everything else
    reads the registry (a field, a gate, a role such as `stages.EXPORT`), so adding a stage or a gate
    touches no other module."""
    found, used = [], set()
    for package in ("qad_pipeline", "flows"):
        for path in sorted((PROJECT_ROOT / package).rglob("*.py")):
            name = path.relative_to(PROJECT_ROOT).as_posix()
            if name in REGISTRY:
                continue
            for node in ast.walk(ast.parse(path.read_text(), name)):
                if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in STAGES:
                    if node.value in NOT_A_STAGE.get(name, ((), ""))[0]:
                        used.add((name, node.value))
                    else:
                        found.append(f"{name}:{node.lineno}: {node.value!r}")
    assert not found, "stage names outside the registry (read it instead, or say why in NOT_A_STAGE):\n" + "\n".join(found)
    assert used == {(name, value) for name, (values, _) in NOT_A_STAGE.items() for value in values}, "a stale exception"


def test_code_modules_follow_function_local_imports():
    # tasks/qad.py imports qad_pipeline.platform.runlock inside a function, and the package's __init__
    # installs the CPU kernels from a function too
    modules = code_modules("tasks.qad")
    assert {"qad_pipeline.platform.runlock", "qad_pipeline.nvfp4.nvfp4_cpu", "qad_pipeline", "tasks"} <= set(modules)
    assert "qad_pipeline.cli" not in modules and "flows.pipeline" not in modules
    assert module_file("tasks.qad") == PROJECT_ROOT / "tasks" / "qad.py"
    assert module_file("flows") == PROJECT_ROOT / "flows" / "__init__.py"


@pytest.mark.parametrize("stage", ["ptq", "export"])
def test_import_graph_covers_what_python_really_imports(stage, tmp_path):
    """Every project module that importing the stage's module loads is one of its code dependencies
    (imported by its dotted path from another folder: the installed project, no path tricks)."""
    module = STAGES[stage].module
    script = (f"import sys, {module}\n"
              f"print(__import__('json').dumps(sorted(m for m in sys.modules if m.split('.')[0] in {PACKAGES})))")
    loaded = json.loads(subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                                       check=True, cwd=tmp_path).stdout)
    assert module in loaded
    assert set(loaded) <= set(code_modules(module))


def test_one_name_per_stage_everywhere():
    ptq = STAGES["ptq"]
    assert (ptq.run_name("r"), ptq.dvc_name("r"), ptq.summary_key("r")) == ("ptq-r", "ptq@r", "ptq/r")
    assert stage_names([("calibration", None), ("ptq", "r")]) == ["calibration", "ptq@r"]
    assert STAGES["export"].dvc_name() == "export"


def test_a_killed_stage_names_its_signal_and_oom_only_when_the_kernel_counted_one(monkeypatch, tmp_path):
    import signal
    from pathlib import PurePath

    from qad_pipeline.platform import processes
    from qad_pipeline.platform.processes import exit_reason, oom_kills

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    child.send_signal(signal.SIGTERM)
    assert exit_reason(child.wait(), 0, 0) == "killed by SIGTERM"
    assert exit_reason(-signal.SIGKILL, 3, 4) == "killed by the kernel's out-of-memory killer (SIGKILL)"
    assert exit_reason(-signal.SIGKILL, 3, 3) == "killed by SIGKILL"
    assert "see `dmesg`" in exit_reason(-signal.SIGKILL, None, None)
    assert exit_reason(2, 0, 0) == "exit code 2"
    # The kernel's count: cgroup v2's memory.events (not its `oom` line), else v1's memory.oom_control.
    monkeypatch.setattr(processes, "Path", lambda path: tmp_path / PurePath(path).name)
    (tmp_path / "memory.events").write_text("low 0\nhigh 0\nmax 7\noom 3\noom_kill 2\noom_group_kill 0\n")
    (tmp_path / "memory.oom_control").write_text("oom_kill_disable 0\nunder_oom 0\noom_kill 5\n")
    assert oom_kills() == 2
    (tmp_path / "memory.events").unlink()
    assert oom_kills() == 5
    (tmp_path / "memory.oom_control").write_text("oom_kill_disable 0\nunder_oom 0\n")
    assert oom_kills() is None  # no count here: exit_reason then points at dmesg


def test_what_follows_selection_depends_on_the_policy_and_the_export_source():
    """qad: QAD, final eval and the export of the student; ptq_final: the export of the selected
    recipe alone; export.source none: nothing exported."""
    def after_selection(*overrides):
        return [s.name for s, _ in planned(load_params(overrides=list(overrides))) if s.after_selection]

    assert after_selection("selection.policy=qad") == ["qad", "final_eval", "export"]
    assert after_selection("selection.policy=ptq_final") == ["export"]
    assert after_selection("selection.policy=ptq_final", "export.source=none") == []


def test_export_source_auto_is_the_student_or_the_selected_recipe(tmp_path):
    from qad_pipeline.core.config import ConfigError
    from qad_pipeline.core.layout import Layout
    from qad_pipeline.results.base import write_result
    from tasks.export import export_source
    from tests import samples

    layout = Layout(tmp_path)
    write_result(layout.selection_metrics, samples.selection("nvfp4_max-mamba_fp8-kv_fp8", []))
    checkpoint = layout.ptq("nvfp4_max-mamba_fp8-kv_fp8") / "checkpoint"
    checkpoint.mkdir(parents=True)
    (checkpoint / "config.json").write_text("{}")
    ptq_final = load_params(overrides=["selection.policy=ptq_final"])
    assert export_source(ptq_final, layout) == ("ptq/nvfp4_max-mamba_fp8-kv_fp8", checkpoint)
    with pytest.raises(ConfigError, match=r"no checkpoint at .*qad/model; exportable here: ptq/nvfp4_max-mamba_fp8-kv_fp8$"):
        export_source(load_params(), layout)  # policy qad: the student, which QAD has not written
    with pytest.raises(ConfigError, match="export.source is none"):
        export_source(load_params(overrides=["export.source=none"]), layout)


def test_a_schema_is_a_code_dependency_only_of_the_stages_that_read_or_write_its_file():
    """A field added to the export's file re-runs the export, not calibration, the baseline or PTQ."""
    users = {module: {name for name, s in STAGES.items() if module in code_modules(s.module)}
             for module in ("qad_pipeline.results.export_metrics", "qad_pipeline.results.data", "qad_pipeline.results.qad_metrics")}
    # the served eval reads the export's file (its serving check) and the final eval's (the in-memory recovery)
    assert users["qad_pipeline.results.export_metrics"] == {"export", "served_eval"}
    # QAD and the teacher cache read the calibration manifest (for the training windows)
    assert users["qad_pipeline.results.data"] == {"calibration", "qad", "teacher_cache"}
    assert users["qad_pipeline.results.qad_metrics"] == {"qad", "final_eval", "served_eval"}


def _model_card():
    """A stage added to the registry: one `Stage(...)` whose every reference is the one task module
    tests/stage_model_card.py (the library's own gate, GPU claim and memory model reused)."""
    from qad_pipeline.core.stage_types import Output
    from qad_pipeline.core.stage_types import Stage as Declared

    card = "tests.stage_model_card"
    return Declared("model_card", f"{card}:main", after=("export",), params=("export",),
                    inputs=("metrics/export.json",), outputs=(Output("metrics/model_card.json", "metrics"),),
                    when=(EXPORTING,), gpus="qad_pipeline.plan.gpus:WHOLE_MODEL",
                    result="metrics/model_card.json", schema=f"{card}:ModelCard", mlflow=f"{card}:card_run",
                    report=f"{card}:report", memory="qad_pipeline.plan.memory_model:export_phases",
                    knobs=("eval.batch_size",), cost=f"{card}:COST", eval_cost=f"{card}:eval_cost")


def test_a_stage_added_to_the_registry_reaches_dvc_the_flows_the_plan_the_report_and_mlflow(monkeypatch, tmp_path):
    """One `Stage(...)` and its task module are all dvc.yaml, the flows, the plan (memory, disk, time,
    evaluation, GPUs), the report and MLflow need (docs/architecture.md, "Adding a stage"); its gate
    (`when`) takes it out of a run whose params say no."""
    from flows import runtime
    from qad_pipeline.core import code_deps
    from qad_pipeline.plan import capacity, memory, plan_table
    from qad_pipeline.core.layout import Layout
    from qad_pipeline.reporting.report import read_summary, report_text
    from qad_pipeline.results.base import write_result
    from qad_pipeline.tracking.children import read_children
    from tests import samples

    added = _model_card()
    monkeypatch.setitem(STAGES, "model_card", added)
    # its task module is a test module here (tasks/<name>.py in the project): the code walk reads tests/ too
    monkeypatch.setattr(code_deps, "PACKAGES", (*PACKAGES, "tests"))
    card = yaml.safe_load(dvc_yaml())["stages"]["model_card"]
    assert card["cmd"] == "qad-pipeline stage model_card --out-root ." and "metrics/export.json" in card["deps"]
    assert "tests/stage_model_card.py" in card["deps"] and "qad_pipeline/plan/costs.py" in card["deps"]
    assert card["params"] == ["export"] and card["metrics"] == ["metrics/model_card.json"]
    params = load_params(PROJECT_PARAMS)
    runs = planned(params)
    assert runs[-1] == (added, None)
    assert added.command(None, "p.yaml", "out", ["a=1"]) == [
        "qad-pipeline", "stage", "model_card", "--params", "p.yaml", "--out-root", "out", "--set", "a=1"]
    unexported = load_params(PROJECT_PARAMS, {"export.source": "none"})  # its gate: no export, no card
    assert added not in [s for s, _ in planned(unexported)] and "model_card" in yaml.safe_load(dvc_yaml(unexported))["stages"]

    submitted = []

    def fake_submit(job, stage, item=None, after=None):
        submitted.append((stage, item, after))
        return f"{stage}:{item}"

    monkeypatch.setattr(runtime, "submit", fake_submit)
    futures = runtime.submit_stages(runtime.Job(str(PROJECT_PARAMS), [], Layout(tmp_path)), runs)
    assert submitted[-1] == ("model_card", None, [futures["export"][None]])

    plan = memory.plan(params)  # its memory model: the export's phases; its disk and evaluation: its own
    assert plan[-1].stage == "model_card" and plan[-1].phase in {"export", "reload_check", "serving_check"}
    assert plan[-1].disk_bytes == 4096 and plan[-1].evaluation["tokens"] == 1000
    [est] = [e for e in memory.plan(params, capacity.target_capacity("8xH100-80GB")) if e.stage == "model_card"]
    assert est.gpus == ("0",) and est.seconds > 1.0  # its GPU claim, and its time with its evaluation's
    assert "model_card" in plan_table.table(plan, capacity.capacity(params.hardware), params)

    layout = Layout(tmp_path)
    write_result(layout.baseline_metrics, samples.baseline({"t": samples.score(0.5)}))
    write_result(layout.selection_metrics, samples.selection("a", []))
    assert added.run(params, layout) == "model card written"  # what `qad-pipeline stage model_card` runs
    summary = read_summary(layout, params)  # its report section, from its result
    assert summary.sections == {"model_card": ["Model card: passed (3 lines)."]}
    assert "model_card:\nModel card: passed (3 lines)." in report_text(summary)
    children = read_children(layout, params)  # its MLflow run, filled by its reader
    assert [c.metrics for c in children if c.stage == "model_card"] == [{"card_passed": 1.0}]


def test_a_cost_asked_of_an_unknown_stage_or_of_one_without_a_cost_model_is_an_error(monkeypatch):
    from qad_pipeline.plan import costs, eval_costs
    from qad_pipeline.plan.memory_model import model_shape

    params = load_params(PROJECT_PARAMS)
    shape = model_shape(params.base_model)
    with pytest.raises(ValueError, match="unknown stage 'nope'"):
        costs.disk_bytes("nope", params, shape)
    with pytest.raises(ValueError, match="unknown stage 'nope'"):
        eval_costs.stage_cost("nope/x", params)
    monkeypatch.setitem(STAGES, "model_card", dataclasses.replace(_model_card(), cost=None))
    with pytest.raises(ValueError, match="stage model_card declares no cost"):
        costs.seconds("model_card", params, shape, 1e15)
    assert all(s.cost for s in STAGES.values() if s.name != "model_card")  # every stage has one


def test_each_declared_result_is_a_file_of_the_run_with_its_model(tmp_path):
    """`Stage.result` and `Stage.schema` name the same file and model the stages write (tests/samples.py)."""
    from qad_pipeline.core.layout import Layout
    from qad_pipeline.core.stage_types import load_reference
    from tests.samples import result_files

    written = dict(result_files(Layout(tmp_path), []))
    declared = {name: s for name, s in STAGES.items() if s.result}
    assert set(declared) == {"calibration", "baseline", "race", "selection", "qad", "final_eval", "export",
                             "served_eval"}
    for s in declared.values():
        assert written[tmp_path / s.result] is load_reference(s.schema), s.name
        assert s.mlflow and callable(load_reference(s.mlflow))
    for s in STAGES.values():  # every stage has a memory model
        assert callable(load_reference(s.memory)) or isinstance(load_reference(s.memory), int), s.name
    from qad_pipeline.plan.costs import CostModel
    from qad_pipeline.plan.gpus import GpuClaim

    for s in STAGES.values():  # and a cost model; a GPU claim and an evaluation's cost where it declares one
        assert isinstance(s.load("cost"), CostModel), s.name
        assert s.gpus is None or isinstance(s.load("gpus"), GpuClaim), s.name
        assert s.eval_cost is None or callable(s.load("eval_cost")), s.name


def test_the_race_runs_between_the_recipes_and_selection_only_when_racing(monkeypatch, tmp_path):
    from flows import runtime
    from qad_pipeline.plan import memory
    from qad_pipeline.core.layout import Layout

    names = [s.name for s, _ in planned(load_params(PROJECT_PARAMS))]
    assert "race" not in names
    params = load_params(PROJECT_PARAMS, {"race.enabled": True})
    names = [s.name for s, _ in planned(params)]
    assert names.index("race") == names.index("selection") - 1 and names.index("race") > names.index("ptq")
    submitted = {}

    def fake_submit(job, stage, item=None, after=None):
        submitted[(stage, item)] = [a.unwrap() if hasattr(a, "unwrap") else a for a in after or []]  # allow_failure
        return f"{stage}:{item}"

    monkeypatch.setattr(runtime, "submit", fake_submit)
    runtime.submit_stages(runtime.Job(str(PROJECT_PARAMS), [], Layout(tmp_path)), planned(params))
    assert "race:None" in submitted[("selection", None)]
    assert {f"ptq:{r}" for r in params.ptq.recipes} <= set(submitted[("race", None)])
    assert [p for p in memory.plan(params) if p.stage == "race"]  # one model at a time, like final_eval


def test_every_stage_that_loads_a_model_or_writes_a_checkpoint_is_cached_with_what_stands_for_its_inputs(tmp_path):
    """Nothing finished runs twice (tests/test_cancellation.py runs it): every stage is cached but the
    light ones that read the others' scores and the race, which resumes from its own rounds; each
    cached stage names the outputs its cached result needs, and its fingerprints resolve to the
    run's files, `{selected}` to the selected candidate's folder."""
    from flows.runtime import _declared_path, stage_cache_key
    from qad_pipeline.core.layout import Layout
    from qad_pipeline.results.base import write_result
    from qad_pipeline.results.selection_metrics import SelectionResult

    assert {n for n, s in STAGES.items() if not s.cached} == {"bpe_sweep", "race", "selection"}
    assert all(s.done for s in STAGES.values() if s.cached)
    layout, params = Layout(tmp_path), load_params(PROJECT_PARAMS)
    assert _declared_path("{selected}/checkpoint", params, layout, None) == tmp_path / "none-selected" / "checkpoint"
    write_result(layout.selection_metrics, SelectionResult(
        selected="r1@5.5", policy="qad", band=(0.9, 1.0), reason="", table=[], runner_up=None,
        could_compress_further=False))
    assert _declared_path("{selected}/checkpoint", params, layout, None) == layout.sweep("5.5") / "checkpoint"

    # the QAD key moves with the selected checkpoint's files, and only then
    class Job:
        params_file, overrides = str(PROJECT_PARAMS), []
    Job.layout = layout
    key = lambda: stage_cache_key(None, {"stage": "qad", "recipe": None, "job": Job})  # noqa: E731
    checkpoint = layout.sweep("5.5") / "checkpoint"
    checkpoint.mkdir(parents=True)
    (checkpoint / "model.safetensors").write_bytes(b"one")
    before = key()
    assert key() == before
    (checkpoint / "model.safetensors").write_bytes(b"two!")  # a PTQ run again: other bytes
    assert key() != before
