"""qad-pipeline: BF16 checkpoint -> five NVFP4 PTQ recipes -> selection -> QAD -> eval -> export.

Importing this package is enough to make Model Optimizer's NVFP4 fake quantization work on a
machine without CUDA: the CPU kernels of `qad_pipeline.nvfp4.nvfp4_cpu` are installed into Model
Optimizer as soon as `modelopt.torch.quantization` is imported (or at once, if it already is).
Importing Model Optimizer takes seconds, so it is not imported here before it is needed.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys

_QUANTIZATION = "modelopt.torch.quantization"


def _install() -> None:
    from qad_pipeline.nvfp4.nvfp4_cpu import install_cpu_kernels

    install_cpu_kernels()


class _InstallAfterImport(importlib.abc.MetaPathFinder):
    """Runs `_install` right after Model Optimizer's quantization package finishes importing."""

    def find_spec(self, fullname, path, target=None):
        if fullname != _QUANTIZATION:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_then_install(module):
            exec_module(module)
            _install()

        spec.loader.exec_module = exec_then_install
        return spec


if _QUANTIZATION in sys.modules:
    _install()
elif not any(isinstance(f, _InstallAfterImport) for f in sys.meta_path):
    sys.meta_path.insert(0, _InstallAfterImport())
