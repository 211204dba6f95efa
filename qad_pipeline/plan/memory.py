"""The memory plan: each stage's peak host and GPU memory, estimated before any weights load.

    qad-pipeline plan [--params params.yaml] [--set section.key=value ...] [--base-model PATH] [--json]

`plan(params)` estimates the peak resident memory of every stage process from the model's config
(its shapes come from building the model on PyTorch's meta device: no weight is read), the
settings and the recipes. `check_fits(plan(params))`, which the preflight of every run calls,
refuses a setting that cannot fit, naming the knob to turn and the largest value that fits.
`recipe_parallelism(params)` is how many PTQ recipes `ptq.max_parallel: auto` runs at once.
`settled(params, cap)` chooses what the other `auto` settings stand for: QAD's GPUs (the fewest it
fits on) and micro-batch (the largest that fits, accumulated to `qad.effective_batch_size` rows a
step), the GPUs a recipe's model spreads over, eval's batch. `qad_pipeline.plan.plan_table` prints it.

The estimate of each phase, term by term, is `qad_pipeline.plan.memory_model` (its docstring has the
formula and where its constants were fitted).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from qad_pipeline.plan import costs, eval_costs, gpus
from qad_pipeline.plan.capacity import Capacity, capacity
from qad_pipeline.core.config import ConfigError, Params
from qad_pipeline.plan.memory_model import (CUDA_CONTEXT, CUDA_HOST_EXTRA, DTYPE_BYTES, PROCESS_BASE, GiB, MiB, ModelShape,
                                       Phase, model_shape, recipe_algorithm, stage_memory, stage_phases)
from qad_pipeline.core.stages import QAD, RECIPES, STAGES, SWEEP_POINTS, planned, stage_of, with_sweep

@dataclass
class StageEstimate:
    """One stage process's estimated peak; `terms` are its peak phase's terms (bytes)."""

    stage: str
    host_bytes: int
    device_bytes: int  # per GPU
    max_parallel: int  # processes of this stage at once: PTQ recipes, QAD's qad.num_gpus
    device: str
    phase: str
    terms: dict[str, int] = field(default_factory=dict)
    fits: bool = True
    advice: str | None = None  # why it does not fit, and the knob to turn
    host_bytes_other: int = 0  # each of the other processes at once (QAD: ranks but the first)
    gpus: tuple[str, ...] = ()  # the GPUs it gets (its CUDA_VISIBLE_DEVICES: gpus.layout; qad: all its ranks')
    disk_bytes: int = 0  # what it writes under the out-root, at its peak (qad_pipeline.plan.costs)
    seconds: float | None = None  # one process's estimated wall time (None: no GPU model to estimate for)
    evaluation: dict | None = None  # what it evaluates: requests, tokens, window tokens (qad_pipeline.plan.eval_costs)

    @property
    def host_total(self) -> int:
        """The host memory of all its processes at once."""
        return self.host_bytes + (self.max_parallel - 1) * self.host_bytes_other

    def as_dict(self) -> dict:
        return {**asdict(self), "host_total_bytes": self.host_total}


def stages(params: Params, sweep_only: bool = False) -> list[str]:
    """The stage processes a run starts, in order (`ptq/<recipe>` for each recipe, `sweep/<budget>`
    for each budget); `sweep_only`: the BPE sweep's flow."""
    return [stage.summary_key(recipe) for stage, recipe in planned(params, sweep_only)]


# -- from phases to estimates ---------------------------------------------------------------------


