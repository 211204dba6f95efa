"""MLflow tracking, done from one place by reading the files the stages wrote.

Nothing here recomputes a number and nothing runs inside a stage process: after (or while) the
flow runs, the parent process calls these functions, which read `metrics/*.json`, the calibration
manifest, QAD's `loss.json` and the export folder from a `Layout` and log them. A run whose
tracking server went away can therefore be logged again later from the same files.

What goes where:

* one experiment per base model, `qad-pipeline/<base_model.path>`;
* one parent run per pipeline run (tag `qad.kind=pipeline`): the resolved configuration as
  params, the base checkpoint's identity, git commit and Prefect flow-run id as tags, the
  calibration and eval datasets as run inputs, the report text, a few headline metrics;
* one child run (tag `mlflow.parentRunId`, `qad.kind=stage`, `qad.stage=<stage>`) for each stage
  and recipe whose files exist: `calibration`, `baseline`, `ptq-<recipe>`, `selection`, `qad`,
  `final_eval`, `export`. A failed recipe (or a failed export check) ends FAILED with its error
  as the tag `error`;
* the parent also holds what a user compares pipeline runs on: the selected recipe's and QAD's
  recovery with its interval, KL and bits as metrics (`headline_metrics`), a Markdown
  description (`mlflow.note.content`, from `report.run_description`), the report as `report.md`
  and the selection's full reason as `selection_reason.txt` (its tag holds the first sentence);
* each recipe run has the recipe's settings (weight scale method, Mamba format, KV format, bits)
  as params, so MLflow's compare view has a recipe axis; every stage run starts and ends when its
  process did (`stage_span`: the flow's `artifacts/logs/<stage>.usage.json`);
* `register_export` logs the exported checkpoint into the parent run and registers it as a new
  version of the registered model `<sanitized base model>-nvfp4`, with the alias `candidate`;
  the version's run is the parent, and its description quotes the exported model's recovery,
  the git commit and the data fingerprints.

Every param and tag value, and every JSON/text artifact, passes through `redact`/`redact_text`:
values under a key named like a secret (a word of it ends with token, secret, password, key or
credential: `HF_TOKEN`, `api_key`, not `tokenizer`) and the values of such
environment variables (`HF_TOKEN`, `AWS_SECRET_ACCESS_KEY`, ...) never reach the tracking store.

The default store is a SQLite file in the output root (`sqlite:///<root>/mlflow.db`, no server to
start); `MLFLOW_TRACKING_URI` points elsewhere (an `http(s)://` server, `postgresql://...`).
"""

from __future__ import annotations

import functools
import json
import math
import os
import re
import socket
import time
import urllib.error
import urllib.parse
import urllib.request
import warnings
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from qad_pipeline.artifacts import read_json
from qad_pipeline.config import ConfigError, Params, resolve
from qad_pipeline.layout import Layout
from qad_pipeline.report import read_summary, report_markdown, run_description

if TYPE_CHECKING:  # mlflow is imported where it is used: importing it takes seconds
    from mlflow import MlflowClient
    from mlflow.data.dataset import Dataset

EXPERIMENT_PREFIX = "qad-pipeline/"
MODEL_SUFFIX = "-nvfp4"
CANDIDATE_ALIAS = "candidate"
CHECKPOINT_ARTIFACT = "checkpoint"
REDACTED = "***"
# A name is split into words (at '_', '.', '-', digits and camelCase humps); it is secret-like when a
# word ends with one of these: HF_TOKEN, api_key, apiKey, AWS_SECRET_ACCESS_KEY, db.password,
# accesstoken; not tokenizer, tokens_per_step or keyframes.
SECRET_WORD = re.compile(r"(token|secrets?|password|passwd|key|credentials?)$")
NAME_WORDS = re.compile(r"[A-Z]+(?![a-z])|[A-Z]?[a-z]+")
MLFLOW_PROBE = "/api/2.0/mlflow/experiments/search?max_results=1"  # the cheapest read of MLflow's REST API
MIN_SECRET_LENGTH = 6  # environment values shorter than this are not scrubbed out of text
URL_CREDENTIALS = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.\-]*://)[^/@\s:]*(?::[^/@\s]*)?@")
STAGES = ("calibration", "baseline", "ptq", "selection", "qad", "final_eval", "export")

# tags this module sets
KIND = "qad.kind"  # "pipeline" (parent) or "stage" (child)
STAGE = "qad.stage"
RECIPE = "qad.recipe"
HOST = "qad.host"
PID = "qad.pid"
PID_STARTED = "qad.pid_started"
LOGGED_AT = "qad.logged_at"  # epoch ms, zero-padded: sorts as text
ERROR = "error"
PARENT = "mlflow.parentRunId"
RUN_NAME = "mlflow.runName"
GIT_COMMIT = "mlflow.source.git.commit"
NOTE = "mlflow.note.content"
FLOW_RUN_ID = "prefect.flow_run_id"

MAX_PARAM_VALUE = 6000
MAX_TAG_VALUE = 8000
MAX_BATCH = 100  # params and tags per log_batch call
MAX_METRIC_BATCH = 1000
MAX_LOG_BYTES = 256 * 1024  # a stage log is logged from its last 256 KiB


# -- where and whether ---------------------------------------------------------------------------


def git_commit() -> str | None:
    """The project's current git commit (with "-dirty" when it has uncommitted changes), if any."""
    import subprocess

    from qad_pipeline.config import project_root

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=project_root(), capture_output=True, text=True,
                              timeout=10, check=True).stdout.strip()

    try:
        commit = git("rev-parse", "HEAD")
        return commit + ("-dirty" if git("status", "--porcelain", "--untracked-files=no") else "")
    except (OSError, subprocess.SubprocessError):
        return None


def tracking_uri(root: Path) -> str:
    """`MLFLOW_TRACKING_URI` if set, else a SQLite file in the output root (no server to start)."""
    env = os.environ.get("MLFLOW_TRACKING_URI", "").strip()
    if env:
        return env
    return f"sqlite:///{(Path(root).resolve() / 'mlflow.db').as_posix()}"


DEFAULT_DB_PORTS = {"postgresql": 5432, "postgres": 5432, "mysql": 3306, "mssql": 1433}
DRIVER_PACKAGES = {"psycopg2": "psycopg2-binary", "psycopg": "psycopg[binary]", "pymysql": "PyMySQL"}


def _check_db_driver(uri: str, shown: str) -> None:
    """The database driver that SQLAlchemy would load for `uri` is importable (`postgresql://`
    means psycopg 3 from SQLAlchemy 2.1 on, psycopg2 before; `postgresql+psycopg2://` names it)."""
    try:
        from sqlalchemy.engine import make_url

        dialect = make_url(uri).get_dialect()
    except Exception:  # noqa: BLE001 (a URI SQLAlchemy cannot parse: MLflow will say why)
        return
    try:
        dialect.import_dbapi()
    except ImportError as err:
        module = getattr(err, "name", None) or str(err)
        raise ConfigError(
            f"MLflow tracking store {shown} needs the Python package {DRIVER_PACKAGES.get(module, module)!r} "
            f"(module {module!r}), which is not installed"
        ) from None


