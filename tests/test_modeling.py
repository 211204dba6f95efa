"""Device placement: one setting (`hardware`) decides where every stage's model runs."""

import subprocess
import sys

import pytest
import torch

from qad_pipeline.core.config import ConfigError, load_params
from qad_pipeline.core.modeling import input_device, load_model, placement, resolve_device


def hardware(*overrides):
    return load_params(overrides=list(overrides)).hardware


def test_auto_is_the_cpu_without_a_gpu_and_cuda_is_refused_at_once(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device(hardware()) == "cpu"
    assert placement(hardware()) == {}
    with pytest.raises(ConfigError, match="hardware.device = 'cuda' but this process sees no CUDA device"):
        resolve_device(hardware("hardware.device=cuda"))


def test_with_a_gpu_visible_auto_takes_it_and_device_map_decides_the_spread(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert resolve_device(hardware()) == "cuda"
    assert placement(hardware("hardware.device_map=single")) == {"device_map": {"": 3}}
    assert placement(hardware()) == {"device_map": "auto"}  # the default: the plan's GPUs, spread as needed
    caps = placement(hardware("hardware.device_map=auto", 'hardware.max_memory={"0": "70GiB", "cpu": "400GiB"}'))
    assert caps == {"device_map": "auto", "max_memory": {0: "70GiB", "cpu": "400GiB"}}
    assert resolve_device(hardware("hardware.device=cpu")) == "cpu"


def test_bad_memory_caps_are_refused_with_the_key():
    with pytest.raises(ConfigError, match="max_memory key 'gpu0'"):
        hardware('hardware.max_memory={"gpu0": "70GiB"}')
    with pytest.raises(ConfigError, match=r"max_memory\['0'\] = 'lots'"):
        hardware('hardware.max_memory={"0": "lots"}')


CPU_FORCED = """
import torch
torch.cuda.is_available = lambda: True          # a GPU host, as far as the code can tell
import modelopt.torch.quantization              # the import hook sees CUDA: installs nothing
from qad_pipeline.nvfp4.nvfp4_cpu import is_installed
from qad_pipeline.core.config import load_params
from qad_pipeline.core.modeling import prepare_device
assert not is_installed(), "CPU kernels installed on a GPU host before any model asked for the CPU"
assert prepare_device(load_params(overrides={DEVICE}).hardware) == {EXPECT!r}
print("installed" if is_installed() else "not installed")
"""


@pytest.mark.parametrize("device, expect, kernels", [("cpu", "cpu", "installed"), ("auto", "cuda", "not installed")])
def test_a_cpu_model_on_a_gpu_host_gets_the_cpu_kernels(device, expect, kernels):
    code = CPU_FORCED.replace("{DEVICE}", repr([f"hardware.device={device}"])).replace("{EXPECT!r}", repr(expect))
    out = subprocess.run([sys.executable, "-c", "import qad_pipeline\n" + code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == kernels


def test_inputs_go_to_the_input_embeddings_device(demo_model_path):
    params = load_params()
    model = load_model(params.base_model, params.hardware)
    assert input_device(model) == torch.device("cpu") and model.dtype == torch.bfloat16