def _placed(phase: Phase, params: Params, cap: Capacity, stage: str) -> tuple[dict[str, int], dict[str, int]]:
    """(host terms, terms per GPU) of one phase on `cap.device`."""
    model = {**phase.resident, **phase.transient}
    if cap.device == "cpu":
        return {"process": PROCESS_BASE, **model, **phase.host}, {}
    host = {"process": PROCESS_BASE + CUDA_HOST_EXTRA, **phase.host}
    if params.hardware.device_map == "auto" and gpus.ranks(stage, params) is None and cap.gpu_bytes:
        # spread over the GPUs the process gets: a recipe's gpus_per_recipe, another stage's all
        given = gpus.needed(stage.split("/")[0], params, len(cap.gpu_bytes))
        resident = sum(phase.resident.values())
        room = given * max(0, min(cap.gpu_bytes) - CUDA_CONTEXT - sum(phase.transient.values()))
        if resident > room:  # accelerate offloads what the GPUs cannot hold to the host
            host["offloaded"] = resident - room
        return host, {"cuda_context": CUDA_CONTEXT, "weights_share": min(resident, room) // given, **phase.transient}
    return host, {"cuda_context": CUDA_CONTEXT, **model}


def estimate(stage: str, params: Params, cap: Capacity, shape: ModelShape | None = None) -> StageEstimate:
    """One stage process's peak host and per-GPU bytes (the max over its phases), each `auto` settled
    for `cap` first."""
    if not params.qad.settled or params.eval.batch_size == "auto":
        params = settled(params, cap)
    return _estimate(stage, params, cap, shape)


def _estimate(stage: str, params: Params, cap: Capacity, shape: ModelShape | None = None) -> StageEstimate:
    model = stage_memory(stage.split("/")[0])
    if isinstance(model, int):  # a process that loads no model (calibration, selection, the sweep's curve)
        return StageEstimate(stage, model, 0, 1, "cpu", "no model", {"process": model}, host_bytes_other=model)
    shape = shape or model_shape(params.base_model)
    placed = [(p.name, *_placed(p, params, cap, stage)) for p in stage_phases(stage, params, shape, cap.device)]
    on_gpu = cap.device == "cuda"
    name, host, device = max(placed, key=lambda x: sum((x[2] if on_gpu else x[1]).values()))
    terms = {**device, **{f"host:{k}": v for k, v in host.items()}} if on_gpu else host
    others = max(sum(v for k, v in h.items() if not k.startswith("rank0_")) for _, h, _ in placed)
    return StageEstimate(stage, max(sum(h.values()) for _, h, _ in placed), max(sum(g.values()) for *_, g in placed),
                         1, cap.device, name, terms, host_bytes_other=others)


# -- parallelism, fitting, refusing ---------------------------------------------------------------


def _gpus_holding(device_bytes: int, cap: Capacity) -> int:
    return sum(1 for free in cap.gpu_bytes if device_bytes <= free)


def recipe_parallelism(params: Params, cap: Capacity | None = None, sweep: bool = False) -> int:
    """Per-item processes at once (PTQ recipes; with `sweep`, the sweep's budgets too, which share
    the recipes' slots): `ptq.max_parallel`, or for `auto` as many as the free host memory holds
    (CPU), or one per `ptq.gpus_per_recipe` visible GPUs that hold one (CUDA: `qad_pipeline.plan.gpus`),
    each `auto` settled first (`settled`). At least 1: `check_fits` refuses one that does not fit at all."""
    if cap is not None or params.ptq.max_parallel == "auto":
        cap = cap or capacity(params.hardware)
        params = settled(params, cap, sweep)
    per_item = [*map(RECIPES.summary_key, params.ptq.recipes), *(map(SWEEP_POINTS.summary_key, params.sweep.points) if sweep else [])]
    items = max(len(params.ptq.recipes), len(params.sweep.points) if sweep else 0)
    if params.ptq.max_parallel != "auto":
        at_once = min(params.ptq.max_parallel, items)
        if cap is not None and cap.device == "cuda" and cap.gpu_bytes:  # no more than the GPUs' slots
            at_once = min(at_once, max(1, gpus.slots(params, len(cap.gpu_bytes))))
        return at_once
    if cap.device == "cuda" and not cap.gpu_bytes:  # the recipes run on GPU workers, one each
        return items
    peaks = [estimate(stage, params, cap) for stage in per_item]
    fit = min(items, cap.host_bytes // max(e.host_bytes for e in peaks))
    if cap.device == "cuda" and cap.gpu_bytes:
        holding = _gpus_holding(max(e.device_bytes for e in peaks), cap)
        fit = min(fit, holding // gpus.per_recipe(params, len(cap.gpu_bytes)))
    return max(1, fit)


def _gib(nbytes: int) -> str:
    return f"~{nbytes / GiB:.1f} GiB"


def _why_not(est: StageEstimate, cap: Capacity, params: Params) -> str | None:
    """Why `est`, run `est.max_parallel` times at once, does not fit (None when it does). Nothing
    is checked for CUDA stages where no GPU is seen: they run on other machines (GPU workers)."""
    at_once = est.max_parallel
    if cap.device == "cuda" and not cap.gpu_bytes:
        return None
    if est.host_total > cap.host_bytes:
        times = f" ({at_once} processes at once)" if at_once > 1 else ""
        return f"needs {_gib(est.host_total)} of host memory{times}, {_gib(cap.host_bytes)} is usable"
    if cap.device == "cuda" and cap.gpu_bytes:
        needs = at_once if gpus.ranks(est.stage, params) else 1
        if needs > len(cap.gpu_bytes):
            node = f"the target {cap.target} has" if cap.target else "this machine sees"
            return f"runs on qad.num_gpus = {needs} GPUs, {node} {len(cap.gpu_bytes)}"
        if _gpus_holding(est.device_bytes, cap) < needs:
            return f"needs {_gib(est.device_bytes)} per GPU, {_gib(max(cap.gpu_bytes))} is usable"
    return None


def _with(params: Params, knob: str, value) -> Params:
    section, key = knob.split(".")
    return params.model_copy(update={section: getattr(params, section).model_copy(update={key: value})})


def _value(params: Params, knob: str):
    section, key = knob.split(".")
    return getattr(getattr(params, section), key)


def _bound(params: Params, knob: str) -> int:
    """A knob's value as a size; null (ptq.mse_chunk_rows: whole weights) is unbounded."""
    value = _value(params, knob)
    return 2**31 if value is None else value


def _fits(stage: str, params: Params, cap: Capacity, at_once: int) -> bool:
    est = _estimate(stage, params, cap)
    est.max_parallel = at_once
    return _why_not(est, cap, params) is None


def _largest(stage: str, params: Params, cap: Capacity, at_once: int, knob: str, step: int = 1) -> int | None:
    """The largest multiple of `step`, up to `knob`'s value, at which `stage` fits (binary search:
    every estimate grows with its knobs)."""
    lo, hi = 1, _bound(params, knob) // step
    if hi < 1 or not _fits(stage, _with(params, knob, step), cap, at_once):
        return None
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if _fits(stage, _with(params, knob, mid * step), cap, at_once) else (lo, mid - 1)
    return lo * step


def _qad_switches(params: Params) -> list[tuple[str, object]]:
    """QAD's on/off settings that lower its memory and are off: each is tried alone."""
    q = params.qad
    switches = [("qad.gradient_checkpointing", True)] if not q.gradient_checkpointing else []
    if q.processes > 1 and q.sharding == "ddp":
        switches.append(("qad.sharding", "fsdp"))
    if q.processes > 1 and not q.offload:
        switches.append(("qad.offload", True))  # with fsdp (a ddp run is offered fsdp first)
    return switches


def _ptq_switches(stage: str, params: Params) -> list[tuple[str, object]]:
    """A GPTQ recipe holds every weight's Hessian at once unless ptq.layerwise is true (one layer's)."""
    declared, recipe = stage_of(stage)
    gptq = declared is RECIPES and recipe_algorithm(params.recipe_path(recipe))["method"] == "gptq"
    return [("ptq.layerwise", True)] if gptq and params.ptq.layerwise is not True else []


def advice(est: StageEstimate, params: Params, cap: Capacity, why: str) -> str:
    """What to turn so that `est` fits: the knob of its peak phase first, with the largest value
    that fits, then the stage's other knobs; else what no setting of this run can change."""
    stage, name, at_once, ranked = est.stage, est.stage.split("/")[0], est.max_parallel, bool(gpus.ranks(est.stage, params))
    knobs = STAGES[name].knobs
    if not knobs:
        return f"{stage}: {why} (the process alone); use a machine with more memory"
    if STAGES[name].over_recipes and at_once > 1 and _fits(stage, params, cap, 1):
        most = max(1, cap.host_bytes // est.host_bytes)
        return f"{stage}: ptq.max_parallel={params.ptq.max_parallel} {why}; the largest that fits is {most}"
    settings = _qad_switches(params) if ranked else _ptq_switches(stage, params)
    switches = [f"{knob}={value}".replace("True", "true") for knob, value in settings
                if _fits(stage, _with(params, knob, value), cap, at_once)]
    alternative = f"; or set {' or '.join(switches)}" if switches else ""
    phase_knob = next((p.knob for p in stage_phases(stage, params, model_shape(params.base_model), cap.device)
                       if p.name == est.phase), None)
    def knob_that_fits(candidate: Params) -> tuple[str, int] | None:
        for knob in sorted(knobs, key=lambda k: k != phase_knob):
            step = candidate.qad.processes if knob == "qad.batch_size" else 1  # rows split evenly over processes
            most = _largest(stage, candidate, cap, at_once, knob, step)
            if most is not None and most < _bound(candidate, knob):
                return knob, most
        return None

    def lowered(knob: str, most: int) -> str:
        at = f" at qad.seq_len {params.qad.seq_len}" if knob == "qad.batch_size" else ""
        value = "null" if _value(params, knob) is None else _value(params, knob)
        return f"{knob}={value}{at} {why}; the largest that fits is {most}"

    found = knob_that_fits(params)
    if found:
        return f"{stage}: {lowered(*found)}{alternative}"
    if switches:
        return f"{stage}: {why}; set {' or '.join(switches)}"
    for knob, value in settings:  # a switch and a smaller knob together
        found = knob_that_fits(_with(params, knob, value))
        if found:
            return f"{stage}: {lowered(*found)} with {knob}={str(value).lower()}; set both"
    weights = model_shape(params.base_model).params * DTYPE_BYTES[params.base_model.dtype]
    if est.host_total > cap.host_bytes:
        where = "a machine with more host memory" + (", or GPUs" if cap.device == "cpu" else "")
    elif ranked:
        where = "more GPUs (qad.num_gpus, qad.num_nodes with qad.sharding=fsdp and qad.offload=true)"
    elif params.hardware.device_map != "auto":
        where = "hardware.device_map=auto (spread the model over the GPUs)"
    else:
        where = "more or larger GPUs"
    largest = max(est.terms, key=est.terms.get)
    return (f"{stage}: {why}, even at batch size 1 (the weights alone are {_gib(weights)}, the largest term is "
            f"{largest} {_gib(est.terms[largest])} in its {est.phase} phase); use {where}")


AUTO_KEYS = ("qad.num_gpus", "qad.batch_size", "qad.grad_accum", "eval.batch_size")  # what `auto` may stand for


def settled_overrides(raw: Params, chosen: Params) -> list[str]:
    """The values the memory plan chose for the keys `raw` leaves at `auto`, as `section.key=value`
    overrides: what a run passes on to its stage processes (and the QAD stage to its torchrun
    processes), so that each uses the plan's choice rather than choosing again."""
    out = []
    for key in AUTO_KEYS:
        section, name = key.split(".")
        if getattr(getattr(raw, section), name) == "auto":
            out.append(f"{key}={getattr(getattr(chosen, section), name)}")
    return out


AUTO_EVAL_BATCH = 32  # eval.batch_size auto's ceiling (params.yaml's comment says it): more rows buy little


def settled(params: Params, cap: Capacity, sweep: bool = False) -> Params:
    """`params` with each `auto` the plan chooses settled against `cap`, in this order: QAD's GPUs
    and batches (`_settled_qad`), `ptq.gpus_per_recipe` for `device_map: auto` on GPUs (the fewest
    over which every recipe and sweep budget fits without offloading to the host, else all), then
    `eval.batch_size` (the largest up to AUTO_EVAL_BATCH at which every evaluating stage fits)."""
    params = _settled_qad(params, cap)
    at_one = _with(params, "eval.batch_size", 1) if params.eval.batch_size == "auto" else params
    return _settled_eval(_with(params, "ptq.gpus_per_recipe", _recipe_gpus(at_one, cap, sweep)), cap, sweep)


def settled_here(params: Params, sweep: bool = False) -> Params:
    """`params` settled for this machine (`settled`), unless nothing is left at `auto` (a run passed
    its plan's choices on: `settled_overrides`)."""
    if params.qad.settled and params.eval.batch_size != "auto" and (
            params.ptq.gpus_per_recipe != "auto" or params.hardware.device_map != "auto"):
        return params
    return settled(params, capacity(params.hardware), sweep)


def _recipe_gpus(params: Params, cap: Capacity, sweep: bool) -> int | str:
    if params.ptq.gpus_per_recipe != "auto" or params.hardware.device_map != "auto" or not cap.gpu_bytes:
        return params.ptq.gpus_per_recipe
    per_item = [*map(RECIPES.summary_key, params.ptq.recipes), *(map(SWEEP_POINTS.summary_key, params.sweep.points) if sweep else [])]
    for k in range(1, len(cap.gpu_bytes)):
        candidate = _with(params, "ptq.gpus_per_recipe", k)
        estimates = [_estimate(stage, candidate, cap) for stage in per_item]
        if all(_why_not(e, cap, candidate) is None and "host:offloaded" not in e.terms for e in estimates):
            return k
    return len(cap.gpu_bytes)


def _micro_batches(params: Params) -> list[int]:
    """The micro-batches QAD may take, smallest first: the explicit `qad.batch_size`, or with `auto`
    the divisors of `qad.effective_batch_size` that split evenly over its processes."""
    q = params.qad
    if q.batch_size != "auto":
        return [q.batch_size] if q.batch_size % q.processes == 0 else []
    return [m for m in range(1, q.effective_batch_size + 1) if q.effective_batch_size % m == 0 and m % q.processes == 0]


def _with_batch(params: Params, rows: int) -> Params:
    q = params.qad
    accum = q.effective_batch_size // rows if q.batch_size == "auto" else q.grad_accum
    return _with(_with(params, "qad.batch_size", rows), "qad.grad_accum", accum)


def _settled_qad(params: Params, cap: Capacity) -> Params:
    """`qad.num_gpus: auto`: the fewest GPUs of `cap` over which QAD fits (1 without GPUs: on the
    CPU, or GPUs elsewhere); `qad.batch_size: auto`: the largest micro-batch that fits there, with
    `grad_accum` micro-batches a step making `qad.effective_batch_size` rows. When nothing fits: the
    most GPUs at the smallest micro-batch, which the plan refuses naming what to turn."""
    q = params.qad
    if q.settled:
        return params
    seen = len(cap.gpu_bytes) if cap.device == "cuda" else 0
    least = 2 if q.offload and q.num_nodes == 1 else 1  # offload shards over more than one process
    counts = [q.num_gpus] if q.num_gpus != "auto" else list(range(least, max(seen, 1) + 1))
    if not counts:
        raise ConfigError(f"qad.offload = true needs more than one process, and qad.num_gpus auto has {seen} GPU(s) "
                          "to choose from here; set qad.offload=false, or qad.num_gpus on a machine with GPUs")
    choices = [(k, rows) for k in counts for rows in [_micro_batches(_with(params, "qad.num_gpus", k))] if rows]
    if not choices:
        raise ConfigError(f"qad.effective_batch_size = {q.effective_batch_size} does not split evenly over "
                          f"qad.num_gpus = {q.num_gpus} x qad.num_nodes = {q.num_nodes} processes; make it a multiple")
    for k, rows in choices:
        on_k = _with(params, "qad.num_gpus", k)
        fitting = [m for m in rows if _fits(QAD.name, _with_batch(on_k, m), cap, k)]
        if fitting:
            return _with_batch(on_k, max(fitting))
    k, rows = choices[-1]
    return _with_batch(_with(params, "qad.num_gpus", k), rows[0])


def _settled_eval(params: Params, cap: Capacity, sweep: bool) -> Params:
    """`eval.batch_size: auto`: the largest up to AUTO_EVAL_BATCH at which every planned stage
    whose knob it is fits alone (1 when none does: the plan refuses it)."""
    if params.eval.batch_size != "auto":
        return params
    evaluating = [key for key in stages(params, sweep) if "eval.batch_size" in STAGES[key.split("/")[0]].knobs]
    top = _with(params, "eval.batch_size", AUTO_EVAL_BATCH)
    most = min((_largest(key, top, cap, 1, "eval.batch_size") or 1 for key in evaluating), default=AUTO_EVAL_BATCH)
    return _with(params, "eval.batch_size", most)


def plan(params: Params, cap: Capacity | None = None, sweep_only: bool = False) -> list[StageEstimate]:
    """Every stage's estimate, with the processes it runs at once and `advice` where it does not fit
    (every `auto` settled first: `settled`)."""
    cap = cap or capacity(params.hardware)
    params = settled(params, cap, sweep=sweep_only or with_sweep(params))
    recipes_at_once = recipe_parallelism(params, cap, sweep=sweep_only or with_sweep(params))
    shape = model_shape(params.base_model)
    runs = [(declared.name, item) for declared, item in planned(params, sweep_only)]
    names = cap.gpu_names or gpus.visible(len(cap.gpu_bytes))
    placed = gpus.layout(runs, params, names, recipes_at_once) if cap.gpu_bytes else {}
    out = []
    gpu = costs.target_gpu(cap.target)  # the GPU a measured QAD MFU is looked up for
    for stage in stages(params, sweep_only):
        est = estimate(stage, params, cap, shape)
        est.disk_bytes = costs.disk_bytes(stage, params, shape)
        est.seconds = costs.seconds(stage, params, shape, cap.bf16_flops, gpu)
        est.evaluation = (cost := eval_costs.stage_cost(stage, params)) and cost.as_dict()
        est.max_parallel = recipes_at_once if STAGES[stage.split("/")[0]].per_recipe else gpus.ranks(stage, params) or 1
        est.gpus = placed.get(stage, ())
        why = _why_not(est, cap, params)
        if why is not None:
            est.fits, est.advice = False, advice(est, params, cap, why)
        out.append(est)
    return out


def check_fits(estimates: list[StageEstimate]) -> None:
    """Raise ConfigError for the first stage that does not fit, naming the knob to turn."""
    for est in estimates:
        if not est.fits:
            raise ConfigError(est.advice)