def check_reachable(uri: str, timeout_s: float = 3.0) -> None:
    """Fail fast, with one `ConfigError` naming the URI, when the tracking store cannot be reached.

    http(s): the server must answer MLflow's REST API (`GET /api/2.0/mlflow/experiments/search`) with
    a JSON object within `timeout_s`; any other answer (a 404 from some other web server) is refused,
    except 401/403 (an authenticating front: MLflow's client sends the MLFLOW_TRACKING_* credentials).
    postgresql/mysql/mssql: the database driver must be importable and the host's port must
    accept a TCP connection. sqlite: the database file's folder must exist or be creatable.
    Other schemes (file, databricks, plugins) are not checked.
    """
    shown = redact_text(uri)
    parsed = urllib.parse.urlparse(uri)
    scheme = parsed.scheme.lower()
    base = scheme.split("+", 1)[0]
    hint = "start it, or unset MLFLOW_TRACKING_URI to log into sqlite:///<out-root>/mlflow.db"
    if scheme in ("http", "https"):
        not_mlflow = (f"MLflow tracking server {shown} answers but is not an MLflow tracking server ({{}} on "
                      f"GET {MLFLOW_PROBE}); point MLFLOW_TRACKING_URI at an `mlflow server`, or unset it to log "
                      "into sqlite:///<out-root>/mlflow.db")
        try:
            with urllib.request.urlopen(uri.rstrip("/") + MLFLOW_PROBE, timeout=timeout_s) as answer:  # noqa: S310
                body = answer.read(1 << 16)
        except urllib.error.HTTPError as err:
            if err.code in (401, 403):  # an authenticating front; MLflow's client sends MLFLOW_TRACKING_* credentials
                return
            raise ConfigError(not_mlflow.format(f"HTTP {err.code}")) from None
        except (urllib.error.URLError, OSError, ValueError) as err:
            reason = getattr(err, "reason", err)
            raise ConfigError(
                f"MLflow tracking server {shown} cannot be reached ({reason}) within {timeout_s:g}s; {hint}"
            ) from None
        try:
            answer_is_json_object = isinstance(json.loads(body), dict)
        except ValueError:
            answer_is_json_object = False
        if not answer_is_json_object:
            raise ConfigError(not_mlflow.format("an answer that is not MLflow's JSON"))
        return
    if base in DEFAULT_DB_PORTS:
        _check_db_driver(uri, shown)
        if parsed.hostname:
            port = parsed.port or DEFAULT_DB_PORTS[base]
            try:
                socket.create_connection((parsed.hostname, port), timeout=timeout_s).close()
            except OSError as err:
                raise ConfigError(
                    f"MLflow tracking database {shown} cannot be reached at {parsed.hostname}:{port} ({err}); {hint}"
                ) from None
        return
    if scheme == "sqlite":
        path = uri[len("sqlite:///"):] if uri.startswith("sqlite:///") else ""
        if path and path != ":memory:":
            folder = Path(path).parent
            try:
                folder.mkdir(parents=True, exist_ok=True)
            except OSError as err:
                raise ConfigError(f"MLflow tracking database {shown}: cannot create {folder} ({err})") from None


def experiment_name(base_model_path: str) -> str:
    """The experiment of one base model: `qad-pipeline/<path or hub id>`."""
    return redact_text(EXPERIMENT_PREFIX + base_model_path.strip())


def registered_model_name(base_model_path: str) -> str:
    """The registered model of one base model's NVFP4 exports, e.g. `demo-model-nvfp4`.

    MLflow model names may not hold '/' or ':'; anything but letters, digits, '_', '-' and '.'
    becomes '-'.
    """
    stem = re.sub(r"[^A-Za-z0-9_.\-]+", "-", redact_text(base_model_path.strip())).strip("-.")
    return (stem or "model")[:200] + MODEL_SUFFIX


# -- secrets -------------------------------------------------------------------------------------


def is_secret_name(key: str) -> bool:
    """A key named like a secret: one of its words ends with token, secret, password, key or credential."""
    return any(SECRET_WORD.search(word.lower()) for word in NAME_WORDS.findall(str(key)))


def secret_values(environ: Mapping[str, str] | None = None) -> list[str]:
    """Values of environment variables named like secrets, longest first."""
    env = os.environ if environ is None else environ
    values = {v for k, v in env.items() if is_secret_name(k) and v and len(v) >= MIN_SECRET_LENGTH}
    return sorted(values, key=len, reverse=True)


def redact_text(text: str) -> str:
    """`text` with every secret environment value and URL credential (`user:pass@`) replaced."""
    for value in secret_values():
        text = text.replace(value, REDACTED)
    return URL_CREDENTIALS.sub(lambda m: f"{m.group('scheme')}{REDACTED}@", text)


def _as_text(value: Any) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, (list, tuple, dict)):
        return json.dumps(value, default=str)
    return str(value)


def redact(key: str, value: Any) -> str:
    """The text to log for a param or tag: REDACTED under a secret-like key, else scrubbed text.

    Numbers and booleans are not secrets and pass unchanged, even under such a key
    (`tokens_per_step`); `None` and empty strings stay as they are.
    """
    if value is None or value == "":
        return _as_text(value)
    if is_secret_name(key) and not isinstance(value, (bool, int, float)):
        return REDACTED
    return redact_text(_as_text(value))


def redact_data(data: Any, key: str = "") -> Any:
    """A JSON-like structure with `redact`'s rules applied to every string leaf."""
    if isinstance(data, Mapping):
        return {k: redact_data(v, str(k)) for k, v in data.items()}
    if isinstance(data, (list, tuple)):
        return [redact_data(v, key) for v in data]
    if isinstance(data, str):
        return redact(key, data)
    return data


def flatten(data: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested mappings flattened with dots: {"qad": {"lr": 1e-4}} -> {"qad.lr": 1e-4}."""
    out: dict[str, Any] = {}
    for k, v in data.items():
        key = f"{prefix}{k}"
        if isinstance(v, Mapping) and v:
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out


# -- reading the files: one child run per stage and recipe ----------------------------------------


@dataclass
class ChildRun:
    """What one child run will hold, read from a stage's files (nothing logged yet)."""

    name: str
    stage: str
    start_ms: int
    end_ms: int
    status: str = "FINISHED"
    recipe: str | None = None
    params: dict[str, Any] = field(default_factory=dict)  # what to compare runs on (recipe settings)
    metrics: dict[str, float] = field(default_factory=dict)
    tags: dict[str, Any] = field(default_factory=dict)
    dicts: dict[str, Any] = field(default_factory=dict)  # artifact file -> JSON data
    texts: dict[str, str] = field(default_factory=dict)  # artifact file -> text
    steps: list[tuple[str, float, int, int]] = field(default_factory=list)  # key, value, ms, step
    datasets: list[tuple[Dataset, str]] = field(default_factory=list)  # dataset, context


def _mtime_ms(path: Path) -> int:
    return int(path.stat().st_mtime * 1000)


USAGE_SLACK_S = 5.0  # a stage's output may be written up to this long after its usage file says it ended


def stage_span(layout: Layout, name: str, output: Path) -> tuple[int, int]:
    """(start, end) in epoch ms of the stage process that wrote `output`.

    From `artifacts/logs/<name>.usage.json` (written by the flow around the stage process:
    `started_at`/`finished_at`, or only `seconds` in files from before those were recorded, then
    ending at the usage file's time) when `output` was written while that process ran; otherwise
    (e.g. `dvc repro` ran the stage without a usage file, or later than it) a zero-length span at
    the output's modification time.
    """
    written = output.stat().st_mtime
    path = layout.logs / f"{name}.usage.json"
    if path.is_file():
        try:
            usage = read_json(path)
        except (OSError, ValueError):
            usage = {}
        end = _number(usage.get("finished_at"))
        end = path.stat().st_mtime if end is None else end
        start = _number(usage.get("started_at"))
        seconds = _number(usage.get("seconds"))
        start = end - seconds if start is None and seconds is not None else start
        if start is not None and start - USAGE_SLACK_S <= written <= end + USAGE_SLACK_S:
            return int(1000 * start), int(1000 * max(end, written))
    return int(1000 * written), int(1000 * written)


def _ci_metrics(ci: Any, prefix: str) -> dict[str, float]:
    """[low, high] -> {prefix_ci_low: low, prefix_ci_high: high}; nothing when absent."""
    if isinstance(ci, (list, tuple)) and len(ci) == 2 and all(_number(v) is not None for v in ci):
        return {f"{prefix}_ci_low": float(ci[0]), f"{prefix}_ci_high": float(ci[1])}
    return {}


def _metric_key(key: str) -> str:
    """A valid MLflow metric name: letters, digits, _ - . / : and space."""
    key = re.sub(r"[^\w.\-/ :]", "_", key).strip("/")
    return re.sub(r"\.\.+", ".", key) or "_"


def _number(value: Any) -> float | None:
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, (int, float)):
        return float(value)
    return None


