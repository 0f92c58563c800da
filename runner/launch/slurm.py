"""SLURM as the submitting process sees it: what a partition's nodes have (sinfo), the queue's
states and pending reasons (squeue), the states accounting records (sacct). One command per
question; a command that fails is an answer (SlurmError, or None), never something to wait on."""

from __future__ import annotations

import re
import subprocess
from dataclasses import dataclass

from runner.errors import UserError

# States a job leaves the queue in. A requeued job goes back to PENDING: it has not ended.
ENDED = {
    "BOOT_FAIL",
    "CANCELLED",
    "COMPLETED",
    "DEADLINE",
    "FAILED",
    "NODE_FAIL",
    "OUT_OF_MEMORY",
    "PREEMPTED",
    "TIMEOUT",
}


class SlurmError(Exception):
    """A SLURM command failed or is missing: its message is one line that says which and why."""


def _run(*args: str) -> str:
    try:
        proc = subprocess.run(args, capture_output=True, text=True, timeout=60)
    except FileNotFoundError:
        raise SlurmError(f"{args[0]} is not installed here (not a SLURM login node?)") from None
    except subprocess.TimeoutExpired:
        raise SlurmError(f"{args[0]} did not answer in 60 s") from None
    if proc.returncode:
        said = (proc.stderr or proc.stdout).strip().splitlines()
        raise SlurmError(f"{args[0]} failed: {said[-1] if said else f'exit {proc.returncode}'}")
    return proc.stdout


@dataclass(frozen=True)
class Node:
    name: str
    cpus: int
    memory_mb: int
    gpus: int


def _gpus(gres: str) -> int:
    """The GPUs of a node's gres (`gpu:8`, `gpu:a100:4(S:0-1)`, `gpu:2,shard:4`; `(null)`)."""
    return sum(int(m.group(1)) for m in re.finditer(r"(?:^|,)gpu(?::[^:,(]+)?:(\d+)", gres.strip()))


def partition_nodes(partition: str | None) -> tuple[str, list[Node]]:
    """The partition's name (None: the cluster's default) and its nodes. Raises SlurmError, or
    UserError where there is no such partition."""
    out = _run("sinfo", "-h", "-N", "-o", "%P|%N|%c|%m|%G")
    nodes: dict[str, list[Node]] = {}
    default = None
    for line in out.splitlines():
        name, node, cpus, memory, gres = line.strip().split("|")
        if name.endswith("*"):
            name = default = name[:-1]
        memory_mb = int(memory.rstrip("+")) if memory.rstrip("+").isdigit() else 0
        nodes.setdefault(name, []).append(Node(node, int(cpus.rstrip("+")), memory_mb, _gpus(gres)))
    name = partition or default
    if name not in nodes:
        asked = (
            f"hydra.launcher.partition={partition} is not a partition of this cluster"
            if partition
            else "hydra.launcher.partition is not set and this cluster has no default partition"
        )
        raise UserError(
            f"{asked}: set it to one of {', '.join(sorted(nodes)) or '(none: sinfo lists none)'}"
        )
    return name, nodes[name]


# slurmctld looks at time limits this often, and sends a job's warning signal at the first look
# that finds it within signal_delay_s of its end: up to this much early.
TIME_LIMIT_LOOK_S = 30
STARTUP_LEAD_S = 60  # what a job's start (Python, torch, the model, the data) is given


def early_signal(params: dict) -> str | None:
    """A warning where the time-limit signal (`--signal=USR2@signal_delay_s`) may come while a
    job is still starting, before any handler can catch it: the job then dies of it, FAILED."""
    limit_s = (params.get("timeout_min") or 0) * 60
    delay_s = params.get("signal_delay_s") or 0
    lead_s = limit_s - delay_s - TIME_LIMIT_LOOK_S
    if not (limit_s and delay_s) or lead_s >= STARTUP_LEAD_S:
        return None
    return (
        f"warning: hydra.launcher.timeout_min={params.get('timeout_min')} with "
        f"signal_delay_s={delay_s}: SLURM looks at time limits every {TIME_LIMIT_LOOK_S} s, so "
        f"its SIGUSR2 may come {max(lead_s, 0)} s after a job starts, before the job can catch "
        f"it (it then ends FAILED); leave timeout_min×60 ≥ signal_delay_s + "
        f"{TIME_LIMIT_LOOK_S + STARTUP_LEAD_S}"
    )


