"""The pipeline's configuration: `params.yaml` loaded into pydantic models.

`params.yaml` is the one source of defaults. `load_params` reads it, applies `section.key=value`
overrides (from `qad-pipeline run --set`, Prefect deployment parameters or tests) and validates
the result; every model forbids unknown keys, so a misspelt key fails with its name.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, field_validator

from qad_pipeline.core.params_files import ConfigError as ConfigError
from qad_pipeline.core.params_files import StageError as StageError
from qad_pipeline.core.params_files import apply_overrides, looks_local_in, read_params_file, resolve_in
from qad_pipeline.core.params_files import read_yaml as read_yaml
from qad_pipeline.core.params_files import parse_override as parse_override
from qad_pipeline.core.params_files import yaml_error as yaml_error
from qad_pipeline.core.redaction import flatten, secret_in
from qad_pipeline.core.remote_config import VersioningParams

PROJECT_ROOT = Path(__file__).resolve().parents[2]  # this source checkout (demo model, tests)
PROJECT_PARAMS = PROJECT_ROOT / "params.yaml"  # this checkout's own params.yaml (the bundled defaults)
DEFAULT_PARAMS = Path("params.yaml")  # what the CLI and the flows read unless told: the working directory's
# Relative paths in a params file are relative to the file's folder (the project folder, where
# dvc.yaml sits), whatever the working directory; load_params records that folder here.
_params_root: Path | None = None
RECIPE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]*$")


def _auto_or_positive(value):
    """`auto` or a positive integer (YAML's `8`, an override's "8"); anything else is refused."""
    if value == "auto" or (isinstance(value, int) and not isinstance(value, bool) and value > 0):
        return value
    if isinstance(value, str) and value.strip().isdigit() and int(value) > 0:
        return int(value)
    raise ValueError(f"must be auto or a positive integer, got {value!r}")


AutoOrCount = Annotated[int | Literal["auto"], BeforeValidator(_auto_or_positive)]


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class BaseModelParams(_Section):
    path: str
    revision: str | None = None
    trust_remote_code: bool = False
    dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16"

    @field_validator("path")
    @classmethod
    def _not_empty(cls, path: str) -> str:
        if not path.strip():
            raise ValueError("base_model.path is empty: give a local model folder or a hub id such as 'org/name'")
        return path


class HardwareParams(_Section):
    """Where every stage's models run: one setting for baseline, PTQ, QAD, final eval and export."""

    device: Literal["auto", "cpu", "cuda"]
    device_map: Literal["single", "auto"]
    max_memory: dict[str, str] | None = None
    host_memory_gb: float | None = Field(default=None, gt=0)
    target: str | None = None  # the GPU node the stages run on when it is not this machine (qad_pipeline/core/targets.py)
    pool_gpus: int | None = Field(default=None, ge=1)  # the most GPUs one Job of the GPU pool gets (qad_pipeline/plan/pools.py)

    @field_validator("target")
    @classmethod
    def _target(cls, text: str | None) -> str | None:
        if text is not None:
            from qad_pipeline.core.targets import parse

            parse(text)
        return text

    @field_validator("max_memory")
    @classmethod
    def _memory_keys(cls, caps: dict[str, str] | None) -> dict[str, str] | None:
        for key, value in (caps or {}).items():
            if not (key == "cpu" or key.isdigit()):
                raise ValueError(f"max_memory key {key!r} must be a GPU index ('0', '1', ...) or 'cpu'")
            if not re.match(r"^\s*\d+(\.\d+)?\s*(B|KB|MB|GB|TB|KiB|MiB|GiB|TiB)\s*$", str(value)):
                raise ValueError(f"max_memory[{key!r}] = {value!r} is not a size such as '70GiB'")
        return caps


class CalibrationParams(_Section):
    source: str
    dataset_config: str | None = None
    split: str = "train"
    text_field: str = "text"
    revision: str | None = None  # a hub dataset's branch, tag or commit (a DVC param: a new pin re-runs)
    num_samples: int = Field(gt=0)
    seq_len: int = Field(gt=0)
    eval_fraction: float = Field(gt=0, lt=1)
    seed: int = 0