def _numeric_leaves(data: Mapping[str, Any], prefix: str = "") -> dict[str, float]:
    """Every number (and boolean, as 0/1) in a nested mapping, keyed with dots; lists skipped."""
    out = {}
    for key, value in flatten(data, prefix).items():
        number = _number(value)
        if number is not None:
            out[_metric_key(key)] = number
    return out


def _task_metrics(tasks: Mapping[str, Mapping[str, Any]]) -> dict[str, float]:
    """score.<task> and, where the file has it, recovery.<task>."""
    out = {}
    for task, score in tasks.items():
        if _number(score.get("value")) is not None:
            out[_metric_key(f"score.{task}")] = float(score["value"])
        if _number(score.get("recovery")) is not None:
            out[_metric_key(f"recovery.{task}")] = float(score["recovery"])
        ci = _ci_metrics(score.get("recovery_ci"), "recovery")
        out.update({_metric_key(f"{k}.{task}"): v for k, v in ci.items()})
    return out


def _pick(data: Mapping[str, Any], *keys: str) -> dict[str, float]:
    return {k: float(data[k]) for k in keys if _number(data.get(k)) is not None}


def _stage_log(layout: Layout, name: str) -> dict[str, str]:
    """The stage's own log (artifacts/logs/<name>.log), its last MAX_LOG_BYTES, secrets scrubbed."""
    path = layout.logs / f"{name}.log"
    if not path.is_file():
        return {}
    with path.open("rb") as fh:
        size = fh.seek(0, os.SEEK_END)
        fh.seek(max(0, size - MAX_LOG_BYTES))
        text = fh.read().decode("utf-8", errors="replace")
    return {f"logs/{name}.log": redact_text(text)}


@functools.cache
def _manifest_dataset_class() -> type:
    """A MetaDataset with a profile: known by its manifest (name, fingerprint, source, counts),
    holding no data. Built on first use: mlflow is imported lazily."""
    from mlflow.data.meta_dataset import MetaDataset

    class ManifestDataset(MetaDataset):
        def __init__(self, source, name: str, digest: str, schema, profile: dict):
            self._profile = profile
            super().__init__(source=source, name=name, digest=digest, schema=schema)

        @property
        def profile(self) -> dict:
            return self._profile

        def to_dict(self) -> dict[str, str]:
            return {**super().to_dict(), "profile": json.dumps(self._profile)}

    return ManifestDataset


def dataset_source(source: str, params: Params):
    """The calibration source as an MLflow dataset source: a local path or a Hugging Face dataset."""
    from mlflow.data.dataset_source_registry import resolve_dataset_source
    from mlflow.data.huggingface_dataset_source import HuggingFaceDatasetSource

    source = redact_text(source)
    local = resolve(source)
    if local.exists():
        try:
            with warnings.catch_warnings():  # "can be interpreted in multiple ways": all are local
                warnings.simplefilter("ignore", UserWarning)
                return resolve_dataset_source(str(local))
        except Exception:  # noqa: BLE001 (no local source registered: fall through)
            pass
    cal = params.calibration
    config = None if cal.dataset_config is None else redact("dataset_config", cal.dataset_config)
    return HuggingFaceDatasetSource(path=source, config_name=config, split=cal.split)


def manifest_datasets(manifest: Mapping[str, Any], params: Params) -> list[tuple[Dataset, str]]:
    """The calibration and held-out eval datasets of a calibration manifest, with their contexts.

    Name `calibration` / `eval`; digest: the manifest's fingerprint, cut to the 36 characters
    MLflow stores (the full fingerprint is in the dataset's profile and the input tag
    `fingerprint`); source: the calibration source (a local path or a Hugging Face dataset).
    """
    import numpy as np
    from mlflow.types import Schema, TensorSpec
    from mlflow.utils.validation import MAX_DATASET_DIGEST_SIZE

    source = dataset_source(str(manifest.get("source") or params.calibration.source), params)
    out = []
    for name, context in (("calibration", "calibration"), ("eval", "evaluation")):
        part = manifest.get(name)
        if not isinstance(part, Mapping) or not part.get("fingerprint"):
            continue
        seq_len = part.get("seq_len")
        schema = Schema([TensorSpec(np.dtype("int64"), (-1, int(seq_len)), "input_ids")]) if seq_len else None
        profile = dict(part)
        digest = str(part["fingerprint"])[:MAX_DATASET_DIGEST_SIZE]
        out.append((_manifest_dataset_class()(source, name, digest, schema, profile), context))
    return out


def _calibration_child(layout: Layout, params: Params) -> ChildRun | None:
    path = layout.data / "manifest.json"
    if not path.is_file():
        return None
    m = read_json(path)
    child = ChildRun("calibration", "calibration", *stage_span(layout, "calibration", path))
    child.metrics = {
        **_numeric_leaves({k: v for k, v in m.items() if k in ("documents", "seed")}),
        **_numeric_leaves(m.get("calibration") or {}, "calibration."),
        **_numeric_leaves(m.get("eval") or {}, "eval."),
        "calibration.documents": float(len(m.get("calibration_documents") or [])),
        "eval.documents": float(len(m.get("eval_documents") or [])),
    }
    child.tags = {
        "source": m.get("source"),
        "calibration.fingerprint": (m.get("calibration") or {}).get("fingerprint"),
        "eval.fingerprint": (m.get("eval") or {}).get("fingerprint"),
    }
    child.dicts = {"manifest.json": m}
    child.texts = _stage_log(layout, "calibration")
    child.datasets = manifest_datasets(m, params)
    return child


def _baseline_child(layout: Layout) -> ChildRun | None:
    path = layout.baseline_metrics
    if not path.is_file():
        return None
    m = read_json(path)
    child = ChildRun("baseline", "baseline", *stage_span(layout, "baseline", path),
                     "FINISHED" if m.get("status", "ok") == "ok" else "FAILED")
    child.metrics = {**_task_metrics(m.get("tasks") or {}), **_pick(m, "effective_bpe", "size_bytes")}
    model = m.get("model") or {}
    child.tags = {f"base_model.{k}": v for k, v in model.items()}
    child.dicts = {"baseline.json": m}
    child.texts = _stage_log(layout, "baseline")
    return child


