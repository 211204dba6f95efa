"""The memory plan: each stage's peak host and GPU memory, estimated before any weights load.

    qad-pipeline plan [--params params.yaml] [--set section.key=value ...] [--base-model PATH] [--json]

`plan(params)` estimates the peak resident memory of every stage process from the model's config
(its shapes come from building the model on PyTorch's meta device: no weight is read), the
settings and the recipes. `check_fits(plan(params))`, which the preflight of every run calls,
refuses a setting that cannot fit, naming the knob to turn and the largest value that fits.
`recipe_parallelism(params)` is how many PTQ recipes `ptq.max_parallel: auto` runs at once.

The formula. N parameters, Nw of them in weight matrices a recipe may quantize (all but the input
embeddings), Nmax the largest matrix, d bytes per element of `base_model.dtype`, V the
vocabulary, H the hidden size, F the MLP width per token, L layers, B and T a stage's batch size
and sequence length, a the bytes of `qad.compute_dtype`. A stage's peak is its largest phase; a
phase is a sum of named terms (`StageEstimate.terms` are the peak phase's), in bytes:

    process           PROCESS_BASE: Python, torch, transformers, Model Optimizer, lm-eval imported
    weights           N·d;  quantizer_state Nw/16·4 for static NVFP4 recipes (MSE, four-over-six:
                      a float32 amax per 16-element block; max calibration keeps one per tensor)
    fake_quant        a quantized forward fake-quantizes one weight at a time: Nmax·4·copies
                      (FAKE_QUANT_COPIES: the CPU emulation's float32 temporaries, more for static
                      block scales than for dynamic ones; one output on CUDA)
    activations       one layer at a time in a no-grad forward: B·T·(ACT_EVAL_H·H + ACT_EVAL_F·F)·d,
    mamba_scan        and for Mamba-2 mixers the torch scan's B·T·chunk·heads·4·MAMBA_COPIES
    eval_stream       the streamed perplexity/KL pass (reference.py), chunks of c = LOGIT_CHUNK_TOKENS
                      positions (rounded to B): hidden_states B·T·H·d + the forward above (the
                      allocator keeps its freed blocks) + eval_logits c·V·(d + EVAL_LOGIT_BYTES)
                      + previous_chunk c·V·PREVIOUS_CHUNK_BYTES (still held by the loop), or in the
                      baseline reference_terms c·V·REFERENCE_WRITE_BYTES (top-k, tail samples)
    lm_eval           lm_eval_harness LM_EVAL_HARNESS + B·R·V·d·LM_EVAL_LOGIT_COPIES + the forward,
                      R the longest request: LM_EVAL_PROJECT_TOKENS for the project's tasks, else
                      LM_EVAL_FOREIGN_TOKENS (lm-eval's default), capped by the model's maximum
    calibrate         PTQ's forward loop: B_c·T_c·V·d logits + the forward + fake_quant;
    mse_search        static recipes' per-block scale search: Nmax·4·MSE_COPIES, or
                      Nmax·4·MSE_SWEEP_COPIES when it also sweeps the FP8 scale (fp8_scale_sweep)
    qad (per process) teacher N·d + student_fp32 N·4 + grads N·4 + adamw 2·N·4 (the last three
                      divided by qad.num_gpus with fsdp; ddp adds ddp_buckets N·4) + the
                      fake-quantized weights saved for backward Nw·a + activations
                      L·b·T·(ACT_TRAIN_H·H + ACT_TRAIN_F·F)·a (gradient checkpointing: Nw·a/L and
                      L·b·T·H·a + one layer) + kd_logits b·T·V·4·KD_LOGIT_COPIES, b the rows per
                      process, qad.batch_size / qad.num_gpus
    export            the student + the exported tensors read back (at most N·d) + the dequantized
                      BF16 reload N·2 of the check (on the host whatever the device)

On CUDA the model's terms go to `device_bytes` (per GPU, + CUDA_CONTEXT) and the host keeps the
process (+ CUDA_HOST_EXTRA) and what is copied to it (a checkpoint shard while saving, the
export's read-back); on the CPU everything is `host_bytes`. `hardware.device_map: auto` spreads
one model over every visible GPU and offloads what they cannot hold to the host. The constants
were fitted on the CPU with `python benchmarks/memory_bench.py` (the demo model and a
100M-parameter Llama, each stage within 30 % of its measured peak RSS); the CUDA ones are
assumptions, not measurements. Memory-mapped files (the BF16 reference, checkpoints being read)
are reclaimable page cache and left out.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from functools import lru_cache
from pathlib import Path

import yaml

from qad_pipeline.config import BaseModelParams, ConfigError, HardwareParams, Params, resolve

GiB, MiB = 2**30, 2**20
# Fitted on the CPU (torch 2.13, benchmarks/memory_bench.py); the module docstring names each term.
PROCESS_BASE = 600 * MiB          # a model stage's process before it loads anything
LIGHT_PROCESS_BASE = 540 * MiB    # calibration: tokenizer and datasets, no model
SELECTION_PROCESS = 620 * MiB     # selection: re-checks recipe aliases with Model Optimizer on the meta device (605 MB measured)
ACT_EVAL_H, ACT_EVAL_F = 6, 3     # one layer's live activations per token, no grad (x H, x F)
ACT_TRAIN_H, ACT_TRAIN_F = 16, 6  # saved for backward per layer per token (quantizer inputs included)
MAMBA_COPIES = 6
EVAL_LOGIT_BYTES = 8              # per [chunk, vocab] element: its float32 copy and the log-probs
PREVIOUS_CHUNK_BYTES = 2
REFERENCE_WRITE_BYTES = 7
LM_EVAL_HARNESS = 150 * MiB       # lm-eval's tasks, requests and results
LM_EVAL_LOGIT_COPIES = 2          # the logits and their log_softmax, in the model's dtype
LM_EVAL_PROJECT_TOKENS = 128      # heldout_cloze / heldout_continuation: 40 words + the continuation
LM_EVAL_FOREIGN_TOKENS = 2048     # lm-eval's default maximum length
KD_LOGIT_COPIES = 8               # float32 [tokens, vocab] blocks through the KD loss and its backward
FAKE_QUANT_COPIES = {"static": 2, "dynamic": 1}  # the CPU emulation's float32 temporaries (CUDA: 1)
MSE_COPIES = 6
MSE_SWEEP_COPIES = 22             # fitted: nvfp4_mse (fp8_scale_sweep) on the 100M Llama peaked at 2,957 MiB
LOGIT_CHUNK_TOKENS = 2048         # = qad_pipeline.reference.LOGIT_CHUNK_TOKENS (that module imports torch)
# CUDA, not measured: a process's context and workspaces per GPU, the host side of the CUDA
# runtime, and transformers' default checkpoint shard (each is copied to the host while saving).
CUDA_CONTEXT = 1 * GiB
CUDA_HOST_EXTRA = 1 * GiB
SAVE_SHARD = 50 * 10**9
HEADROOM = 0.9                    # the share of the free memory the plan lets the stages use
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


@dataclass(frozen=True)
class ModelShape:
    """What the formula needs to know about the model, from its config alone."""

    params: int
    matrix_params: int  # Nw
    largest_matrix: int  # Nmax
    layers: int
    hidden: int
    ffn: int  # F: the MLP width per token (routed experts per token x their width + shared ones)
    vocab: int
    max_positions: int | None
    mamba_layers: int = 0
    mamba_scan: int = 0  # chunk size x heads of the widest Mamba-2 mixer


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

    @property
    def host_total(self) -> int:
        """The host memory of all its processes at once."""
        return self.host_bytes + (self.max_parallel - 1) * self.host_bytes_other

    def as_dict(self) -> dict:
        return {**asdict(self), "host_total_bytes": self.host_total}


@dataclass(frozen=True)
class Capacity:
    """What the stages may use: host bytes and bytes per visible GPU, HEADROOM applied."""

    device: str  # "cpu" | "cuda"
    host_bytes: int
    gpu_bytes: tuple[int, ...] = ()  # none seen on CUDA: the stages run elsewhere, nothing is checked


# -- the model, from its config -------------------------------------------------------------------


@lru_cache(maxsize=8)
def _shape(path: str, revision: str | None, trust_remote_code: bool) -> ModelShape:
    import torch
    from transformers import AutoModelForCausalLM

    from qad_pipeline.modeling import load_config, max_positions

    config = load_config(BaseModelParams(path=path, revision=revision, trust_remote_code=trust_remote_code))
    text = config.get_text_config()
    with torch.device("meta"):  # every tensor on the meta device: shapes only, nothing allocated or read
        model = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
    embeddings = model.get_input_embeddings().weight
    matrices = [p.numel() for p in model.parameters() if p.ndim >= 2 and p is not embeddings]
    ffn = getattr(text, "intermediate_size", None) or 4 * text.hidden_size
    if getattr(text, "num_experts_per_tok", None) and getattr(text, "moe_intermediate_size", None):
        shared = (getattr(text, "moe_shared_expert_intermediate_size", None)
                  or getattr(text, "shared_expert_intermediate_size", None) or 0)
        ffn = max(ffn, text.num_experts_per_tok * text.moe_intermediate_size + shared)
    mamba = [m for m in model.modules() if "Mamba" in type(m).__name__ and hasattr(m, "chunk_size")]
    return ModelShape(
        params=sum(p.numel() for p in model.parameters()), matrix_params=sum(matrices),
        largest_matrix=max(matrices), layers=text.num_hidden_layers, hidden=text.hidden_size, ffn=ffn,
        vocab=text.vocab_size, max_positions=max_positions(text), mamba_layers=len(mamba),
        mamba_scan=max((m.chunk_size * m.num_heads for m in mamba), default=0),
    )


def model_shape(base: BaseModelParams) -> ModelShape:
    return _shape(base.path, base.revision, base.trust_remote_code)


# -- what the machine has -------------------------------------------------------------------------


def _host_free() -> int:
    """MemAvailable, or less where this process's cgroup (a container's limit) leaves less."""
    try:
        info = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
        free = int(info["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError):
        import psutil

        free = psutil.virtual_memory().available
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit != "max":
            free = min(free, int(limit) - int(Path("/sys/fs/cgroup/memory.current").read_text()))
    except (OSError, ValueError):
        pass
    return free


def _gpu_free() -> list[int]:
    """Free bytes per visible GPU, asked in a child process so that no CUDA context stays here."""
    code = "import torch; print([torch.cuda.mem_get_info(i)[0] for i in range(torch.cuda.device_count())])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    return json.loads(out.stdout.strip().splitlines()[-1]) if out.returncode == 0 and out.stdout.strip() else []


def planned_device(hardware: HardwareParams) -> str:
    if hardware.device == "cuda":  # also where this process sees no GPU (a flow's control node)
        return "cuda"
    from qad_pipeline.modeling import resolve_device

    return resolve_device(hardware)


def capacity(hardware: HardwareParams) -> Capacity:
    """`hardware.host_memory_gb` (GiB) or the free host memory, and each visible GPU's free memory,
    within `hardware.max_memory`."""
    from accelerate.utils import convert_file_size_to_int

    device = planned_device(hardware)
    caps = {k: convert_file_size_to_int(v) for k, v in (hardware.max_memory or {}).items()}
    host = hardware.host_memory_gb * GiB if hardware.host_memory_gb is not None else _host_free()
    host = min(host, caps.get("cpu", host))
    gpus = [min(free, caps.get(str(i), free)) for i, free in enumerate(_gpu_free() if device == "cuda" else [])]
    return Capacity(device, int(host * HEADROOM), tuple(int(g * HEADROOM) for g in gpus))


# -- each stage's phases --------------------------------------------------------------------------


@dataclass(frozen=True)
class Phase:
    """One moment of a stage: `resident` and `transient` terms live where the model runs, `host`
    terms on the host whatever the device; `knob` is the setting that scales the phase."""

    name: str
    knob: str | None
    resident: dict[str, int]
    transient: dict[str, int] = field(default_factory=dict)
    host: dict[str, int] = field(default_factory=dict)


def static_block_scales(recipe_path: Path) -> bool:
    """The recipe calibrates NVFP4 block scales statically (MSE, four-over-six), not by max."""
    algorithm = (yaml.safe_load(recipe_path.read_text()).get("quantize") or {}).get("algorithm")
    return (algorithm.get("method") if isinstance(algorithm, dict) else algorithm) not in (None, "max")


def scale_sweep(recipe_path: Path) -> bool:
    """The recipe's MSE search also sweeps the FP8 per-block scale (`fp8_scale_sweep: true`)."""
    algorithm = (yaml.safe_load(recipe_path.read_text()).get("quantize") or {}).get("algorithm")
    return isinstance(algorithm, dict) and bool(algorithm.get("fp8_scale_sweep"))