def check_request(params: dict) -> None:
    """The launcher's request (hydra.launcher.*) against the partition's nodes: a request no node
    can meet would pend for ever (PartitionConfig, Resources). Raises UserError naming the key,
    its value and what the partition has; SlurmError where sinfo does not answer."""
    partition, nodes = partition_nodes(params.get("partition"))
    tasks = params.get("tasks_per_node") or 1
    cpus = tasks * (params.get("cpus_per_task") or 1)
    mem_gb = params.get("mem_gb") or 0  # 0 or unset: SLURM's default, or all of a node's memory
    gpus = params.get("gpus_per_node") or 0
    most = Node(
        "",
        max(n.cpus for n in nodes),
        max(n.memory_mb for n in nodes),
        max(n.gpus for n in nodes),
    )

    def refuse(asked: str, has: str, hint: str) -> UserError:
        return UserError(f"{asked} is more than partition {partition}'s nodes have ({has}): {hint}")

    if cpus > most.cpus:
        fits = most.cpus // tasks
        raise refuse(
            f"hydra.launcher.cpus_per_task={params.get('cpus_per_task')}"
            + (f" × tasks_per_node={tasks} = {cpus} CPUs per node" if tasks > 1 else ""),
            f"at most {most.cpus} CPUs each",
            f"set hydra.launcher.cpus_per_task={fits} or less"
            if fits
            else f"set hydra.launcher.tasks_per_node={most.cpus} or less",
        )
    if mem_gb * 1024 > most.memory_mb:
        raise refuse(
            f"hydra.launcher.mem_gb={mem_gb}",
            f"at most {most.memory_mb} MB each",
            f"set hydra.launcher.mem_gb={most.memory_mb // 1024} or less "
            "(0: all of a node's memory)",
        )
    if gpus > most.gpus:
        raise refuse(
            f"hydra.launcher.gpus_per_node={gpus}",
            f"at most {most.gpus} GPUs each" if most.gpus else "no GPU",
            f"set hydra.launcher.gpus_per_node={most.gpus} or less"
            if most.gpus
            else "set hydra.launcher.gpus_per_node=0 to train on their CPUs (trainer.device=auto)",
        )
    fit = [n for n in nodes if n.cpus >= cpus and n.memory_mb >= mem_gb * 1024 and n.gpus >= gpus]
    wanted = params.get("nodes") or 1
    if len(fit) < wanted:
        raise UserError(
            f"hydra.launcher.nodes={wanted} is more than partition {partition} has ({len(fit)} "
            f"with {cpus} CPUs, {mem_gb} GB and {gpus} GPUs): set hydra.launcher.nodes={len(fit)} "
            "or less, or ask less of each node"
        )


def accounting() -> str | None:
    """None where accounting answers (sacct); else why not, in one line."""
    try:
        _run("sacct", "-n", "-X", "-S", "now-1minutes", "-o", "JobID")
    except SlurmError as e:
        return str(e)
    return None


def queue(job_ids: list[str]) -> dict[str, tuple[str, str]]:
    """The jobs the controller still holds: job id → (state, reason), one per array task. A job
    it has forgotten (some time after it ended) is absent. Raises SlurmError."""
    try:
        out = _run("squeue", "-h", "-r", "--states=all", "-j", ",".join(job_ids), "-o", "%i|%T|%r")
    except SlurmError as e:
        if "Invalid job id" in str(e):  # every one of them forgotten
            return {}
        raise
    held = {}
    for line in out.splitlines():
        job, state, reason = line.strip().split("|", 2)
        held[job] = (state, reason)
    return held


def states(job_ids: list[str]) -> dict[str, str]:
    """The state accounting records for each job (CANCELLED, FAILED, TIMEOUT, ...); {} where
    sacct does not answer."""
    try:
        out = _run("sacct", "-n", "-X", "-P", "-j", ",".join(job_ids), "-o", "JobID,State")
    except SlurmError:
        return {}
    found = {}
    for line in out.splitlines():
        job, _, state = line.strip().partition("|")
        if job in job_ids and state:
            found[job] = state.split()[0]  # "CANCELLED by 0"
    return found