def _ptq_child(layout: Layout, params: Params, recipe: str, row: Mapping[str, Any]) -> ChildRun | None:
    """metrics/ptq/<recipe>.json (scores + recovery) or, before selection, the PTQ scores.json.

    `row` is the recipe's row of the selection table: its `settings` (weight scale method, Mamba
    format, KV format, bits) become the run's params, so MLflow's compare view has a recipe axis
    (without them: the recipe's name, KV format and bits as PTQ measured them).
    A recipe that is an alias of another (the same quantizer configuration on this model, not
    run) gets that one's metrics and the tag `alias_of`.
    """
    alias_of = row.get("alias_of") if row.get("status") == "alias" else None
    metrics_path, scores_path = layout.ptq_metrics(recipe), layout.ptq(recipe) / "scores.json"
    path = metrics_path if metrics_path.is_file() else scores_path if scores_path.is_file() else None
    m = read_json(path) if path is not None else {}
    if alias_of and m.get("status") != "ok" and layout.ptq_metrics(alias_of).is_file():
        m = {**read_json(layout.ptq_metrics(alias_of)), "status": "alias"}
        path = path or layout.ptq_metrics(alias_of)
    if path is None:
        return None
    end = int(1000 * m["finished_at"]) if _number(m.get("finished_at")) is not None else _mtime_ms(path)
    start = int(1000 * m["started_at"]) if _number(m.get("started_at")) is not None else end
    if alias_of:  # it did not run: a zero-length run at the time the selection found it out
        start = end = _mtime_ms(layout.selection_metrics) if layout.selection_metrics.is_file() else end
    name = f"ptq-{recipe}"
    ok = m.get("status") in ("ok", "alias")
    child = ChildRun(name, "ptq", start, end, "FINISHED" if ok else "FAILED", recipe=recipe)
    weight = m.get("weight_error") if isinstance(m.get("weight_error"), Mapping) else {}
    child.metrics = {
        **_task_metrics(m.get("tasks") or {}),
        **_pick(m, "median_recovery", "effective_bpe", "size_bytes", "bf16_size_bytes", "kl_divergence",
                "peak_rss_mb"),
        **_ci_metrics(m.get("median_recovery_ci") or row.get("median_recovery_ci"), "median_recovery"),
        **_numeric_leaves({"weight_error.median": weight.get("median")}),
        **_numeric_leaves(m.get("timing_s") or {}, "timing_s."),
        **_numeric_leaves(m.get("elements_by_format") or {}, "elements_by_format."),
    }
    measured = {"kv_cache": m.get("kv_cache"),  # what PTQ measured, where selection recorded no settings
                "effective_bpe": None if _number(m.get("effective_bpe")) is None else round(m["effective_bpe"], 3)}
    settings = {"recipe": recipe, **measured, **(row.get("settings") or {})}
    child.params = {k: v for k, v in settings.items() if v is not None}
    child.tags = {"status": row.get("status") or m.get("status"), "kv_cache": m.get("kv_cache"),
                  "alias_of": alias_of}
    if weight.get("worst"):
        child.tags["weight_error.worst"] = ", ".join(
            f"{w.get('layer')}: {w.get('error'):.4g}" for w in weight["worst"] if _number(w.get("error")) is not None)
    if not ok:
        child.tags[ERROR] = m.get("error") or row.get("error") or "failed (no error recorded)"
    child.dicts = {f"{recipe}.json": m}
    recipe_file = params.recipe_path(recipe)
    if recipe_file.is_file():
        child.texts[f"recipe/{recipe_file.name}"] = redact_text(recipe_file.read_text(errors="replace"))
    child.texts.update(_stage_log(layout, name))
    return child


def _selection_child(layout: Layout) -> ChildRun | None:
    path = layout.selection_metrics
    if not path.is_file():
        return None
    s = read_json(path)
    child = ChildRun("selection", "selection", *stage_span(layout, "selection", path))
    table = s.get("table") or []
    chosen = next((r for r in table if r.get("name") == s.get("selected")), None)
    child.metrics = {
        "recipes.ok": float(sum(r.get("status") == "ok" for r in table)),
        "recipes.alias": float(sum(r.get("status") == "alias" for r in table)),
        "recipes.failed": float(sum(r.get("status") not in ("ok", "alias") for r in table)),
        **({} if chosen is None else _pick(chosen, "median_recovery", "effective_bpe", "kl_divergence")),
        **({} if chosen is None else _ci_metrics(chosen.get("median_recovery_ci"), "median_recovery")),
        **_pick(s, "could_compress_further"),
    }
    reason = str(s.get("reason") or "")
    child.tags = {"selected": s.get("selected") or "none", "runner_up": s.get("runner_up"), "policy": s.get("policy"),
                  "band": s.get("band"), "reason": short_reason(reason)}
    child.dicts = {"selection.json": s}
    child.texts = {REASON_FILE: reason, **_stage_log(layout, "selection")}
    return child


REASON_FILE = "selection_reason.txt"
SHORT_REASON = 250  # characters of the reason in a tag; the full text is the artifact REASON_FILE


def short_reason(reason: str) -> str:
    """The reason's first sentence, at most SHORT_REASON characters, pointing at the full text."""
    text = " ".join(reason.split())
    first = text.split(". ", 1)[0].rstrip(".") + "."
    if len(first) > SHORT_REASON:
        first = first[:SHORT_REASON].rsplit(" ", 1)[0] + " …"
    return first if first == text else f"{first} (full text: {REASON_FILE})"


def _qad_child(layout: Layout) -> ChildRun | None:
    path = layout.qad / "loss.json"
    if not path.is_file():
        return None
    q = read_json(path)
    start, end = stage_span(layout, "qad", path)
    if start == end:  # no usage file: loss.json says how long it trained
        start = int(end - 1000 * (_number(q.get("seconds")) or 0.0))
    child = ChildRun("qad", "qad", start, end)
    losses = [p for p in q.get("losses") or [] if _number(p.get("step")) is not None]
    last = max((int(p["step"]) for p in losses), default=1) or 1
    first = int(q.get("resumed_from") or 0)
    for point in losses:
        step = int(point["step"])
        # The file has no wall time per step: spread the steps this run trained over its duration.
        frac = (step - first) / max(1, last - first) if step > first else 0.0
        ms = int(start + frac * (end - start))
        for key in ("loss", "lr"):
            if _number(point.get(key)) is not None:
                child.steps.append((key, float(point[key]), ms, step))
    child.metrics = _pick(q, "steps", "resumed_from", "final_loss", "first_loss", "steps_per_second",
                          "tokens_per_step", "seconds")
    child.dicts = {"loss.json": q}
    child.texts = _stage_log(layout, "qad")
    return child


def _final_eval_child(layout: Layout) -> ChildRun | None:
    path = layout.qad_metrics
    if not path.is_file():
        return None
    m = read_json(path)
    child = ChildRun("final_eval", "final_eval", *stage_span(layout, "final_eval", path), recipe=m.get("recipe"))
    child.metrics = {**_task_metrics(m.get("tasks") or {}),
                     **_pick(m, "median_recovery", "ptq_median_recovery", "kl_divergence", "qad_beats_ptq"),
                     **_ci_metrics(m.get("median_recovery_ci"), "median_recovery")}
    child.tags = {"qad_beats_ptq": m.get("qad_beats_ptq")}
    child.dicts = {"qad.json": m}
    child.texts = _stage_log(layout, "final_eval")
    return child


def _export_child(layout: Layout) -> ChildRun | None:
    path = layout.export_metrics
    if not path.is_file():
        return None
    e = read_json(path)
    passed = bool(e.get("passed"))
    child = ChildRun("export", "export", *stage_span(layout, "export", path), "FINISHED" if passed else "FAILED")
    child.metrics = _numeric_leaves({k: v for k, v in e.items() if k != "serving"})
    checks = e.get("checks") or {}
    child.tags = {f"check.{name}": "passed" if c.get("passed") else "FAILED" for name, c in checks.items()}
    child.tags.update({"path": e.get("path"), "vllm": (e.get("serving") or {}).get("vllm"),
                       "serving_check": (e.get("serving_check") or {}).get("level"),
                       "serving_check.summary": (e.get("serving_check") or {}).get("summary")})
    if not passed:
        failed = [f"{n}: {c.get('problems') or 'failed'}" for n, c in checks.items() if not c.get("passed")]
        child.tags[ERROR] = "export verification failed: " + "; ".join(failed)
    child.dicts = {"export.json": e}
    child.texts = _stage_log(layout, "export")
    return child


