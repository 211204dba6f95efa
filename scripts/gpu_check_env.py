"""The GPU check's first two stages (scripts/gpu_check.py): `env` (versions, unmet requirements,
every stage's imports) and `parity` (scripts/gpu_nvfp4_parity.py in a subprocess)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

PROJECT = Path(__file__).resolve().parent.parent


# -- env ----------------------------------------------------------------------------------------


def unmet_requirements(dists: list[str]) -> list[str]:
    """Requirements (extras left out) of `dists` that the installed packages do not meet."""
    from importlib import metadata

    from packaging.requirements import Requirement

    problems = []
    for dist in dists:
        try:
            requires = metadata.requires(dist) or []
        except metadata.PackageNotFoundError:
            problems.append(f"{dist}: not installed")
            continue
        for line in requires:
            req = Requirement(line)
            if req.marker is not None and not req.marker.evaluate({"extra": ""}):
                continue
            problem = unmet(req)
            if problem:
                problems.append(f"{dist} needs {req}: {problem}")
    return problems


def unmet(req) -> str | None:
    """Why the installed packages do not meet the `packaging` requirement `req` (None: they do)."""
    from importlib import metadata

    try:
        have = metadata.version(req.name)
    except metadata.PackageNotFoundError:
        return "missing"
    if req.specifier and not req.specifier.contains(have, prereleases=True):
        return f"{have} installed"
    return None


def wheel_names() -> list[str]:
    lines = (PROJECT / "scripts" / "gpu_wheels.txt").read_text().splitlines()
    return [line.split("#")[0].split("==")[0].strip() for line in lines if line.split("#")[0].strip()]


def env_stage(device: str):
    from importlib import metadata

    import tomllib
    import torch

    lines = [f"python {sys.version.split()[0]}, torch {torch.__version__} (CUDA {torch.version.cuda})"]
    if device == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError("torch sees no CUDA device")
        cap = torch.cuda.get_device_capability()
        lines.append(f"{torch.cuda.get_device_name()} (sm_{cap[0]}{cap[1]}), "
                     f"{torch.cuda.get_device_properties(0).total_memory / 2**30:.0f} GiB")
    for name in ("transformers", "nvidia-modelopt", "lm_eval", "datasets", "accelerate", "triton", "pydantic"):
        try:
            lines.append(f"{name} {metadata.version(name)}")
        except metadata.PackageNotFoundError:
            lines.append(f"{name} MISSING")
    import datasets  # noqa: F401
    import lm_eval  # noqa: F401
    import modelopt.torch.quantization as mtq  # noqa: F401
    from modelopt.torch.quantization import tensor_quant

    import tasks.export  # noqa: F401
    import tasks.qad  # noqa: F401
    from qad_pipeline.nvfp4 import nvfp4_cpu

    if device == "cuda":
        if nvfp4_cpu.is_installed():
            raise RuntimeError("the CPU NVFP4 emulation is installed on a CUDA machine")
        if not tensor_quant.triton_kernel.IS_AVAILABLE:
            raise RuntimeError("Model Optimizer's Triton kernels are not available")
        lines.append("Model Optimizer's Triton NVFP4 kernels available; CPU emulation not installed")
    pyproject = tomllib.loads((PROJECT / "pyproject.toml").read_text())
    wanted = pyproject["project"]["dependencies"]
    from packaging.requirements import Requirement

    project_unmet = [f"{req} ({problem})" for req in map(Requirement, wanted) if (problem := unmet(req))]
    carried = unmet_requirements(wheel_names())
    print("\n".join(f"    {line}" for line in lines))
    print("    project requirements not met here (the check runs without them):", ", ".join(project_unmet) or "none")
    print("    carried wheels' requirements not met here:" + ("".join(f"\n      {p}" for p in carried) or " none"))
    return True, "; ".join(lines[:2])


# -- parity -------------------------------------------------------------------------------------


def parity_stage(work: Path):
    log = work / "parity.log"
    with log.open("w") as fh:
        code = subprocess.run([sys.executable, str(PROJECT / "scripts" / "gpu_nvfp4_parity.py")], cwd=PROJECT,
                              stdout=fh, stderr=subprocess.STDOUT).returncode
    lines = log.read_text().splitlines()
    shown = [line for line in lines if "UNEXPLAINED" in line or "MODEL DIFFERS" in line][:20] + lines[-2:]
    print("\n".join(f"    {line}" for line in shown))
    summary = next((line for line in reversed(lines) if " cases, " in line), lines[-1] if lines else "no output")
    if code != 0:
        raise RuntimeError(f"gpu_nvfp4_parity.py exit {code}: {summary} (full output: {log})")
    return True, summary