class PTQParams(_Section):
    recipe_dir: str
    recipes: list[str] = Field(min_length=1)
    calib_batch_size: int = Field(gt=0)
    max_parallel: int | Literal["auto"]
    # GPUs each recipe process gets (CUDA_VISIBLE_DEVICES): auto = one, or all with device_map auto
    gpus_per_recipe: int | Literal["auto"] = "auto"
    # Model Optimizer's layer-by-layer calibration, resumable (qad_pipeline/nvfp4/layerwise.py): auto = when
    # accelerate offloads part of the model (it does not fit the GPUs a recipe gets)
    layerwise: bool | Literal["auto"] = "auto"
    # rows of a weight the MSE scale search takes at a time (qad_pipeline/nvfp4/mse_chunks.py); null: whole weights
    mse_chunk_rows: int | None = Field(default=1024, gt=0)

    @field_validator("max_parallel", "gpus_per_recipe")
    @classmethod
    def _positive(cls, value: int | str, info) -> int | str:
        if value != "auto" and value < 1:
            raise ValueError(f"{info.field_name} must be 'auto' or a positive integer, got {value!r}")
        return value

    @field_validator("layerwise", mode="before")
    @classmethod
    def _layerwise(cls, value):
        if value is True or value is False or value == "auto":
            return value
        raise ValueError(f"layerwise must be true, false or 'auto', got {value!r}")

    @field_validator("recipes")
    @classmethod
    def _unique_names(cls, names: list[str]) -> list[str]:
        for name in names:
            if not RECIPE_NAME.match(name):
                raise ValueError(f"recipe name {name!r} may hold only letters, digits, '_', '-' and '.'")
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"recipes listed twice: {dupes}")
        return names


class TaskSettings(_Section):
    """How lm-eval runs one task (`eval.task_settings.<task>`), as lm-eval's own options name them."""

    num_fewshot: int | None = Field(default=None, ge=0)  # None: the task's own
    apply_chat_template: bool = False
    fewshot_as_multiturn: bool = False  # the few-shot examples as user/assistant turns (needs the chat template)
    gen_kwargs: dict[str, Any] | None = None  # generation settings of a generate_until task (max_gen_toks, ...)
    metric: str | None = None  # the metric that counts; None: the task's first
    filter: str | None = None  # the filter whose value counts (GSM8K: strict-match); None: the first
    limit: int | None = Field(default=None, gt=0)  # items of this task; None: eval.limit

    @field_validator("fewshot_as_multiturn")
    @classmethod
    def _needs_chat(cls, multiturn: bool, info) -> bool:
        if multiturn and not info.data.get("apply_chat_template"):
            raise ValueError("fewshot_as_multiturn needs apply_chat_template: true")
        return multiturn


class EvalParams(_Section):
    tasks: list[str] = Field(min_length=1)
    task_dir: str
    num_cloze: int = Field(gt=0)
    num_continuation: int = Field(gt=0)
    limit: int | None = Field(default=None, gt=0)
    batch_size: AutoOrCount  # auto: the largest the memory plan fits, up to memory.AUTO_EVAL_BATCH
    ppl_samples: int = Field(gt=0)
    seq_len: int = Field(gt=0)
    kl_top_k: int = Field(gt=0)
    kl_tail_samples: int = Field(ge=0)
    task_settings: dict[str, TaskSettings] = {}  # per task: few-shot, chat template, generation, metric, filter
    backend: Literal["hf", "vllm"] = "hf"  # vllm: the served_eval stage scores the export through vLLM too

    @field_validator("task_settings")
    @classmethod
    def _listed(cls, settings: dict[str, TaskSettings], info) -> dict[str, TaskSettings]:
        unlisted = sorted(set(settings) - set(info.data.get("tasks") or []))
        if unlisted:
            raise ValueError(f"task_settings for {unlisted}, which eval.tasks does not list")
        return settings

    def settings(self, task: str) -> TaskSettings:
        return self.task_settings.get(task) or TaskSettings()


class SelectionParams(_Section):
    """Recoveries are fractions of the BF16 score: the band and the PTQ-final floor lie in (0, 1]."""

    policy: Literal["qad", "ptq_final"]
    band: tuple[float, float]
    ptq_final_min: float = Field(gt=0, le=1)
    sweep: Literal["none", "knee", "all"] = "none"

    @field_validator("band")
    @classmethod
    def _ordered(cls, band: tuple[float, float]) -> tuple[float, float]:
        if not 0 < band[0] <= band[1] <= 1:
            raise ValueError(f"band must be [low, high] with 0 < low <= high <= 1, got {list(band)}")
        return band


