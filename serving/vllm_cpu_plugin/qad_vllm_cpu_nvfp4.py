"""A test-only vLLM plugin: NVFP4 linear layers on vLLM's CPU platform.

vLLM's CPU build parses Model Optimizer's NVFP4 checkpoints but has no NVFP4 linear kernel for the
CPU: its kernel registry lists CUDA and ROCm kernels only, and weight-only (W4A16) NVFP4 layers are
forced onto Marlin, a CUDA kernel. This plugin, loaded by vLLM from the `vllm.general_plugins`
entry point in every vLLM process, makes the CPU run them with vLLM's own pure-torch pieces:

* W4A4 layers: vLLM's `EmulationNvFp4LinearKernel` (activations quantized to NVFP4 with the
  checkpoint's input scale, weights dequantized, BF16 matmul), registered for the CPU platform
  through vLLM's public `register_linear_kernel`;
* W4A16 layers: the same kernel class with the activation step left out (the weights dequantized
  with vLLM's `dequantize_to_dtype`, then `F.linear`), returned by a wrapper around the ModelOpt
  method's kernel selection for `use_a16` on the CPU only.

It does nothing on any other platform (a GPU vLLM uses its own kernels) and it refuses any vLLM but
the version it was written against: it relies on vLLM-internal names, and a version bump that
moved them must fail loudly, not serve through a silently different path. Installed by
`qad-pipeline setup-vllm` into the serving check's own environment, never into the project's.
"""

from __future__ import annotations

VLLM_VERSION = "0.32.0"
_registered = False


def register() -> None:
    global _registered
    if _registered:
        return
    import vllm
    from vllm.platforms import PlatformEnum, current_platform

    if not current_platform.is_cpu():
        return
    if vllm.__version__ != VLLM_VERSION:
        raise RuntimeError(f"qad-vllm-cpu-nvfp4 was written for vLLM {VLLM_VERSION} and relies on its internals; "
                           f"this is vLLM {vllm.__version__}: re-run `qad-pipeline setup-vllm`")

    import torch
    import torch.nn.functional as F
    from vllm.model_executor.kernels.linear import register_linear_kernel
    from vllm.model_executor.kernels.linear.nvfp4.base import NvFp4LinearLayerConfig
    from vllm.model_executor.kernels.linear.nvfp4.emulation import EmulationNvFp4LinearKernel
    from vllm.model_executor.layers.quantization import modelopt
    from vllm.model_executor.layers.quantization.utils.nvfp4_emulation_utils import dequantize_to_dtype

    class WeightOnlyNvFp4CpuKernel(EmulationNvFp4LinearKernel):
        """W4A16: the NVFP4 weight dequantized (vLLM's own op), the activations left in BF16."""

        def apply_weights(self, layer, x, bias=None):
            weight = dequantize_to_dtype(layer.weight.data.view(torch.uint8), layer.weight_scale.data,
                                         layer.weight_global_scale, x.dtype, 16, swizzle=False)
            return F.linear(x, weight, bias)

    select = modelopt.init_nvfp4_linear_kernel

    def init_nvfp4_linear_kernel(use_a16: bool = False):
        return WeightOnlyNvFp4CpuKernel(NvFp4LinearLayerConfig()) if use_a16 else select(use_a16=False)

    register_linear_kernel(EmulationNvFp4LinearKernel, PlatformEnum.CPU, "nvfp4")
    modelopt.init_nvfp4_linear_kernel = init_nvfp4_linear_kernel
    _registered = True
