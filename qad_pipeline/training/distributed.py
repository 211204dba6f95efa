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

from qad_pipeline.core.artifacts import staged_dir
from qad_pipeline.core.config import ConfigError, Params, StageError
from qad_pipeline.core.modeling import DTYPES, input_device, load_model, resolve_device
from qad_pipeline.platform.processes import die_with_parent
from qad_pipeline.core.stages import QAD
from qad_pipeline.nvfp4 import learned_scales


def check_processes(params: Params) -> None:
    """`qad.num_gpus` processes per node can run here and split every batch evenly: fail before launching."""
    q, device = params.qad, resolve_device(params.hardware)
    if q.batch_size % q.processes:
        over = f"qad.num_gpus = {q.num_gpus}" + (f" x qad.num_nodes = {q.num_nodes}" if q.num_nodes > 1 else "")
        raise ConfigError(f"qad.batch_size = {q.batch_size} does not split evenly over {over} processes")
    if device == "cuda" and torch.cuda.device_count() < q.num_gpus:
        raise ConfigError(f"qad.num_gpus = {q.num_gpus} but this process sees {torch.cuda.device_count()} CUDA devices")


def rendezvous(params: Params, token: str) -> list[str]:
    """torchrun's options: one node (`--standalone`), or `qad.num_nodes` joined through a c10d rendezvous
    at `qad.rdzv_endpoint` (else the first node's address that Kubeflow gives every node:
    $PET_MASTER_ADDR:$PET_MASTER_PORT, or $MASTER_ADDR:$MASTER_PORT), under an id every node of the
    run shares: its out-root lock's token."""
    q = params.qad
    if q.num_nodes == 1:
        return ["--standalone", f"--nproc-per-node={q.num_gpus}"]
    endpoint = q.rdzv_endpoint
    for prefix in ("PET_", ""):  # Kubeflow Trainer's torch runtime sets PET_MASTER_*, a PyTorchJob MASTER_*
        if endpoint is None and os.environ.get(f"{prefix}MASTER_ADDR"):
            endpoint = f"{os.environ[prefix + 'MASTER_ADDR']}:{os.environ.get(prefix + 'MASTER_PORT', '29400')}"
    if endpoint is None:
        raise ConfigError(f"qad.num_nodes = {q.num_nodes} needs a rendezvous: set qad.rdzv_endpoint=host:port "
                          "(a host every node reaches) or MASTER_ADDR and MASTER_PORT in the environment")
    return [f"--nnodes={q.num_nodes}", f"--nproc-per-node={q.num_gpus}", "--rdzv-backend=c10d",
            f"--rdzv-endpoint={endpoint}", f"--rdzv-id=qad-{token[:16]}"]


def launch_processes(params: Params, out_root: Path) -> None:
    """Run this process's own `qad-pipeline stage qad` command in `qad.num_gpus` processes (torchrun),
    on this node, joined with the other nodes' with `qad.num_nodes > 1` (`rendezvous`).

    The processes pass through the output root's lock that this process holds; on a joining node
    the command runs with the run's token in its environment (a Kubernetes job gets it from the flow),
    so it passes through the lock that the run holds on the shared out-root. On CPU
    (`hardware.device: cpu`, or `auto` without a GPU) they are CPU processes over gloo, one thread
    each unless OMP_NUM_THREADS says otherwise (torchrun's default).
    """
    from qad_pipeline.platform.runlock import LOCK_NAME, TOKEN_ENV

    check_processes(params)
    command = [*sys.argv[1:], *pinned(params)]
    if command[:2] != ["stage", QAD.name]:
        raise ConfigError("qad.num_gpus > 1 runs from the `qad-pipeline stage qad` command, which starts itself "
                          f"under torchrun; this process runs {command[:2]}")
    q = params.qad
    holder = json.loads((Path(out_root) / LOCK_NAME).read_text())  # `qad-pipeline stage` holds it for this run
    env = {**os.environ, TOKEN_ENV: holder["token"]}
    nodes = f" on each of {q.num_nodes} nodes" if q.num_nodes > 1 else ""
    print(f"qad: {q.num_gpus} processes{nodes} ({q.sharding}{', offloaded' if q.offload else ''}) under torchrun",
          flush=True)
    torchrun = [sys.executable, "-m", "torch.distributed.run", *rendezvous(params, holder["token"])]
    proc = subprocess.Popen([*torchrun, "-m", "qad_pipeline", *command], env=env,
                            preexec_fn=lambda: die_with_parent(signal.SIGTERM))  # in torchrun, before exec
    try:
        code = proc.wait()
    except BaseException:
        proc.terminate()  # torchrun passes it on to its processes
        proc.wait()
        raise
    if code != 0:
        raise StageError(f"qad: the torchrun processes failed (exit code {code}); the failing one's error is above")


def submit_nodes(params: Params, out_root: Path, cluster) -> None:
    """Run this process's own `qad-pipeline stage qad` command on `qad.num_nodes` nodes as a Kubeflow
    TrainJob (`qad_pipeline.training.trainjob`) and wait for it."""
    from qad_pipeline.platform.runlock import LOCK_NAME
    from qad_pipeline.training.trainjob import run_trainjob, trainjob_manifest

    token = json.loads((Path(out_root) / LOCK_NAME).read_text())["token"]  # the lock this stage holds for its run
    command = ["qad-pipeline", *sys.argv[1:], *pinned(params)]
    run_trainjob(trainjob_manifest(params, command, str(Path(out_root).resolve()), token, cluster),
                 log=lambda line: print(line, flush=True))


