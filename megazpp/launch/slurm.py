"""The node variables of `run.sh` (NNODES, NODE_RANK, MASTER_ADDR, MASTER_PORT, NPROC_PER_NODE)
from a SLURM job, so `srun --ntasks-per-node=1 bash run.sh` needs nothing set by hand.

Every node of the step computes the same master (the first host of the job's node list) and
the same port (from the job id) without talking to the others. A variable already set in the
environment wins: SLURM only fills in what the user left out.

`python -m megazpp.launch.slurm` prints `export NAME=value` lines for `run.sh` to evaluate (none
outside a SLURM job); a refusal is one line on stderr and exit code 2. Standard library only:
it runs before `run.sh` installs anything.
"""

from __future__ import annotations

import itertools
import os
import re
import shlex
import shutil
import subprocess
import sys
from collections.abc import Mapping

from megazpp.errors import LaunchError

NODE_VARIABLES = ("NNODES", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT", "NPROC_PER_NODE")
# Ports below Linux's ephemeral range (32768+), so an outgoing connection never holds the
# rendezvous port; jobs whose ids differ by a multiple of PORT_SPAN may meet on one master.
PORT_BASE = 10000
PORT_SPAN = 20000

_RANGE = re.compile(r"(\d+)(?:-(\d+))?")


def _split_top_level(nodelist: str) -> list[str]:
    """Split at commas outside brackets: `a[1,3],b` -> [`a[1,3]`, `b`]."""
    items, depth, start = [], 0, 0
    for i, ch in enumerate(nodelist):
        if ch == "[":
            if depth:
                raise LaunchError(f"node list {nodelist!r}: nested '[' at character {i}")
            depth = 1
        elif ch == "]":
            if not depth:
                raise LaunchError(f"node list {nodelist!r}: ']' without '[' at character {i}")
            depth = 0
        elif ch == "," and not depth:
            items.append(nodelist[start:i])
            start = i + 1
    if depth:
        raise LaunchError(f"node list {nodelist!r}: '[' is never closed")
    items.append(nodelist[start:])
    return items


def _expand_group(nodelist: str, group: str) -> list[str]:
    """`01-03,07` -> [`01`, `02`, `03`, `07`]; a range keeps its first number's width."""
    names: list[str] = []
    for entry in group.split(","):
        match = _RANGE.fullmatch(entry)
        if match is None:
            raise LaunchError(
                f"node list {nodelist!r}: '[{group}]' holds {entry!r}, expected N or N-M (decimal numbers)"
            )
        first, last = match.group(1), match.group(2) or match.group(1)
        if int(last) < int(first):
            raise LaunchError(f"node list {nodelist!r}: range {entry!r} runs backwards")
        width = len(first)
        names.extend(str(n).zfill(width) for n in range(int(first), int(last) + 1))
    return names


def expand_nodelist(nodelist: str) -> list[str]:
    """SLURM's compressed host list as `scontrol show hostnames` prints it:
    `node[01-04,07]`, `a[1-2]-ib,login`, `rack[1-2]-n[1-2]` (groups vary rightmost fastest)."""
    if not nodelist.strip():
        raise LaunchError("node list is empty")
    hosts: list[str] = []
    for item in _split_top_level(nodelist.strip()):
        if not item:
            raise LaunchError(f"node list {nodelist!r}: empty host name between commas")
        parts = re.split(r"\[([^\]]*)\]", item)  # literal, group, literal, group, ..., literal
        choices = [[p] if i % 2 == 0 else _expand_group(nodelist, p) for i, p in enumerate(parts)]
        hosts.extend("".join(combo) for combo in itertools.product(*choices))
    return hosts


def job_hosts(nodelist: str) -> list[str]:
    """The job's hosts in SLURM's order: `scontrol show hostnames` where SLURM is installed
    (it knows every syntax the site uses), else `expand_nodelist`."""
    scontrol = shutil.which("scontrol")
    if scontrol is None:
        return expand_nodelist(nodelist)
    out = subprocess.run([scontrol, "show", "hostnames", nodelist], capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise LaunchError(f"'scontrol show hostnames {nodelist}' failed: {out.stderr.strip()}")
    return out.stdout.split()


def _int(env: Mapping[str, str], name: str) -> int:
    value = env[name]
    try:
        number = int(value)
    except ValueError:
        raise LaunchError(f"{name}={value!r} is not a whole number") from None
    if number < 0:
        raise LaunchError(f"{name}={value!r} is negative")
    return number


def _ranks_per_node(env: Mapping[str, str]) -> int | None:
    """GPUs on this node, else tasks per node; None leaves `run.sh`'s own default."""
    for name in ("SLURM_GPUS_ON_NODE", "SLURM_NTASKS_PER_NODE"):
        if env.get(name) and _int(env, name) > 0:
            return _int(env, name)
    return None


def _check_step(env: Mapping[str, str], nnodes: int) -> None:
    """`run.sh` starts torchrun, which starts the ranks: it needs exactly one task on every node."""
    if "SLURM_STEP_NUM_NODES" not in env:
        if nnodes > 1:
            raise LaunchError(
                f"this is the batch script of a {nnodes}-node SLURM job, not a step on every "
                f"node: start run.sh with 'srun --ntasks-per-node=1 bash run.sh'"
            )
        return
    step_nodes, step_tasks = _int(env, "SLURM_STEP_NUM_NODES"), _int(env, "SLURM_STEP_NUM_TASKS")
    if step_nodes != nnodes:
        raise LaunchError(
            f"the srun step runs on {step_nodes} of the job's {nnodes} nodes "
            f"(SLURM_STEP_NUM_NODES={step_nodes}, SLURM_NNODES={nnodes}); run.sh needs a step "
            f"over all of them"
        )
    if step_tasks != step_nodes:
        raise LaunchError(
            f"the srun step starts {step_tasks} tasks on {step_nodes} nodes; run.sh starts every "
            f"rank of its node itself and needs one task per node: "
            f"srun --ntasks-per-node=1 bash run.sh"
        )


def slurm_node_env(env: Mapping[str, str]) -> dict[str, str]:
    """The node variables SLURM determines and `env` does not already set ({} outside a job's
    nodes, e.g. in an `salloc` shell on a login node, which has no SLURM_NODEID)."""
    if "SLURM_JOB_ID" not in env or "SLURM_NODEID" not in env:
        return {}
    if "SLURM_NNODES" not in env:
        raise LaunchError(
            "SLURM_JOB_ID and SLURM_NODEID are set but SLURM_NNODES is not: run.sh reads the job's node count from it"
        )
    nnodes, node_rank = _int(env, "SLURM_NNODES"), _int(env, "SLURM_NODEID")
    if not (env.get("NNODES") and env.get("NODE_RANK")):  # both set by hand: no SLURM layout used
        _check_step(env, nnodes)
    if node_rank >= nnodes:
        raise LaunchError(f"SLURM_NODEID={node_rank} is not below SLURM_NNODES={nnodes}")
    derived = {
        "NNODES": str(nnodes),
        "NODE_RANK": str(node_rank),
        "MASTER_PORT": str(PORT_BASE + _int(env, "SLURM_JOB_ID") % PORT_SPAN),
    }
    nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    if nodelist:
        hosts = job_hosts(nodelist)
        if len(hosts) != nnodes:
            raise LaunchError(f"SLURM_JOB_NODELIST={nodelist!r} names {len(hosts)} hosts but SLURM_NNODES={nnodes}")
        derived["MASTER_ADDR"] = hosts[0]
    elif not env.get("MASTER_ADDR"):
        raise LaunchError(
            "SLURM_JOB_NODELIST is not set and neither is MASTER_ADDR: cannot tell which host is the master"
        )
    nproc = _ranks_per_node(env)
    if nproc is not None:
        derived["NPROC_PER_NODE"] = str(nproc)
    return {k: v for k, v in derived.items() if not env.get(k)}


def main() -> int:
    try:
        exports = slurm_node_env(os.environ)
    except LaunchError as exc:
        print(f"run.sh: error: {exc}", file=sys.stderr)
        return 2
    for name in NODE_VARIABLES:
        if name in exports:
            print(f"export {name}={shlex.quote(exports[name])}")
    if exports:
        shown = " ".join(f"{n}={exports[n]}" for n in NODE_VARIABLES if n in exports)
        print(f"echo {shlex.quote('run.sh: from SLURM: ' + shown)} >&2")
    return 0


if __name__ == "__main__":
    sys.exit(main())