def read_children(layout: Layout, params: Params) -> list[ChildRun]:
    """One ChildRun per stage (and recipe) whose files exist, in pipeline order."""
    table = read_json(layout.selection_metrics).get("table") or [] if layout.selection_metrics.is_file() else []
    rows = {r.get("name"): r for r in table}
    children = [_calibration_child(layout, params), _baseline_child(layout)]
    children += [_ptq_child(layout, params, r, rows.get(r) or {}) for r in params.ptq.recipes]
    children += [_selection_child(layout), _qad_child(layout), _final_eval_child(layout), _export_child(layout)]
    return [c for c in children if c is not None]


def pipeline_status(layout: Layout, params: Params) -> tuple[str, str]:
    """(MLflow status, why) of a pipeline run, judged from which files exist.

    FINISHED when the flow reached its end: selection chose nothing (the report says why), the
    policy is ptq_final, or the export passed its checks. Otherwise FAILED, naming the first
    stage whose result is missing.
    """
    if not layout.selection_metrics.is_file():
        missing = next(s for s, p in (("calibration", layout.data / "manifest.json"),
                                      ("baseline", layout.baseline_metrics),
                                      ("selection", layout.selection_metrics)) if not p.is_file())
        return "FAILED", f"no result from {missing}"
    selection = read_json(layout.selection_metrics)
    if selection.get("selected") is None:
        return "FINISHED", "no recipe selected: " + str(selection.get("reason"))
    if params.selection.policy != "qad":
        return "FINISHED", f"PTQ is the last step ({selection['selected']})"
    for stage, path in (("qad", layout.qad / "loss.json"), ("final_eval", layout.qad_metrics),
                        ("export", layout.export_metrics)):
        if not path.is_file():
            return "FAILED", f"no result from {stage}"
    if not read_json(layout.export_metrics).get("passed"):
        return "FAILED", "export verification failed"
    return "FINISHED", "exported"


# -- logging -------------------------------------------------------------------------------------


def client_for(uri: str) -> MlflowClient:
    """An MlflowClient on `uri` for both tracking and the model registry."""
    from mlflow import MlflowClient

    if uri.startswith("sqlite:"):
        check_reachable(uri)  # creates the database's folder
    return MlflowClient(tracking_uri=uri, registry_uri=uri)


def _artifact_location(uri: str, root: Path) -> str | None:
    """Where a new experiment keeps its artifacts: beside the data for a database the process
    writes itself (sqlite, postgresql, ...); a tracking server chooses its own."""
    scheme = urllib.parse.urlparse(uri).scheme.lower()
    if scheme in ("http", "https", "databricks", "databricks-uc", "file", ""):
        return None
    return (Path(root).resolve() / "mlartifacts").as_uri()


def ensure_experiment(client: MlflowClient, name: str, artifact_location: str | None = None) -> str:
    """The id of experiment `name`, created (or restored from deletion) when needed."""
    from mlflow.exceptions import MlflowException

    exp = client.get_experiment_by_name(name)
    if exp is None:
        try:
            return client.create_experiment(name, artifact_location=artifact_location)
        except MlflowException:  # created meanwhile by another process
            exp = client.get_experiment_by_name(name)
            if exp is None:
                raise
    if exp.lifecycle_stage == "deleted":
        client.restore_experiment(exp.experiment_id)
    return exp.experiment_id


def _process_tags() -> dict[str, str]:
    """Who is logging: host, pid and the pid's start time (so a reused pid is not mistaken)."""
    tags = {HOST: socket.gethostname(), PID: str(os.getpid())}
    started = _process_started(os.getpid())
    if started is not None:
        tags[PID_STARTED] = f"{started:.2f}"
    return tags


def _process_started(pid: int) -> float | None:
    try:
        import psutil

        return psutil.Process(pid).create_time()
    except Exception:  # noqa: BLE001 (no psutil, no such process)
        return None


def _process_alive(pid: int, started: str | None) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # exists, owned by someone else
    if started:
        now = _process_started(pid)
        if now is not None and abs(now - float(started)) > 1.0:
            return False  # the pid was reused by another process
    return True


def _log_batch(client: MlflowClient, run_id: str, *, params: Mapping[str, Any] | None = None,
               tags: Mapping[str, Any] | None = None, metrics: Mapping[str, float] | None = None,
               timestamp_ms: int | None = None, steps: Iterable[tuple[str, float, int, int]] = ()) -> None:
    """log_batch in chunks within MLflow's limits; every param and tag value passes through redact."""
    from mlflow.entities import Metric, Param, RunTag

    ts = timestamp_ms if timestamp_ms is not None else int(time.time() * 1000)
    p = [Param(k, redact(k, v)[:MAX_PARAM_VALUE]) for k, v in (params or {}).items()]
    t = [RunTag(k, redact(k, v)[:MAX_TAG_VALUE]) for k, v in (tags or {}).items() if v is not None]
    m = [Metric(_metric_key(k), float(v), ts, 0) for k, v in (metrics or {}).items()
         if v is not None and not (isinstance(v, float) and math.isnan(v))]
    m += [Metric(_metric_key(k), float(v), ms, step) for k, v, ms, step in steps]
    for i in range(0, max(len(p), len(t)), MAX_BATCH):
        client.log_batch(run_id, params=p[i:i + MAX_BATCH], tags=t[i:i + MAX_BATCH])
    for i in range(0, len(m), MAX_METRIC_BATCH):
        client.log_batch(run_id, metrics=m[i:i + MAX_METRIC_BATCH])


def _log_inputs(client: MlflowClient, run_id: str, datasets: list[tuple[Dataset, str]]) -> None:
    """mlflow.log_input's entity, logged through the client (no active run needed)."""
    from mlflow.entities import DatasetInput, InputTag
    from mlflow.utils.mlflow_tags import MLFLOW_DATASET_CONTEXT
    from mlflow.utils.validation import MAX_INPUT_TAG_VALUE_SIZE

    inputs = []
    for dataset, context in datasets:
        full = json.loads(dataset.to_dict()["profile"]).get("fingerprint", dataset.digest)
        inputs.append(DatasetInput(dataset=dataset._to_mlflow_entity(), tags=[
            InputTag(MLFLOW_DATASET_CONTEXT, context),
            InputTag("fingerprint", str(full)[:MAX_INPUT_TAG_VALUE_SIZE]),
        ]))
    if inputs:
        client.log_inputs(run_id, datasets=inputs)


def _log_files(client: MlflowClient, run_id: str, dicts: Mapping[str, Any], texts: Mapping[str, str]) -> None:
    for name, data in dicts.items():
        client.log_dict(run_id, redact_data(data), name)
    for name, text in texts.items():
        client.log_text(run_id, redact_text(text), name)


