"""A disk that fills up, simulated without root (tests/test_faults.py, where no tmpfs can be mounted):

    python -m tests.full_disk FOLDER FREE_BYTES WRITABLE_BYTES stage export --out-root FOLDER/run ...

runs `qad-pipeline stage ...` in this process with FOLDER on a simulated disk: `shutil.disk_usage`
under FOLDER reports FREE_BYTES free (less what was written), and the safetensors files written under
FOLDER (the bulk of an export: Model Optimizer's and transformers' `save_file`) fail with ENOSPC once
WRITABLE_BYTES have been written, the file left cut where the disk ran out, as a real full disk
leaves it. Patched before anything imports `save_file` by name.
"""

from __future__ import annotations

import errno
import os
import runpy
import shutil
import sys
from pathlib import Path


def simulate(folder: Path, free: int, writable: int) -> None:
    real_usage = shutil.disk_usage
    written = 0

    def under(path) -> bool:
        return Path(os.path.abspath(path)).is_relative_to(folder)

    def disk_usage(path):
        usage = real_usage(path)
        if not under(path):
            return usage
        left = 0 if written >= writable else max(free - written, 0)  # a disk that ran out says so
        return type(usage)(usage.total, usage.total - left, left)

    import safetensors.torch

    real_save = safetensors.torch.save_file

    def save_file(tensors, filename, metadata=None):
        nonlocal written
        real_save(tensors, filename, metadata=metadata)
        if not under(filename):
            return
        size = os.path.getsize(filename)
        if written + size > writable:
            os.truncate(filename, max(writable - written, 0))
            written = writable
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(filename))
        written += size

    shutil.disk_usage = disk_usage
    safetensors.torch.save_file = save_file


def main() -> None:
    folder, free, writable, *args = sys.argv[1:]
    simulate(Path(folder).resolve(), int(free), int(writable))
    sys.argv = ["qad-pipeline", *args]
    runpy.run_module("qad_pipeline", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