class RaceParams(_Section):
    """Racing the candidates' evaluation (`race` stage: tasks/race.py; decisions: qad_pipeline/scoring/racing.py):
    round k ends when each task's first `fractions[k]` of its items are scored; between rounds a
    candidate that cannot be selected at `confidence` stops. Off: every candidate scores every item."""

    enabled: bool = False
    fractions: list[float] = Field(min_length=1)
    confidence: float = Field(gt=0.5, lt=1)
    seed: int = 0

    @field_validator("fractions")
    @classmethod
    def _rounds(cls, f: list[float]) -> list[float]:
        if any(not 0 < x <= 1 for x in f) or f != sorted(set(f)) or f[-1] != 1:
            raise ValueError(f"fractions must rise strictly within (0, 1] and end at 1.0 (every item), got {f}")
        return f


class SweepParams(_Section):
    """The BPE sweep: one AutoQuantize recipe run at each budget (tasks/sweep.py), the knee chosen
    where more bits stop buying recovery (tasks/bpe_sweep.py)."""

    recipe: str
    budgets: list[float]
    knee_epsilon: float = Field(gt=0)

    @field_validator("budgets", mode="before")
    @classmethod
    def _decimal_budgets(cls, budgets: Any) -> Any:
        # a budget names its DVC stage (sweep@5.0) and folder: one spelling, with a decimal point
        for b in budgets if isinstance(budgets, list) else []:
            if not isinstance(b, float):
                raise ValueError(f"budget {b!r} must be written as a decimal number of bits, e.g. 5.0")
        if isinstance(budgets, list) and len(set(budgets)) != len(budgets):
            raise ValueError(f"budgets listed twice: {sorted(b for b in set(budgets) if budgets.count(b) > 1)}")
        return budgets

    @property
    def points(self) -> list[str]:
        """The budgets as their stage item names (`5.0`), as DVC's foreach names them."""
        return [budget_name(b) for b in self.budgets]

    def point(self, budget: str) -> str:
        """A sweep point's name as a selection candidate and in its scores: `<recipe>@<budget>`."""
        return f"{self.recipe}@{budget}"


def budget_name(budget: float) -> str:
    return str(float(budget))


class QADParams(_Section):
    steps: int = Field(gt=0)
    lr: float = Field(gt=0)
    schedule: Literal["cosine", "linear", "constant"] = "cosine"
    warmup_steps: int = Field(ge=0)
    weight_decay: float = Field(ge=0)
    # auto (`batch_size`, `grad_accum`, `num_gpus`): settled by the memory plan (memory.settled) before use
    batch_size: AutoOrCount  # rows per micro-batch, over all processes
    grad_accum: int | Literal["auto"] = Field(default="auto", validate_default=True)  # micro-batches per step
    effective_batch_size: int = Field(default=8, gt=0)  # rows per optimizer step when batch_size is auto
    seq_len: int = Field(gt=0)
    temperature: float = Field(gt=0)
    source: str | None = None
    checkpoint_every: int = Field(gt=0)
    seed: int = 0
    compute_dtype: Literal["auto", "bfloat16", "float32"]
    gradient_checkpointing: bool
    num_gpus: AutoOrCount  # processes (GPUs) per node; auto: the fewest that fit (one on a CPU)
    sharding: Literal["ddp", "fsdp"]
    num_nodes: int = Field(default=1, ge=1)
    offload: bool = False  # FSDP2's CPU offload: sharded parameters, gradients and AdamW state on the host
    rdzv_endpoint: str | None = Field(default=None, pattern=r"^[A-Za-z0-9_.\-\[\]:]+:\d{1,5}$")  # host:port, nodes > 1
    teacher: Literal["live", "cached"] = "live"  # cached: the teacher_cache stage's top-k + tail, no teacher in QAD
    teacher_top_k: int = Field(default=32, gt=0)
    teacher_tail_samples: int = Field(default=32, ge=0)
    chunked_loss: bool = True  # the KD loss chunk by chunk of positions, no [tokens x vocab] logits (kd_loss.py)
    compile: bool = False  # torch.compile on each decoder block
    learn_scales: Literal["none", "lsq"] = "none"  # lsq: NVFP4 block scales trained too (nvfp4/learned_scales.py)

    @property
    def processes(self) -> int:  # on all nodes
        if self.num_gpus == "auto":
            raise ConfigError("qad.num_gpus is auto here: settle the params first (qad_pipeline.plan.memory.settled)")
        return self.num_gpus * self.num_nodes

    @property
    def settled(self) -> bool:  # no `auto` left for the memory plan to settle
        return "auto" not in (self.batch_size, self.grad_accum, self.num_gpus)

    @field_validator("grad_accum", mode="before")
    @classmethod
    def _accumulation(cls, value, info):
        value, batch = _auto_or_positive(value), info.data.get("batch_size")
        if batch == "auto" and value != "auto":
            raise ValueError("must be auto with qad.batch_size auto (the plan chooses both so that batch_size x "
                             "grad_accum = qad.effective_batch_size); set qad.effective_batch_size instead")
        return 1 if value == "auto" and batch not in ("auto", None) else value  # an explicit batch: no accumulation

    @field_validator("offload")
    @classmethod
    def _offload(cls, offload: bool, info) -> bool:
        gpus, sharding = info.data.get("num_gpus", 1), info.data.get("sharding")
        n = "auto" if gpus == "auto" else gpus * info.data.get("num_nodes", 1)
        if offload and (sharding != "fsdp" or n == 1):
            raise ValueError(f"offload: true needs sharding: fsdp and more than one process (num_gpus x num_nodes "
                             f"is {n}, sharding is {sharding})")
        return offload