def start_pipeline_run(layout: Layout, params: Params, *, flow_run_id: str | None, git_commit: str | None,
                       uri: str | None = None, start_ms: int | None = None) -> str:
    """Create the parent run of one pipeline run (RUNNING): configuration, identity, provenance.

    Call it when the flow starts to have the run visible while it runs, then hand its id to
    `log_pipeline(..., run_id=...)` at the end; `log_pipeline` calls it itself otherwise.
    """
    uri = uri or tracking_uri(layout.root)
    client = client_for(uri)
    exp_id = ensure_experiment(client, experiment_name(params.base_model.path),
                               _artifact_location(uri, layout.root))
    start_ms = start_ms if start_ms is not None else int(time.time() * 1000)
    name = "pipeline-" + time.strftime("%Y%m%d-%H%M%S", time.localtime(start_ms / 1000))
    run = client.create_run(exp_id, start_time=start_ms, run_name=name,
                            tags={KIND: "pipeline", **_process_tags()})
    run_id = run.info.run_id
    # Path and revision now; the content hash is tagged by `log_pipeline` from this run's baseline
    # (a baseline.json already in the out root may belong to an earlier run and another model).
    identity = {"path": params.base_model.path, "revision": params.base_model.revision}
    tags = {
        LOGGED_AT: f"{int(time.time() * 1000):015d}",
        "qad.out_root": str(layout.root),
        **{f"base_model.{k}": v for k, v in identity.items()},
        FLOW_RUN_ID: flow_run_id,
        GIT_COMMIT: git_commit,
        "git_commit": git_commit,
    }
    try:
        import getpass

        tags["mlflow.user"] = getpass.getuser()
    except Exception:  # noqa: BLE001
        pass
    config = params.model_dump(mode="json")
    _log_batch(client, run_id, params=flatten(config), tags=tags, timestamp_ms=start_ms)
    client.log_dict(run_id, redact_data(config), "config/params.json")
    return run_id


def _checkpoint_identity(layout: Layout, params: Params) -> dict:
    """The base checkpoint's path, revision and sha256, as the baseline stage recorded it; when
    there is no baseline yet, `checkpoint_identity` of the configured model (hashes a local folder)."""
    if layout.baseline_metrics.is_file():
        model = read_json(layout.baseline_metrics).get("model")
        if isinstance(model, Mapping) and model.get("path"):
            return dict(model)
    try:
        from qad_pipeline.modeling import checkpoint_identity

        return checkpoint_identity(params.base_model)
    except ConfigError:
        return {"path": params.base_model.path, "revision": params.base_model.revision, "sha256": "unavailable"}


def _end_quietly(client: MlflowClient, run_id: str, status: str) -> None:
    """End a run after an error without hiding that error (the store may be what failed)."""
    try:
        client.set_terminated(run_id, status)
    except Exception:  # noqa: BLE001 (left RUNNING: mark_stale_runs ends it later)
        pass


def log_child(client: MlflowClient, experiment_id: str, parent_run_id: str, child: ChildRun) -> str:
    """Log one ChildRun under the parent and end it with its status; returns its run id."""
    tags = {PARENT: parent_run_id, KIND: "stage", STAGE: child.stage, **_process_tags()}
    if child.recipe:
        tags[RECIPE] = child.recipe
    run = client.create_run(experiment_id, start_time=child.start_ms, run_name=child.name, tags=tags)
    run_id = run.info.run_id
    try:
        _log_batch(client, run_id, params=child.params, tags=child.tags, metrics=child.metrics,
                   timestamp_ms=child.end_ms, steps=child.steps)
        _log_inputs(client, run_id, child.datasets)
        _log_files(client, run_id, child.dicts, child.texts)
    except BaseException:
        _end_quietly(client, run_id, "FAILED")
        raise
    client.set_terminated(run_id, child.status, end_time=max(child.end_ms, child.start_ms))
    return run_id


HEADLINE = ("median_recovery", "median_recovery_ci_low", "median_recovery_ci_high", "kl_divergence",
            "effective_bpe", "weight_error.median", "size_bytes")


def headline_metrics(children: list[ChildRun], selected: str | None) -> dict[str, float]:
    """The parent run's metrics, so the runs table compares pipeline runs at a glance.

    `selected.*`: the selected recipe's PTQ run (recovery, its interval, KL, bits, weight error);
    `qad.*`: the final eval of the QAD model (recovery, interval, KL, PTQ's recovery);
    `export.*`: the exported checkpoint (bits, size); and unprefixed `median_recovery`,
    `median_recovery_ci_low/high`, `kl_divergence`, `effective_bpe`: those of the model the run
    delivers (QAD's when it ran, else the selected PTQ recipe's), the same keys the recipe runs have.
    """
    by_stage = {c.stage: c for c in children if c.stage != "ptq"}
    chosen = next((c for c in children if c.stage == "ptq" and c.recipe == selected), None)
    out: dict[str, float] = {}
    if chosen is not None:
        out.update({f"selected.{k}": chosen.metrics[k] for k in HEADLINE if k in chosen.metrics})
        out.update({k: chosen.metrics[k] for k in HEADLINE[:5] if k in chosen.metrics})
    if "final_eval" in by_stage:
        final = by_stage["final_eval"].metrics
        keep = (*HEADLINE[:4], "ptq_median_recovery")
        out.update({f"qad.{k}": final[k] for k in keep if k in final})
        out.update({k: final[k] for k in HEADLINE[:4] if k in final})
        for k in HEADLINE[1:3]:  # an interval from the selected recipe must not stand beside QAD's recovery
            if k not in final:
                out.pop(k, None)
    if "export" in by_stage:
        export = by_stage["export"].metrics
        out.update({f"export.{k}": export[k] for k in ("effective_bpe", "size_bytes", "size_ratio", "passed")
                    if k in export})
        if "effective_bpe" in export:
            out["effective_bpe"] = export["effective_bpe"]
    return out


def log_pipeline(layout: Layout, params: Params, *, flow_run_id: str | None, git_commit: str | None,
                 report: str | None = None, uri: str | None = None, run_id: str | None = None,
                 status: str | None = None) -> str:
    """Log one pipeline run from its files; returns the parent run's id.

    Creates the parent run (or completes `run_id` from `start_pipeline_run`), one child per stage
    and recipe whose files exist (see `read_children`), logs the datasets, the selection, the
    report text and headline metrics on the parent and ends it with `status` (default: judged
    from the files by `pipeline_status`). Runs left RUNNING by a killed earlier logger of this
    host are marked first (`mark_stale_runs`).
    """
    uri = uri or tracking_uri(layout.root)
    client = client_for(uri)
    mark_stale_runs(uri)
    children = read_children(layout, params)
    if run_id is None:
        first = min((c.start_ms for c in children), default=None)
        run_id = start_pipeline_run(layout, params, flow_run_id=flow_run_id, git_commit=git_commit, uri=uri,
                                    start_ms=first)
    parent = client.get_run(run_id)
    exp_id = parent.info.experiment_id
    try:
        child_ids = {c.name: log_child(client, exp_id, run_id, c) for c in children}
        by_stage = {c.stage: c for c in children}
        datasets = by_stage["calibration"].datasets if "calibration" in by_stage else []
        _log_inputs(client, run_id, datasets)

        derived_status, why = pipeline_status(layout, params)
        metrics: dict[str, float] = {}
        tags: dict[str, Any] = {"qad.result": why, "qad.children": json.dumps(child_ids),
                                **{f"base_model.{k}": v for k, v in _checkpoint_identity(layout, params).items()}}
        if "selection" in by_stage:
            sel = by_stage["selection"]
            tags.update({"qad.selected": sel.tags["selected"], "qad.policy": sel.tags["policy"],
                         "qad.runner_up": sel.tags.get("runner_up"), "qad.selection.reason": sel.tags["reason"]})
            _log_files(client, run_id, {"selection.json": sel.dicts["selection.json"]},
                       {REASON_FILE: sel.texts[REASON_FILE]})
        metrics.update(headline_metrics(children, tags.get("qad.selected")))
        tags[NOTE] = f"**Result:** {why if len(why) <= SHORT_REASON else why[:SHORT_REASON] + ' …'}\n"
        if "selection" in by_stage and layout.baseline_metrics.is_file():
            summary = read_summary(layout, params.ptq.recipes)
            tags[NOTE] += "\n" + run_description(summary, reason_file=REASON_FILE, max_chars=MAX_TAG_VALUE - 500)
            client.log_text(run_id, redact_text(report_markdown(summary)), "report.md")
        if report:
            client.log_text(run_id, redact_text(report), "report.txt")
        for png in sorted((layout.metrics / "plots").glob("*.png")):
            client.log_artifact(run_id, str(png), "plots")
        end_ms = max([c.end_ms for c in children] + [parent.info.start_time or 0])
        _log_batch(client, run_id, tags=tags, metrics=metrics, timestamp_ms=end_ms)
    except BaseException:
        _end_quietly(client, run_id, "FAILED")
        raise
    client.set_terminated(run_id, status or derived_status, end_time=end_ms)
    return run_id


