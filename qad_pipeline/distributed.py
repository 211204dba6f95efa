"""QAD's processes and checkpoints: the torchrun launch (`launch_processes`), this process's place
among them (`World`), the student spread over them (DDP or FSDP2) and the sharded, resumable
checkpoint (torch.distributed.checkpoint). `tasks/qad.py` runs the loop; see its docstring.
"""

from __future__ import annotations

import json
import os
import pickle
import signal
import subprocess
import sys
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)

from qad_pipeline.artifacts import staged_dir
from qad_pipeline.config import ConfigError, Params, StageError
from qad_pipeline.modeling import DTYPES, input_device, load_model, resolve_device
from qad_pipeline.processes import die_with_parent


def check_processes(params: Params) -> None:
    """`qad.num_gpus` processes can run here and split every batch evenly: fail before launching."""
    n, device = params.qad.num_gpus, resolve_device(params.hardware)
    if params.qad.batch_size % n:
        raise ConfigError(f"qad.batch_size = {params.qad.batch_size} does not split evenly over qad.num_gpus = {n}")
    if device == "cuda" and torch.cuda.device_count() < n:
        raise ConfigError(f"qad.num_gpus = {n} but this process sees {torch.cuda.device_count()} CUDA devices")


def launch_processes(params: Params, out_root: Path) -> None:
    """Run this process's own `qad-pipeline stage qad` command in `qad.num_gpus` processes (torchrun).

    The processes pass through the output root's lock that this process holds. On CPU
    (`hardware.device: cpu`, or `auto` without a GPU) they are CPU processes over gloo, one thread
    each unless OMP_NUM_THREADS says otherwise (torchrun's default).
    """
    from qad_pipeline.runlock import LOCK_NAME, TOKEN_ENV

    check_processes(params)
    command = sys.argv[1:]
    if command[:2] != ["stage", "qad"]:
        raise ConfigError("qad.num_gpus > 1 runs from the `qad-pipeline stage qad` command, which starts itself "
                          f"under torchrun; this process runs {command[:2]}")
    n = params.qad.num_gpus
    holder = json.loads((Path(out_root) / LOCK_NAME).read_text())  # `qad-pipeline stage` holds it for this run
    env = {**os.environ, TOKEN_ENV: holder["token"]}
    print(f"qad: {n} processes ({params.qad.sharding}) under torchrun", flush=True)
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}"]
    proc = subprocess.Popen([*torchrun, "-m", "qad_pipeline", *command], env=env,
                            preexec_fn=lambda: die_with_parent(signal.SIGTERM))  # in torchrun, before exec
    try:
        code = proc.wait()
    except BaseException:
        proc.terminate()  # torchrun passes it on to its processes
        proc.wait()
        raise
    if code != 0:
        raise StageError(f"qad: the {n} torchrun processes failed (exit code {code}); the failing one's error is above")


@dataclass(frozen=True)
class World:
    """The QAD processes: this one's rank among `size` (a world of one without torchrun)."""

    rank: int = 0
    size: int = 1
    device: torch.device = torch.device("cpu")  # where its collectives run: its GPU (NCCL) or the CPU (gloo)

    def rows(self, batch: torch.Tensor) -> torch.Tensor:
        """This process's share of a global batch."""
        per = len(batch) // self.size
        return batch[self.rank * per : (self.rank + 1) * per]

    def mean(self, value: float) -> float:
        """The mean of `value` over the processes, the same on every one."""
        if self.size == 1:
            return value
        total = torch.tensor(value, dtype=torch.float64, device=self.device)
        dist.all_reduce(total)
        return total.item() / self.size

    def from_rank0(self, obj):
        """Rank 0's `obj` (a picklable value), on every process."""
        if self.size > 1:
            box = [obj]
            dist.broadcast_object_list(box, src=0)
            obj = box[0]
        return obj

    def barrier(self) -> None:
        if self.size > 1:
            dist.barrier()


