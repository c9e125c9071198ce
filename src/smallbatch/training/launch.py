"""How a cell's processes are launched and placed, without torch: the launcher's view of this
process (:func:`launch_from_env`: torchrun's or srun's variables), the command that starts a
cell's processes (:func:`launch_command`, which the workflow's pretrain rule prefixes its
arguments with) and the GPU a one-process cell takes on a shared node (:func:`claim_gpu`).

Snakemake imports :func:`launch_command` while it plans a study, so this module imports no
torch (2-3 s of every Snakemake start); :mod:`.distributed` builds the process group on it.
"""

from __future__ import annotations

import fcntl
import os
import re
import shlex
import sys
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["Launch", "launch_from_env", "launch_command", "claim_gpu", "first_host"]


@dataclass(frozen=True)
class Launch:
    """This process's place in a launch, as its launcher's environment states it."""

    launcher: str  # "torchrun" | "srun" | "none"
    rank: int
    size: int
    local_rank: int
    master_addr: str
    master_port: int


def first_host(nodelist: str) -> str:
    """The first host of a SLURM hostlist expression (what ``scontrol show hostnames``
    prints first): ``'gpu[03-05,07],cpu1'`` -> ``'gpu03'``, ``'n1,n2'`` -> ``'n1'``."""
    depth, end = 0, len(nodelist)
    for i, ch in enumerate(nodelist):
        depth += (ch == "[") - (ch == "]")
        if ch == "," and depth == 0:
            end = i
            break
    host = re.sub(r"\[([^\]]*)\]", lambda m: re.split(r"[,-]", m.group(1))[0], nodelist[:end].strip())
    if not host:
        raise ValueError(f"no host in SLURM node list {nodelist!r}")
    return host


def _slurm_master(env: Mapping[str, str]) -> tuple[str, int]:
    """Rank 0's address and a port all tasks agree on, for a job launched by srun.

    Address: ``MASTER_ADDR`` if set, else the step's (or job's) first node, where srun
    places task 0, else ``SLURM_LAUNCH_NODE_IPADDR`` (the node srun ran on).  Port:
    ``MASTER_PORT`` if set, else 10000 + (job id, step id) mod 20000 (below Linux's
    ephemeral range; two jobs on one node rarely collide, two steps of one job never)."""
    addr = env.get("MASTER_ADDR")
    if not addr:
        nodes = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
        addr = first_host(nodes) if nodes else env.get("SLURM_LAUNCH_NODE_IPADDR", "127.0.0.1")
    port = env.get("MASTER_PORT")
    if port:
        return addr, int(port)
    job, step = int(env.get("SLURM_JOB_ID", "0")), int(env.get("SLURM_STEP_ID", "0") or 0)
    return addr, 10000 + (job * 64 + step) % 20000


def launch_from_env(env: Mapping[str, str] | None = None) -> Launch:
    """Read rank, size, local rank and rank 0's address from the launcher's variables.

    * torchrun (and any launcher that follows its convention): ``RANK``, ``WORLD_SIZE``,
      ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``; these win when present (e.g.
      ``srun torchrun ...``).
    * SLURM's srun: ``SLURM_PROCID``, ``SLURM_NTASKS`` (``SLURM_STEP_NUM_TASKS`` when set:
      the step's own count), ``SLURM_LOCALID``; address and port by :func:`_slurm_master`.
      One task (e.g. a Snakemake job run by sbatch) is size 1.
    * neither: size 1.
    """
    env = os.environ if env is None else env
    if "RANK" in env and "WORLD_SIZE" in env:
        return Launch(
            "torchrun",
            int(env["RANK"]),
            int(env["WORLD_SIZE"]),
            int(env.get("LOCAL_RANK", "0")),
            env.get("MASTER_ADDR", "127.0.0.1"),
            int(env.get("MASTER_PORT", "29500")),
        )
    ntasks = env.get("SLURM_STEP_NUM_TASKS") or env.get("SLURM_NTASKS")
    if "SLURM_PROCID" in env and ntasks and int(ntasks) > 1:
        addr, port = _slurm_master(env)
        return Launch("srun", int(env["SLURM_PROCID"]), int(ntasks), int(env.get("SLURM_LOCALID", "0")), addr, port)
    return Launch("none", 0, 1, 0, "127.0.0.1", 0)


def launch_command(processes: int, env: Mapping[str, str] | None = None) -> str:
    """The command that runs ``smallbatch`` as ``processes`` data-parallel processes of one
    cell (the workflow's pretrain rule prefixes its arguments with it): ``smallbatch``
    itself for one; inside a SLURM allocation ``srun`` with that many tasks (rank 0's
    address and port from :func:`launch_from_env`); elsewhere torchrun on this node."""
    env = os.environ if env is None else env
    if processes == 1:
        return "smallbatch"
    if env.get("SLURM_JOB_ID"):
        return f"srun --ntasks={processes} --kill-on-bad-exit=1 smallbatch"
    return (
        f"{shlex.quote(sys.executable)} -m torch.distributed.run --standalone "
        f"--nproc-per-node={processes} -m smallbatch"
    )


_SLOT: dict[str, int] = {}  # the GPU slot this process holds (its file descriptor), for the life of the process


def claim_gpu(count: int, slots_dir: str | None = None, max_slots: int = 256) -> int:
    """A GPU index for a one-process cell on a node that shows ``count`` GPUs, so the cells
    that share a node spread over its GPUs: slot ``j`` of GPU ``i`` is a file whose
    ``flock`` this process holds until it exits (the kernel drops it however it ends);
    slots are taken in the order (slot 0 of every GPU, then slot 1, ...), so k processes
    per GPU fill the GPUs evenly.  How many run at once is Snakemake's business (its
    ``gpu_permille`` resource); this only says which GPU each one uses."""
    if count <= 1:
        return 0
    if "gpu" in _SLOT:
        return _SLOT["gpu"]
    root = slots_dir or os.environ.get("SMALLBATCH_GPU_SLOTS") or f"/tmp/smallbatch-gpu-slots-{os.getuid()}"
    os.makedirs(root, exist_ok=True)
    for j in range(max_slots):
        for i in range(count):
            fd = os.open(os.path.join(root, f"gpu{i}.slot{j}"), os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                os.close(fd)
                continue
            _SLOT.update(gpu=i, fd=fd)
            return i
    raise RuntimeError(f"all {max_slots} slots of the {count} GPUs are taken ({root})")