class ExportParams(_Section):
    serving_check: Literal["auto", "full", "config", "skip"]
    source: str = "auto"

    @field_validator("source")
    @classmethod
    def _source(cls, value: str) -> str:
        if value in ("auto", "qad", "none") or (value.startswith("ptq/") and len(value) > 4):
            return value
        raise ValueError(f"export.source {value!r} is not auto, qad, none or ptq/<recipe> (a PTQ recipe or a "
                         "sweep point, e.g. ptq/nvfp4_max-mamba_fp8-kv_fp8)")


class Params(_Section):
    base_model: BaseModelParams
    hardware: HardwareParams
    calibration: CalibrationParams
    ptq: PTQParams
    eval: EvalParams
    selection: SelectionParams
    race: RaceParams
    sweep: SweepParams
    qad: QADParams
    export: ExportParams
    versioning: VersioningParams = VersioningParams()  # the DVC remote runs push to (remote_config.py)

    def recipe_path(self, name: str, root: Path | None = None) -> Path:
        return resolve(self.ptq.recipe_dir, root) / f"{name}.yaml"


def project_root() -> Path:
    """The folder of the params file loaded last (the working directory before any is loaded)."""
    return _params_root or Path.cwd()


def resolve(path: str | Path, root: Path | None = None) -> Path:
    """A path from params.yaml: relative paths are relative to the params file's folder."""
    return resolve_in(path, root or project_root())


def looks_local(path: str, root: Path | None = None) -> bool:
    """A local path, not a hub id (`params_files.looks_local_in`, in the params file's folder)."""
    return looks_local_in(path, root or project_root())


def _format_validation_error(err: ValidationError, source_of) -> str:
    # A misspelt key shows up as one unknown key plus one missing key: name the unknown one.
    first = min(err.errors(), key=lambda e: e["type"] != "extra_forbidden")
    loc, source = ".".join(str(p) for p in first["loc"]), source_of(tuple(first["loc"]))
    if first["type"] == "extra_forbidden":
        return f"{source}: unknown key {loc!r} (misspelt? see params.yaml for the valid keys)"
    if first["type"] == "missing":
        return f"{source}: missing key {loc!r}"
    return f"{source}: {loc} = {first.get('input')!r}: {first['msg']}"


def load_params(
    path: Path = PROJECT_PARAMS, overrides: list[str] | dict[str, Any] | None = None
) -> Params:
    """Load and validate params.yaml (what it `extends` merged in: `params_files.read_params_file`)
    with overrides applied; its folder becomes the project root."""
    global _params_root
    if not Path(path).is_file():
        raise ConfigError(f"params file {str(path)!r} does not exist (run from the project folder or pass --params)")
    _params_root = Path(path).resolve().parent
    file = read_params_file(path)
    data = apply_overrides(file.data, overrides) if overrides else file.data
    check_no_secrets(data, str(path))
    try:
        return Params.model_validate(data)
    except ValidationError as err:
        raise ConfigError(_format_validation_error(err, lambda loc: file.source_of(loc, data))) from None


def check_no_secrets(data: dict, source: str) -> None:
    """Refuse a value that holds a secret (an environment secret's value, URL credentials): a
    parameter reaches the console, the stage logs, MLflow and Prefect's database."""
    for key, value in flatten(data).items():
        found = secret_in(value if isinstance(value, str) else json.dumps(value, default=str))
        if found:
            raise ConfigError(f"{source}: {key} holds {found}; give secrets to the process through the "
                              "environment (HF_TOKEN, AWS_*, MLFLOW_TRACKING_PASSWORD, ...), never in a parameter")