def join_world(params: Params) -> World:
    """A world of one, or this process's place among the torchrun processes (process group joined)."""
    size = int(os.environ.get("WORLD_SIZE", "1"))
    if size != params.qad.num_gpus:
        raise ConfigError(f"qad.num_gpus = {params.qad.num_gpus} but this process is one of {size} (WORLD_SIZE)")
    if size == 1:
        return World()
    check_processes(params)
    die_with_parent(signal.SIGKILL)  # torchrun's agent stops its processes, unless it is killed itself
    if resolve_device(params.hardware) == "cuda":
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)  # load_model places each process's models on its current device
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    return World(dist.get_rank(), size, device)


def spread(student, world: World, sharding: str):
    """With several processes: DDP (replicated) or FSDP2 (each decoder block a shard unit)."""
    if world.size == 1:
        return student
    device = input_device(student)
    if sharding == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(student, device_ids=[device] if device.type == "cuda" else None)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device.type, (world.size,))
    blocks = set(student._no_split_modules or [])  # transformers' own decoder-block classes
    for module in student.modules():
        if type(module).__name__ in blocks:
            fully_shard(module, mesh=mesh)
    fully_shard(student, mesh=mesh)  # embeddings, final norm, LM head
    return student


def save_checkpoint(folder: Path, world: World, student, optimizer, scheduler, step: int, losses: list[dict],
                    run_key: str) -> None:
    """Everything needed to resume, written whole or not at all; each process writes its own shard."""
    model_state, optimizer_state = get_state_dict(student, optimizer)
    with staged_dir(folder) if world.rank == 0 else nullcontext() as tmp:
        tmp = world.from_rank0(tmp)  # every process writes into rank 0's staging folder
        dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=tmp / "weights")
        if world.rank == 0:
            torch.save({"scheduler": scheduler.state_dict(), "step": step, "losses": losses, "run_key": run_key,
                        "world_size": world.size}, tmp / "state.pt")
        world.barrier()  # every shard is written before rank 0 moves the folder into place


def resume(folder: Path, world: World, student, optimizer, scheduler, run_key: str) -> tuple[int, list[dict]]:
    """(step, loss curve) of the checkpoint in `folder`, loaded into the student, AdamW and schedule."""
    if not (folder / "state.pt").is_file():
        return 0, []
    try:  # tensors and plain types only: a state.pt that holds anything else is not ours, and never unpickled
        state = torch.load(folder / "state.pt", weights_only=True)
    except pickle.UnpicklingError as err:
        raise StageError(f"qad: refusing to load the checkpoint state {folder / 'state.pt'}: it holds objects other "
                         f"than tensors and plain values ({str(err).splitlines()[0][:200]}); delete {folder} to "
                         "start afresh") from None
    if state.get("run_key") != run_key:
        if world.rank == 0:
            print(f"qad: ignoring the checkpoint in {folder}: it was made with other parameters or another student")
        return 0, []
    model_state, optimizer_state = get_state_dict(student, optimizer)
    dcp.load({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=folder / "weights")
    set_state_dict(student, optimizer, model_state_dict=model_state, optim_state_dict=optimizer_state)
    scheduler.load_state_dict(state["scheduler"])
    if world.rank == 0:
        print(f"qad: resuming from the checkpoint at step {state['step']} ({folder}; written by "
              f"{state['world_size']} process(es))", flush=True)
    return state["step"], state["losses"]


def trained_student(student, world: World, params: Params, student_dir: Path):
    """On rank 0 the trained student as one plain model in the base model's dtype; None elsewhere."""
    from torch.distributed.fsdp import FSDPModule

    if isinstance(student, FSDPModule):  # gather the shards into a fresh copy of the student on rank 0
        full = get_model_state_dict(student, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if world.rank != 0:
            return None
        student = load_model(params.base_model, params.hardware.model_copy(update={"device": "cpu"}),
                             folder=student_dir, dtype=torch.float32)
        student.load_state_dict(full)
    if world.rank != 0:
        return None
    return getattr(student, "module", student).to(DTYPES[params.base_model.dtype]).eval()  # DDP wraps it