# -- model registry ------------------------------------------------------------------------------


def _children(client: MlflowClient, parent: Any) -> list[Any]:
    return client.search_runs(
        [parent.info.experiment_id], filter_string=f"tags.`{PARENT}` = '{parent.info.run_id}'", max_results=5000
    )


def register_export(layout: Layout, params: Params, parent_run_id: str, *, uri: str | None = None,
                    alias: str = CANDIDATE_ALIAS) -> str:
    """Log artifacts/export into the pipeline (parent) run and register it; returns the new version.

    The registered model is `registered_model_name(base_model.path)`; the version's source is the
    parent run's `checkpoint/` artifact folder and its run_id the parent run, so the run page
    lists it; its description (Markdown) quotes the exported model's own recovery
    (metrics/qad.json, with its interval), the PTQ recovery it started from, the git commit and
    the fingerprints of the base checkpoint and of the calibration and eval data. `alias`
    (default `candidate`) is moved onto it, so `models:/<name>@candidate` leads back to the run.
    """
    from mlflow.exceptions import MlflowException

    uri = uri or tracking_uri(layout.root)
    client = client_for(uri)
    parent = client.get_run(parent_run_id)
    export_runs = [r for r in _children(client, parent) if r.data.tags.get(STAGE) == "export"]
    if not export_runs:
        raise ConfigError(f"pipeline run {parent_run_id} has no export run to register "
                          f"(no {layout.export_metrics} when it was logged)")
    run = export_runs[0]
    if run.info.status != "FINISHED":
        raise ConfigError(f"the export of pipeline run {parent_run_id} did not pass its checks "
                          f"({run.data.tags.get(ERROR, run.info.status)}); nothing registered")
    if not layout.export.is_dir() or not any(layout.export.iterdir()):
        raise ConfigError(f"no exported checkpoint in {layout.export} to register")

    client.log_artifacts(parent_run_id, str(layout.export), CHECKPOINT_ARTIFACT)
    name = registered_model_name(params.base_model.path)
    try:
        client.get_registered_model(name)
    except MlflowException:
        try:
            client.create_registered_model(
                name, tags={"base_model.path": redact("path", params.base_model.path)},
                description=f"NVFP4 exports of {redact('path', params.base_model.path)} by qad-pipeline",
            )
        except MlflowException:
            client.get_registered_model(name)  # created meanwhile; anything else raises here
    facts = version_facts(layout, parent, run)
    version = client.create_model_version(
        name, source=f"{parent.info.artifact_uri.rstrip('/')}/{CHECKPOINT_ARTIFACT}", run_id=parent_run_id,
        tags={k: redact(k, v) for k, v in facts.items() if v is not None},
        description=redact_text(version_description(facts)),
    )
    client.set_registered_model_alias(name, alias, version.version)
    where = f"models:/{name}/{version.version}"
    client.set_tag(run.info.run_id, "registered_model", where)
    client.set_tag(parent_run_id, "qad.registered_model", where)
    return str(version.version)


def version_facts(layout: Layout, parent: Any, export_run: Any) -> dict[str, Any]:
    """What a registered version records about itself, from the files and the runs' tags."""
    qad = read_json(layout.qad_metrics) if layout.qad_metrics.is_file() else {}
    manifest = read_json(layout.data / "manifest.json") if (layout.data / "manifest.json").is_file() else {}
    ci = qad.get("median_recovery_ci") if isinstance(qad.get("median_recovery_ci"), list) else [None, None]
    m = export_run.data.metrics
    return {
        "recipe": export_run.data.tags.get(RECIPE) or qad.get("recipe") or parent.data.tags.get("qad.selected"),
        "pipeline_run_id": parent.info.run_id,
        "median_recovery": qad.get("median_recovery"),
        "median_recovery_ci_low": ci[0], "median_recovery_ci_high": ci[1],
        "ptq_median_recovery": qad.get("ptq_median_recovery"),
        "kl_divergence": qad.get("kl_divergence"),
        "effective_bpe": m.get("effective_bpe"),
        "size_bytes": None if m.get("size_bytes") is None else int(m["size_bytes"]),
        "git_commit": parent.data.tags.get(GIT_COMMIT),
        "base_model.path": parent.data.tags.get("base_model.path"),
        "base_model.sha256": parent.data.tags.get("base_model.sha256"),
        "calibration.fingerprint": (manifest.get("calibration") or {}).get("fingerprint"),
        "eval.fingerprint": (manifest.get("eval") or {}).get("fingerprint"),
    }


def version_description(facts: Mapping[str, Any]) -> str:
    """A registered version's description (Markdown, values rounded) from `version_facts`."""
    def pct(key: str) -> str:
        return "–" if _number(facts.get(key)) is None else f"{100 * facts[key]:.2f} %"

    interval = ("" if _number(facts.get("median_recovery_ci_low")) is None else
                f" (CI {100 * facts['median_recovery_ci_low']:.2f}–{100 * facts['median_recovery_ci_high']:.2f} %)")
    bits = "–" if _number(facts.get("effective_bpe")) is None else f"{facts['effective_bpe']:.3f}"
    kl = "–" if _number(facts.get("kl_divergence")) is None else f"{facts['kl_divergence']:.4f}"
    lines = [
        f"NVFP4 export of `{facts.get('base_model.path')}`, recipe `{facts.get('recipe')}` after QAD.",
        "",
        "| model | median recovery vs BF16 | bits/elem | KL vs BF16 |",
        "|---|---|---|---|",
        f"| this export (QAD) | {pct('median_recovery')}{interval} | {bits} | {kl} |",
        f"| PTQ before QAD | {pct('ptq_median_recovery')} | {bits} | – |",
        "",
        f"- pipeline run: `{facts.get('pipeline_run_id')}`",
        f"- git commit: `{facts.get('git_commit') or 'unknown'}`",
        f"- base checkpoint sha256: `{facts.get('base_model.sha256') or 'unknown'}`",
        f"- calibration data fingerprint: `{facts.get('calibration.fingerprint') or 'unknown'}`",
        f"- eval data fingerprint: `{facts.get('eval.fingerprint') or 'unknown'}`",
    ]
    return "\n".join(lines) + "\n"


def run_url(uri: str, experiment_id: str, run_id: str) -> str:
    """The run's page in the MLflow UI: on the tracking server itself for an http(s) URI, else on
    `mlflow ui --backend-store-uri <uri>` at its default address, http://127.0.0.1:5000."""
    base = uri.rstrip("/") if urllib.parse.urlparse(uri).scheme in ("http", "https") else "http://127.0.0.1:5000"
    return f"{redact_text(base)}/#/experiments/{experiment_id}/runs/{run_id}"


# -- housekeeping and reading back ---------------------------------------------------------------


def _pipeline_experiment_ids(client: MlflowClient) -> list[str]:
    ids, token = [], None
    while True:
        page = client.search_experiments(filter_string=f"name LIKE '{EXPERIMENT_PREFIX}%'", page_token=token)
        ids += [e.experiment_id for e in page]
        token = page.token
        if not token:
            return ids