def pinned(params: Params) -> list[str]:
    """`--set` options that pin QAD's settled GPUs and batches: the processes this one starts (torchrun's,
    a TrainJob's) use this process's choice instead of settling `auto` again with less memory free."""
    q = params.qad
    return [arg for key in ("num_gpus", "batch_size", "grad_accum") for arg in ("--set", f"qad.{key}={getattr(q, key)}")]


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
    if size != params.qad.processes:
        raise ConfigError(f"qad.num_gpus x qad.num_nodes = {params.qad.processes} but this process is one of {size} "
                          "(WORLD_SIZE)")
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


def _empty_model(params: Params, folder: Path | None, dtype: torch.dtype):
    """The model's modules with no storage (meta tensors): the teacher's class from its config, or the
    student's with its quantizers restored from `folder`'s Model Optimizer state, as `load_model` would."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from qad_pipeline.core.modeling import load_config

    remote = params.base_model.trust_remote_code
    config = load_config(params.base_model) if folder is None else AutoConfig.from_pretrained(
        folder, trust_remote_code=remote)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, trust_remote_code=remote)
    if folder is not None:
        import modelopt.torch.opt as mto

        state = torch.load(Path(folder) / "modelopt_state.pth", weights_only=False)  # Model Optimizer's own file
        model = mto.restore_from_modelopt_state(model, state)
    model.config.use_cache = False
    return model


def _shard(model, world: World, offload: bool) -> None:
    """FSDP2 on each decoder block (transformers' own block classes) and on the whole model."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard

    mesh = init_device_mesh(world.device.type, (world.size,))
    policy = CPUOffloadPolicy(pin_memory=world.device.type == "cuda") if offload else OffloadPolicy()
    blocks = set(model._no_split_modules or [])
    for module in model.modules():
        if type(module).__name__ in blocks:
            fully_shard(module, mesh=mesh, offload_policy=policy)
    fully_shard(model, mesh=mesh, offload_policy=policy)  # embeddings, final norm, LM head


def _learning(model, folder: Path | None, q):
    """The student (`folder` set) with its NVFP4 block scales learnable where `qad.learn_scales` says so."""
    if folder is not None:
        learned_scales.enable(model, q.learn_scales)
    return model


def load_spread(params: Params, world: World, folder: Path | None = None, dtype: torch.dtype | None = None):
    """The teacher (`folder` None) or the student saved in `folder`, on this process, spread over the
    processes as `qad.sharding` says.

    One process, or ddp: each process loads the whole model onto its device (ddp replicates the
    student: DistributedDataParallel). fsdp: no process holds a whole copy on its device. The first
    process reads the checkpoint into host memory, the others build the same modules without storage
    (meta tensors); every process shards its copy (FSDP2), takes storage for its shards only (on the
    host with `qad.offload`) and receives them from the first, tensor by tensor
    (`set_model_state_dict`, `broadcast_from_rank0`); buffers outside the state dict (rotary
    frequencies) are broadcast after them.
    """
    from torch.distributed.checkpoint.state_dict import set_model_state_dict

    q = params.qad
    dtype = dtype or DTYPES[params.base_model.dtype]
    if world.size == 1 or q.sharding == "ddp":
        hardware = params.hardware if world.size == 1 else params.hardware.model_copy(update={"device_map": "single"})
        model = _learning(load_model(params.base_model, hardware, folder=folder, dtype=dtype), folder, q)
        if world.size > 1 and folder is not None:  # the student: replicated, gradients all-reduced
            from torch.nn.parallel import DistributedDataParallel

            device = input_device(model)
            model = DistributedDataParallel(model, device_ids=[device] if device.type == "cuda" else None)
        return model
    full, extra = {}, {}
    if world.rank == 0:
        on_host = params.hardware.model_copy(update={"device": "cpu", "device_map": "single"})
        model = _learning(load_model(params.base_model, on_host, folder=folder, dtype=dtype), folder, q)
        full = model.state_dict()
        extra = {name: b for name, b in model.named_buffers() if name not in full}
    else:
        model = _learning(_empty_model(params, folder, dtype), folder, q)  # the same parameters, without storage
    _shard(model, world, q.offload)
    model.to_empty(device="cpu" if q.offload else world.device)
    for module in model.modules():  # buffers are not sharded: they live where the computation runs
        for name, buffer in module._buffers.items():
            if buffer is not None:
                module._buffers[name] = buffer.to(world.device)
    set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    for name in sorted(world.from_rank0(list(extra))):
        buffer = model.get_buffer(name)
        if world.rank == 0:
            buffer.copy_(extra[name])
        dist.broadcast(buffer, src=0)
    return model.eval()


def held_bytes(model) -> int:
    """Bytes of parameters and buffers this process holds of `model` (its shards, under FSDP2)."""
    tensors = [*model.parameters(), *model.buffers()]
    return sum((t.to_local() if hasattr(t, "to_local") else t).untyped_storage().nbytes() for t in tensors)


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
        student = _learning(student, student_dir, params.qad)
        student.load_state_dict(full)
    if world.rank != 0:
        return None
    student = getattr(student, "module", student)  # DDP wraps it
    learned_scales.fold(student)  # learned block scales back into plain static quantizers, as the export reads them
    return student.to(DTYPES[params.base_model.dtype]).eval()
