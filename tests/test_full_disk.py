"""The simulated full disk of tests/full_disk.py (the full-disk fault test's disk where no tmpfs can be
mounted) behaves as a real one does: ENOSPC once full, the file cut there, no free space left."""

import errno
import shutil

import pytest
import safetensors.torch
import torch

from tests.full_disk import simulate


def test_the_simulated_disk_fills_up_like_a_real_one(tmp_path, monkeypatch):
    monkeypatch.setattr(shutil, "disk_usage", shutil.disk_usage)  # restored after the test
    monkeypatch.setattr(safetensors.torch, "save_file", safetensors.torch.save_file)
    disk, elsewhere = tmp_path / "disk", tmp_path / "elsewhere"
    disk.mkdir()
    elsewhere.mkdir()
    simulate(disk, free=10 * 2**20, writable=2**20)
    assert shutil.disk_usage(disk).free == 10 * 2**20
    assert shutil.disk_usage(elsewhere).free != 10 * 2**20  # the real disk, outside the folder

    tensors = {"w": torch.zeros(2**16)}  # 256 KiB
    safetensors.torch.save_file(tensors, str(disk / "a.safetensors"))
    size = (disk / "a.safetensors").stat().st_size
    assert shutil.disk_usage(disk).free == 10 * 2**20 - size
    safetensors.torch.save_file({"w": torch.zeros(2**20)}, str(elsewhere / "big.safetensors"))  # not counted

    with pytest.raises(OSError) as err:
        safetensors.torch.save_file({"w": torch.zeros(2**18)}, str(disk / "b.safetensors"))  # 1 MiB: past the room
    assert err.value.errno == errno.ENOSPC
    assert (disk / "b.safetensors").stat().st_size == 2**20 - size  # cut where the disk ran out
    assert shutil.disk_usage(disk).free == 0
