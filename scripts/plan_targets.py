"""The plan for five real models on two GPU nodes, as docs/memory-plan.md's table: `python scripts/plan_targets.py`.

Each model's config is the copy shipped in profiles/configs/ (no weights, no hub access); the
settings are profiles/llama-3.1-8b_8xh100.yaml's with `hardware.device_map: auto`, so the plan
settles `ptq.gpus_per_recipe` (the fewest GPUs a recipe fits on). `tests/test_targets.py` checks
that docs/memory-plan.md's table is this script's output.
"""

from __future__ import annotations

from qad_pipeline.plan import capacity, memory, plan_table
from qad_pipeline.core.config import PROJECT_ROOT, ConfigError, load_params
from qad_pipeline.core.stages import with_sweep

PROFILE = PROJECT_ROOT / "profiles" / "llama-3.1-8b_8xh100.yaml"
MODELS = ["meta-llama/Llama-3.1-8B", "meta-llama/Llama-3.1-70B", "Qwen/Qwen3-30B-A3B", "nvidia/Nemotron-H-8B-Base-8K",
          "google/gemma-3-27b-it"]
TARGETS = ["8xH100-80GB", "8xB200-180GB"]
GiB = 2**30


def row(model: str, target: str) -> list[str]:
    params = load_params(PROFILE, [f"base_model.path={model}", "hardware.device_map=auto"])
    cap = capacity.target_capacity(target)
    estimates = memory.plan(params, cap)
    per_recipe = memory.settled(params, cap, with_sweep(params)).ptq.gpus_per_recipe
    ptq = [e for e in estimates if e.stage.startswith("ptq/")]
    qad = next(e for e in estimates if e.stage == "qad")
    offloaded = memory.estimate("qad", params.model_copy(update={"qad": params.qad.model_copy(update={"offload": True})}),
                                cap)
    try:
        memory.check_fits(estimates)
        verdict = "fits"
    except ConfigError as err:
        verdict = "refused: " + str(err).split(";")[0].split(", even")[0]
    return [model.split("/")[1], target, f"{per_recipe} × {ptq[0].max_parallel}",
            f"{max(e.device_bytes for e in ptq) / GiB:.0f}", f"{qad.device_bytes / GiB:.0f}", f"{offloaded.device_bytes / GiB:.0f}",
            f"{sum(e.disk_bytes for e in estimates) / GiB:,.0f}", plan_table.time_text(plan_table.run_seconds(estimates)), verdict]


def table() -> str:
    head = ["model", "node", "GPUs per recipe × at once", "PTQ GiB/GPU", "QAD GiB/GPU", "with qad.offload", "disk GiB", "time", "plan"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(row(m, t)) + " |" for m in MODELS for t in TARGETS]
    return "\n".join(lines)


if __name__ == "__main__":
    print(table())