def _any_static(params: Params) -> bool:
    """Whether the selected recipe (unknown before selection) may be a static one."""
    return any(static_block_scales(params.recipe_path(r)) for r in params.ptq.recipes)


def _weights(params: Params, shape: ModelShape, static: bool) -> dict[str, int]:
    out = {"weights": shape.params * DTYPE_BYTES[params.base_model.dtype]}
    return {**out, "quantizer_state": shape.matrix_params // 16 * 4} if static else out


def _forward(tokens: int, shape: ModelShape, nbytes: int) -> dict[str, int]:
    """The live activations of a no-grad forward (one layer at a time)."""
    out = {"activations": tokens * (ACT_EVAL_H * shape.hidden + ACT_EVAL_F * shape.ffn) * nbytes}
    if shape.mamba_layers:
        out["mamba_scan"] = tokens * shape.mamba_scan * 4 * MAMBA_COPIES
    return out


def _fake_quant(shape: ModelShape, device: str, static: bool) -> dict[str, int]:
    copies = FAKE_QUANT_COPIES["static" if static else "dynamic"] if device == "cpu" else 1
    return {"fake_quant": shape.largest_matrix * 4 * copies}


def _save_copy(params: Params, shape: ModelShape, device: str) -> dict[str, int]:
    """Saving from a GPU copies each checkpoint shard to the host (CPU tensors are written in place)."""
    weights = shape.params * DTYPE_BYTES[params.base_model.dtype]
    return {"save_shard": min(weights, SAVE_SHARD)} if device == "cuda" else {}


def _request_tokens(params: Params, shape: ModelShape) -> int:
    foreign = min(LM_EVAL_FOREIGN_TOKENS, shape.max_positions or LM_EVAL_FOREIGN_TOKENS)
    ours = resolve(params.eval.task_dir)
    return max(LM_EVAL_PROJECT_TOKENS if (ours / f"{t}.yaml").is_file() else foreign for t in params.eval.tasks)


def eval_phases(params: Params, shape: ModelShape, device: str, resident: dict[str, int],
                static: bool | None, writes_reference: bool = False) -> list[Phase]:
    """`evaluate_model` with `resident` loaded: the streamed perplexity/KL pass, then lm-eval.
    `static`: the model is quantized with static (True) or dynamic (False) block scales; None: BF16."""
    d, ev = DTYPE_BYTES[params.base_model.dtype], params.eval
    rows = min(ev.batch_size, ev.ppl_samples)
    step = min(ev.seq_len - 1, max(1, LOGIT_CHUNK_TOKENS // rows))
    chunk, chunks = rows * step, math.ceil(ev.ppl_samples / rows) * math.ceil((ev.seq_len - 1) / step)
    logits = {"eval_logits": chunk * shape.vocab * (d + EVAL_LOGIT_BYTES)}
    if writes_reference:
        logits["reference_terms"] = chunk * shape.vocab * REFERENCE_WRITE_BYTES
    elif chunks > 1:
        logits["previous_chunk"] = chunk * shape.vocab * PREVIOUS_CHUNK_BYTES
    fake_quant = _fake_quant(shape, device, static) if static is not None else {}
    stream = {"hidden_states": rows * ev.seq_len * shape.hidden * d, **_forward(rows * ev.seq_len, shape, d),
              **logits, **fake_quant}
    r = _request_tokens(params, shape)
    lm_eval = {"lm_eval_harness": LM_EVAL_HARNESS, "lm_eval_logits": ev.batch_size * r * shape.vocab * d
               * LM_EVAL_LOGIT_COPIES, **_forward(ev.batch_size * r, shape, d), **fake_quant}
    return [Phase("eval_stream", "eval.batch_size", resident, stream),
            Phase("lm_eval", "eval.batch_size", resident, lm_eval)]


def baseline_phases(params: Params, shape: ModelShape, device: str) -> list[Phase]:
    return eval_phases(params, shape, device, _weights(params, shape, False), None, writes_reference=True)


def ptq_phases(params: Params, shape: ModelShape, device: str, recipe: str) -> list[Phase]:
    static = static_block_scales(params.recipe_path(recipe))
    resident, d = _weights(params, shape, static), DTYPE_BYTES[params.base_model.dtype]
    tokens = params.ptq.calib_batch_size * params.calibration.seq_len
    phases = [Phase("calibrate", "ptq.calib_batch_size", resident, {
        "calib_logits": tokens * shape.vocab * d, **_forward(tokens, shape, d), **_fake_quant(shape, device, static)})]
    if static:
        copies = MSE_SWEEP_COPIES if scale_sweep(params.recipe_path(recipe)) else MSE_COPIES
        phases.append(Phase("mse_search", None, resident, {"mse_search": shape.largest_matrix * 4 * copies}))
    return [*phases, *eval_phases(params, shape, device, resident, static),
            Phase("save", None, resident, host=_save_copy(params, shape, device))]


def _compute_dtype(setting: str, device: str) -> str:
    """`qad.compute_dtype` with `auto` resolved as tasks/qad.py does: bfloat16 on CUDA, float32 on CPU."""
    return setting if setting != "auto" else ("bfloat16" if device == "cuda" else "float32")


def qad_phases(params: Params, shape: ModelShape, device: str) -> list[Phase]:
    """One of the `qad.num_gpus` processes (tasks/qad.py): each holds the whole teacher, loads the
    whole float32 student before sharding (fsdp) or replicating (ddp) it, and trains on its
    qad.batch_size / qad.num_gpus rows of every batch."""
    q = params.qad
    n, d, a, g = shape.params, DTYPE_BYTES[params.base_model.dtype], DTYPE_BYTES[_compute_dtype(q.compute_dtype, device)], q.num_gpus
    shards = g if g > 1 and q.sharding == "fsdp" else 1
    tokens = max(1, q.batch_size // g) * q.seq_len
    state = {"quantizer_state": shape.matrix_params // 16 * 4} if _any_static(params) else {}
    trained = {"teacher": n * d, "student_fp32": n * 4 // shards, "grads": n * 4 // shards,
               "adamw": 2 * n * 4 // shards, **state}
    if g > 1 and q.sharding == "ddp":
        trained["ddp_buckets"] = n * 4
    if shards > 1:  # one decoder block gathered, the next prefetched
        trained["fsdp_gathered_blocks"] = 2 * n // shape.layers * 4
    per_layer = tokens * (ACT_TRAIN_H * shape.hidden + ACT_TRAIN_F * shape.ffn) * a
    mamba = tokens * shape.mamba_scan * 4 * MAMBA_COPIES
    # Autograd keeps every fake-quantized weight for backward (also where FSDP has resharded the
    # weight itself); gradient checkpointing keeps each layer's input and recomputes one layer.
    if q.gradient_checkpointing:
        fake_quant_saved = shape.matrix_params * a // shape.layers
        activations = shape.layers * tokens * shape.hidden * a + per_layer + (mamba if shape.mamba_layers else 0)
    else:
        fake_quant_saved = shape.matrix_params * a
        activations = shape.layers * per_layer + shape.mamba_layers * mamba
    train = {"fake_quant_saved": fake_quant_saved, "activations": activations,
             "kd_logits": tokens * shape.vocab * 4 * KD_LOGIT_COPIES}
    # at the end FSDP gathers the full float32 state on rank 0's host, into a student it loads there
    save = {"rank0_full_state_dict": n * 4, "rank0_student_copy": n * 4} if shards > 1 else _save_copy(
        params, shape, device)
    return [Phase("load", None, {"teacher": n * d, "student_fp32": n * 4, **state}),
            Phase("train", "qad.batch_size", trained, train), Phase("save", None, trained, host=save)]


def final_eval_phases(params: Params, shape: ModelShape, device: str) -> list[Phase]:
    static = _any_static(params)
    return eval_phases(params, shape, device, _weights(params, shape, static), static)


def export_phases(params: Params, shape: ModelShape, device: str) -> list[Phase]:
    resident = _weights(params, shape, _any_static(params))
    exported = shape.params * DTYPE_BYTES[params.base_model.dtype]  # at most: NVFP4 packs 4x smaller
    check_logits = 2 * params.eval.seq_len * shape.vocab * 4 * 3  # two windows, student and reload
    return [Phase("export", None, resident, host={"exported": exported, **_save_copy(params, shape, device)}),
            Phase("reload_check", None, resident, host={"exported_read_back": exported,
                                                        "dequantized_reload": shape.params * 2,
                                                        "check_logits": check_logits})]


def stage_phases(stage: str, params: Params, shape: ModelShape, device: str) -> list[Phase]:
    name, _, recipe = stage.partition("/")
    if name == "ptq":
        return ptq_phases(params, shape, device, recipe)
    return {"baseline": baseline_phases, "qad": qad_phases, "final_eval": final_eval_phases,
            "export": export_phases}[name](params, shape, device)


def stages(params: Params) -> list[str]:
    """The stage processes a run starts, in order (`ptq/<recipe>` for each recipe)."""
    names = ["calibration", "baseline", *(f"ptq/{r}" for r in params.ptq.recipes), "selection"]
    return names + (["qad", "final_eval", "export"] if params.selection.policy == "qad" else [])


# -- from phases to estimates ---------------------------------------------------------------------


def _placed(phase: Phase, params: Params, cap: Capacity, stage: str) -> tuple[dict[str, int], dict[str, int]]:
    """(host terms, terms per GPU) of one phase on `cap.device`."""
    model = {**phase.resident, **phase.transient}
    if cap.device == "cpu":
        return {"process": PROCESS_BASE, **model, **phase.host}, {}
    host = {"process": PROCESS_BASE + CUDA_HOST_EXTRA, **phase.host}
    if params.hardware.device_map == "auto" and stage != "qad" and cap.gpu_bytes:
        resident, gpus = sum(phase.resident.values()), len(cap.gpu_bytes)
        room = gpus * max(0, min(cap.gpu_bytes) - CUDA_CONTEXT - sum(phase.transient.values()))
        if resident > room:  # accelerate offloads what the GPUs cannot hold to the host
            host["offloaded"] = resident - room
        return host, {"cuda_context": CUDA_CONTEXT, "weights_share": min(resident, room) // gpus, **phase.transient}
    return host, {"cuda_context": CUDA_CONTEXT, **model}


def estimate(stage: str, params: Params, cap: Capacity, shape: ModelShape | None = None) -> StageEstimate:
    """One stage process's peak host and per-GPU bytes (the max over its phases)."""
    if stage in ("calibration", "selection"):
        base = LIGHT_PROCESS_BASE if stage == "calibration" else SELECTION_PROCESS
        return StageEstimate(stage, base, 0, 1, "cpu", "no model", {"process": base}, host_bytes_other=base)
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


def recipe_parallelism(params: Params, cap: Capacity | None = None) -> int:
    """PTQ recipe processes at once: `ptq.max_parallel`, or for `auto` as many as the free host
    memory holds (CPU), or one per visible GPU that holds a recipe (CUDA; one at a time with
    `device_map: auto`, which spreads a recipe over all of them). At least 1: `check_fits`
    refuses a recipe that does not fit at all."""
    recipes = len(params.ptq.recipes)
    if params.ptq.max_parallel != "auto":
        return min(params.ptq.max_parallel, recipes)
    cap = cap or capacity(params.hardware)
    if cap.device == "cuda" and not cap.gpu_bytes:  # the recipes run on GPU workers, one each
        return recipes
    peaks = [estimate(f"ptq/{r}", params, cap) for r in params.ptq.recipes]
    fit = min(recipes, cap.host_bytes // max(e.host_bytes for e in peaks))
    if cap.device == "cuda" and cap.gpu_bytes:
        per_gpu = 1 if params.hardware.device_map == "auto" else _gpus_holding(max(e.device_bytes for e in peaks), cap)
        fit = min(fit, per_gpu)
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
        gpus = at_once if est.stage == "qad" else 1
        if gpus > len(cap.gpu_bytes):
            return f"runs on qad.num_gpus = {gpus} GPUs, this machine sees {len(cap.gpu_bytes)}"
        if _gpus_holding(est.device_bytes, cap) < gpus:
            return f"needs {_gib(est.device_bytes)} per GPU, {_gib(max(cap.gpu_bytes))} is usable"
    return None


def _with(params: Params, knob: str, value) -> Params:
    section, key = knob.split(".")
    return params.model_copy(update={section: getattr(params, section).model_copy(update={key: value})})


def _fits(stage: str, params: Params, cap: Capacity, at_once: int) -> bool:
    est = estimate(stage, params, cap)
    est.max_parallel = at_once
    return _why_not(est, cap, params) is None


def _largest(stage: str, params: Params, cap: Capacity, at_once: int, knob: str, step: int = 1) -> int | None:
    """The largest multiple of `step`, up to `knob`'s value, at which `stage` fits (binary search:
    every estimate grows with its knobs)."""
    section, key = knob.split(".")
    lo, hi = 1, getattr(getattr(params, section), key) // step
    if hi < 1 or not _fits(stage, _with(params, knob, step), cap, at_once):
        return None
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if _fits(stage, _with(params, knob, mid * step), cap, at_once) else (lo, mid - 1)
    return lo * step


KNOBS = {"baseline": ["eval.batch_size"], "ptq": ["ptq.calib_batch_size", "eval.batch_size"],
         "qad": ["qad.batch_size", "qad.seq_len"], "final_eval": ["eval.batch_size"], "export": ["eval.batch_size"]}


def advice(est: StageEstimate, params: Params, cap: Capacity, why: str) -> str:
    """What to turn so that `est` fits: the knob of its peak phase first, with the largest value
    that fits, then the stage's other knobs; else what no setting of this run can change."""
    stage, name, at_once = est.stage, est.stage.split("/")[0], est.max_parallel
    if name not in KNOBS:
        return f"{stage}: {why} (the process alone); use a machine with more memory"
    if name == "ptq" and at_once > 1 and _fits(stage, params, cap, 1):
        most = max(1, cap.host_bytes // est.host_bytes)
        return f"{stage}: ptq.max_parallel={params.ptq.max_parallel} {why}; the largest that fits is {most}"
    checkpointing = name == "qad" and not params.qad.gradient_checkpointing and _fits(
        stage, _with(params, "qad.gradient_checkpointing", True), cap, at_once)
    alternative = "; or set qad.gradient_checkpointing=true" if checkpointing else ""
    phase_knob = next((p.knob for p in stage_phases(stage, params, model_shape(params.base_model), cap.device)
                       if p.name == est.phase), None)
    for knob in sorted(KNOBS[name], key=lambda k: k != phase_knob):
        step = params.qad.num_gpus if knob == "qad.batch_size" else 1  # rows split evenly over the GPUs
        most = _largest(stage, params, cap, at_once, knob, step)
        section, key = knob.split(".")
        if most is not None and most < getattr(getattr(params, section), key):
            at = f" at qad.seq_len {params.qad.seq_len}" if knob == "qad.batch_size" else ""
            return (f"{stage}: {knob}={getattr(getattr(params, section), key)}{at} {why}; "
                    f"the largest that fits is {most}{alternative}")
    if checkpointing:
        return f"{stage}: {why}; set qad.gradient_checkpointing=true"
    weights = model_shape(params.base_model).params * DTYPE_BYTES[params.base_model.dtype]
    if est.host_total > cap.host_bytes:
        where = "a machine with more host memory" + (", or GPUs" if cap.device == "cpu" else "")
    elif name == "qad":
        where = "more GPUs (qad.num_gpus with qad.sharding=fsdp)"
    elif params.hardware.device_map != "auto":
        where = "hardware.device_map=auto (spread the model over the GPUs)"
    else:
        where = "more or larger GPUs"
    largest = max(est.terms, key=est.terms.get)
    return (f"{stage}: {why}, even at batch size 1 (the weights alone are {_gib(weights)}, the largest term is "
            f"{largest} {_gib(est.terms[largest])} in its {est.phase} phase); use {where}")


def plan(params: Params, cap: Capacity | None = None) -> list[StageEstimate]:
    """Every stage's estimate, with the processes it runs at once and `advice` where it does not fit."""
    cap = cap or capacity(params.hardware)
    recipes_at_once = recipe_parallelism(params, cap)
    shape = model_shape(params.base_model)
    out = []
    for stage in stages(params):
        est = estimate(stage, params, cap, shape)
        est.max_parallel = recipes_at_once if stage.startswith("ptq/") else params.qad.num_gpus if stage == "qad" else 1
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


def table(estimates: list[StageEstimate], cap: Capacity) -> str:
    """The plan as a text table, then what this machine offers."""
    mib = lambda b: f"{b / MiB:,.0f}" if b else "-"  # noqa: E731
    rows = [("stage", "peak phase", "host MiB", "GPU MiB", "at once", "fits")]
    rows += [(e.stage, e.phase, mib(e.host_bytes), mib(e.device_bytes), str(e.max_parallel), "yes" if e.fits else "NO")
             for e in estimates]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True)))
             for r in rows]
    gpus = ", ".join(f"{g / GiB:.1f} GiB" for g in cap.gpu_bytes) or "none seen"
    lines.append(f"usable ({HEADROOM:.0%} of what is free): host {cap.host_bytes / GiB:.1f} GiB; GPUs: {gpus}; "
                 f"the stages run on {cap.device}")
    return "\n".join(lines)