def mark_stale_runs(uri: str, *, all_hosts: bool = False, status: str = "KILLED") -> list[str]:
    """Mark runs left RUNNING by a killed pipeline logger as ended; returns their ids.

    A run of this module (tag `qad.kind`) is stale when the process that created it (tags
    `qad.host`, `qad.pid`, `qad.pid_started`) no longer runs on this host. Runs of other hosts
    are left alone unless `all_hosts` (use it when no other pipeline can be running). They end
    with `status` (KILLED by default) and a tag `qad.stale` that says why.
    """
    client = client_for(uri)
    ids = _pipeline_experiment_ids(client)
    if not ids:
        return []
    host = socket.gethostname()
    marked = []
    for run in client.search_runs(ids, filter_string="attributes.status = 'RUNNING'", max_results=5000):
        tags = run.data.tags
        if KIND not in tags:
            continue
        pid = int(tags[PID]) if tags.get(PID, "").isdigit() else None
        if tags.get(HOST) == host:
            if pid is not None and _process_alive(pid, tags.get(PID_STARTED)):
                continue
        elif not all_hosts:
            continue
        why = f"left RUNNING by process {pid} on {tags.get(HOST)}, which no longer runs; marked {status}"
        client.set_tag(run.info.run_id, "qad.stale", why)
        client.set_terminated(run.info.run_id, status)
        marked.append(run.info.run_id)
    return marked


def find_experiment(client: MlflowClient, experiment: str) -> Any:
    """An experiment by its name, or by the base model path it was named after."""
    for name in (experiment, experiment_name(experiment)):
        exp = client.get_experiment_by_name(name)
        if exp is not None:
            return exp
    known = [e.name for e in client.search_experiments(filter_string=f"name LIKE '{EXPERIMENT_PREFIX}%'")]
    raise ConfigError(f"no MLflow experiment {experiment!r} or {experiment_name(experiment)!r}; known: {known}")


def latest_pipeline_run(client: MlflowClient, experiment_id: str) -> Any:
    """The parent run that started last (ties: the one logged last)."""
    runs = client.search_runs(
        [experiment_id], filter_string=f"tags.`{KIND}` = 'pipeline'",
        order_by=["attributes.start_time DESC", f"tags.`{LOGGED_AT}` DESC"], max_results=1,
    )
    if not runs:
        raise ConfigError(f"experiment {experiment_id} holds no qad-pipeline run")
    return runs[0]


def _status(run: Any) -> str:
    return {"FINISHED": "ok", "FAILED": "failed"}.get(run.info.status, run.info.status.lower())


def compare_table(uri: str, experiment: str, run_id: str | None = None) -> list[dict]:
    """Rows read back from MLflow for one pipeline run (the latest, or `run_id`, parent or child).

    One row each for bf16, every recipe (in the configured order; the chosen one has
    `selected: True`) and qad: per-task recovery (`recovery.<task>`), `median_recovery` and its
    interval (`median_recovery_ci_low/high`), `kl_divergence`, `effective_bpe`, `size_bytes`,
    `status` ("ok", "failed", "alias of <recipe>", ...), `error`, `run_id`.
    """
    client = client_for(uri)
    if run_id is None:
        parent = latest_pipeline_run(client, find_experiment(client, experiment).experiment_id)
    else:
        parent = client.get_run(run_id)
        if PARENT in parent.data.tags:
            parent = client.get_run(parent.data.tags[PARENT])
    children = _children(client, parent)
    by_stage: dict[str, list] = {}
    for child in children:
        by_stage.setdefault(child.data.tags.get(STAGE, ""), []).append(child)
    selected = parent.data.tags.get("qad.selected")
    try:
        order = json.loads(parent.data.params.get("ptq.recipes", "[]"))
    except json.JSONDecodeError:
        order = []
    tasks: list[str] = []
    for child in children:
        tasks += [k[len("score."):] for k in child.data.metrics if k.startswith("score.")
                  and k[len("score."):] not in tasks]

    def row(name: str, run: Any, **extra) -> dict:
        m = run.data.metrics
        alias_of = run.data.tags.get("alias_of")
        out = {"name": name, "status": f"alias of {alias_of}" if alias_of else _status(run), "selected": False,
               **{f"recovery.{t}": m.get(f"recovery.{t}") for t in tasks},
               "median_recovery": m.get("median_recovery"),
               "median_recovery_ci_low": m.get("median_recovery_ci_low"),
               "median_recovery_ci_high": m.get("median_recovery_ci_high"),
               "kl_divergence": m.get("kl_divergence"), "effective_bpe": m.get("effective_bpe"),
               "size_bytes": m.get("size_bytes"), "run_id": run.info.run_id}
        if ERROR in run.data.tags:
            out["error"] = run.data.tags[ERROR]
        return {**out, **extra}

    rows = []
    for base in by_stage.get("baseline", []):
        rows.append(row("bf16", base, **{f"recovery.{t}": 1.0 for t in tasks if f"score.{t}" in base.data.metrics},
                        median_recovery=1.0))
    recipes = sorted(by_stage.get("ptq", []), key=lambda r: (
        order.index(r.data.tags.get(RECIPE)) if r.data.tags.get(RECIPE) in order else len(order),
        r.data.tags.get(RECIPE, "")))
    for run in recipes:
        recipe = run.data.tags.get(RECIPE, run.info.run_name)
        rows.append(row(recipe, run, selected=recipe == selected))
    for run in by_stage.get("final_eval", []):
        export = (by_stage.get("export") or [None])[0]
        chosen = next((r for r in recipes if r.data.tags.get(RECIPE) == selected), None)
        size_from = export if export is not None else chosen
        extra = {} if size_from is None else {"effective_bpe": size_from.data.metrics.get("effective_bpe"),
                                              "size_bytes": size_from.data.metrics.get("size_bytes")}
        rows.append(row("qad", run, **extra))
    return rows


def compare_text(rows: list[dict]) -> str:
    """The compare table as aligned terminal text; `*` marks the selected recipe."""
    if not rows:
        return "(no runs)"
    recovery_cols = [k for k in rows[0] if k.startswith("recovery.")]
    for r in rows[1:]:
        recovery_cols += [k for k in r if k.startswith("recovery.") and k not in recovery_cols]
    header = ["name", "status", *[c[len("recovery."):] for c in recovery_cols], "median", "interval", "KL",
              "bits/elem", "size MB"]

    def num(value: Any, fmt: str) -> str:
        return "-" if value is None else format(value, fmt)

    cells = [[("* " if r.get("selected") else "  ") + str(r["name"]), str(r.get("status", "")),
              *[num(r.get(c), ".4f") for c in recovery_cols], num(r.get("median_recovery"), ".4f"),
              "-" if r.get("median_recovery_ci_low") is None else
              f"{r['median_recovery_ci_low']:.4f}-{r['median_recovery_ci_high']:.4f}",
              num(r.get("kl_divergence"), ".4f"), num(r.get("effective_bpe"), ".3f"),
              num(None if r.get("size_bytes") is None else r["size_bytes"] / 1e6, ".3f")] for r in rows]
    header[0] = "  " + header[0]
    widths = [max(len(h), *(len(c[i]) for c in cells)) for i, h in enumerate(header)]
    line = "  ".join(f"{{:<{w}}}" for w in widths)
    out = [line.format(*header), line.format(*("-" * w for w in widths))] + [line.format(*c) for c in cells]
    out += [f"{r['name']} FAILED: {r['error'][:300]}" for r in rows if r.get("error")]
    if any(r.get("selected") for r in rows):
        out.append("* selected recipe (recovery: quantized vs BF16 score; median over tasks)")
    return "\n".join(out)
