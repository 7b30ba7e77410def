"""Everything a run decides before a process group exists: the checked options (and what the
loader adjusted), its inputs, and which checkpoint it starts from.

Why apart from pretrain_gpt.py: `run.sh` runs these checks once per node before torchrun
starts any rank (`python -m megazpp.training.startup --world-size N ... --handoff FILE ARGS`),
so a refused input is one line per job instead of one error and a launcher traceback per rank.

Checked once, truly: the check writes what it decided (the `Startup`) with the arguments and
world size it was decided for into FILE, and `run.sh` hands FILE's path to its ranks in
`HANDOFF_ENV`; a rank whose arguments and world size match takes that decision as it is
(`read_handoff`: unpickled, so no constructor and no check runs again), and only a restarted
attempt decides its load plan again (`replan`: torchrun restarts resume from the newest
checkpoint). A rank started without a handoff (a test, a direct `python pretrain_gpt.py`)
runs `prepare` itself. The file is pickle because the options hold parsed strategies and
frozen sections that a text format would rebuild through their checking constructors; it is
written by the same job on the same node just before its ranks read it, never taken from
elsewhere.

What it starts from (resume, import, frozen base) is `checkpoint.manager.plan_load`'s decision,
made here so that a refusal is one line per job.
"""

from __future__ import annotations

import argparse
import dataclasses
import errno
import os
import pickle
import sys
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from megazpp import faults
from megazpp.checkpoint.lock import check_save_lock
from megazpp.checkpoint.manager import LoadPlan, plan_load
from megazpp.config.checks import check_config, islands_of
from megazpp.config.load import load_config
from megazpp.config.options import RunOptions
from megazpp.config.schema import Config
from megazpp.data.options import DataOptions
from megazpp.data.tokenizer_record import check_tokenizer_records
from megazpp.errors import ConfigError
from megazpp.launch.lighthouse import check_reachable
from megazpp.parallel.device import resolve_backend, visible_gpus
from megazpp.parallel.topology import dp_groups
from megazpp.training.memory_check import check_memory
from megazpp.zero.strategy import PlannerChoice


@dataclass
class Startup:
    """The run's checked options and how the run starts."""

    options: RunOptions  # every section checked and resolved, once (config.checks.check_config)
    load: LoadPlan  # what the run starts from and why (checkpoint.manager.plan_load)
    notes: list[str] = field(default_factory=list)  # values the loader adjusted
    backend: str = "gloo"  # the process group's backend (megazpp.parallel.device)

    @property
    def cfg(self) -> Config:
        """The checked config (the global batch and warmup resolved), never the loader's."""
        return self.options.config


def torchrun_restart_count() -> int:
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)


def check_inputs(data: DataOptions) -> list[str]:
    """Refuse missing data settings, and data made by another tokenizer than --tokenizer-model
    (unless --allow-tokenizer-mismatch); notes for what could not be checked."""
    if not data.blend:
        raise ConfigError(
            "data.data_path is empty: give --data-path PREFIX (a preprocessed "
            "'..._text_document' prefix) or set it in the config file"
        )
    if not data.tokenizer_model:
        raise ConfigError("data.tokenizer_model is not set: give --tokenizer-model FILE.model")
    return check_tokenizer_records(data.prefixes, data.tokenizer_model, data.allow_tokenizer_mismatch)


def check_output_dir(flag: str, path: str) -> None:
    """Refuse a directory path that names a file, or lies under one, or that this job cannot
    write (a read-only mount; no permission): the run would fail when it first writes there
    (the TensorBoard writer at start, with a raw OSError per rank; the save directory's probe
    once every rank started; a save possibly after the whole run). Nothing is created here."""
    target = Path(path)
    for ancestor in (target, *target.parents):
        if ancestor.exists():
            if ancestor.is_dir():
                if not os.access(ancestor, os.W_OK | os.X_OK):
                    read_only = bool(os.statvfs(ancestor).f_flag & os.ST_RDONLY)
                    why = os.strerror(errno.EROFS if read_only else errno.EACCES)
                    raise ConfigError(
                        f"{flag} {path} is not writable: cannot write in {ancestor} ({why}): give a directory "
                        "this job can write"
                    )
                return
            where = "" if ancestor == target else f" lies under {ancestor}, which"
            raise ConfigError(
                f"{flag} {path}{where} exists and is not a directory: give a directory (it is created when missing)"
            )


def check_planner_settings(cfg: Config, options: RunOptions, world_size: int, ranks_on_node: int) -> None:
    """`zero.paro_strategy: auto` prices the run on its links: every planner setting it would
    miss, named in one line (the ranks found them one per attempt)."""
    if not isinstance(options.zero.strategy, PlannerChoice):
        return
    per_node = cfg.parallel.ranks_per_node or ranks_on_node
    islands = islands_of(cfg, world_size, ranks_on_node)
    groups = dp_groups(world_size, cfg.tp, cfg.pp, islands)
    on_one_node = max(max(Counter(r // per_node for r in group).values()) for group in groups)
    missing = cfg.planner.missing(
        device_memory=visible_gpus() > 0,
        intra=on_one_node > 1 or cfg.tp > 1,
        inter=islands > 1 or world_size > per_node,
    )
    if missing:
        probe = missing != ["planner.accelerator_memory_gib"] and not cfg.planner.probe
        raise ConfigError(
            f"zero.paro_strategy = auto prices the strategies on this machine's numbers: set {', '.join(missing)}"
            + (" (or planner.probe = true to measure all but the memory)" if probe else "")
        )


def check_outputs(cfg: Config) -> None:
    for flag, path in (("--save", cfg.checkpoint.save), ("--tensorboard-dir", cfg.logging.tensorboard_dir)):
        if path:
            check_output_dir(flag, path)


def prepare(
    argv: Sequence[str], world_size: int, restarts: int = 0, ranks_on_node: int | None = None, check_lock: bool = False
) -> Startup:
    """Load and validate the config for `world_size` ranks (the model's tp x pp split
    included), choose the backend for this node's GPUs, check inputs, output paths and fault
    specs, choose the checkpoint and check that it can start this run (`resume_check`) and the
    frozen base an adapters-only one needs; with `ranks_on_node` (the job's check, not each
    rank's) the estimated memory per rank against the free memory of this node; with
    `check_lock` (node 0's check) that no other job writes `--save` and that an elastic island's
    lighthouse answers; a MegazppError before any
    work otherwise. A rank's own call takes its node's rank count from LOCAL_WORLD_SIZE."""
    notes: list[str] = []
    on_node = ranks_on_node if ranks_on_node is not None else int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    # every section checked and resolved here and nowhere after: see config.checks
    options = check_config(load_config(list(argv), notes), world_size, on_node)
    cfg = options.config
    check_planner_settings(cfg, options, world_size, on_node)
    backend = resolve_backend(cfg.parallel.distributed_backend, on_node, visible_gpus())
    notes += check_inputs(options.data)
    check_outputs(cfg)
    if check_lock and cfg.checkpoint.save:  # first: another job's checkpoints explain the rest
        check_save_lock(cfg.checkpoint.save)
    if check_lock and options.outer is not None and options.outer.elastic:  # an island's job, once
        check_reachable(options.outer.lighthouse)
    faults.check_spec()
    load = plan_load(cfg, world_size, restarts, on_node)
    if ranks_on_node is not None:
        check_memory(options, ranks_on_node)
    return Startup(options, load, notes, backend)


HANDOFF_ENV = "MEGAZPP_CHECKED_RUN"  # the path of the job check's decision, set by run.sh for its ranks


@dataclass(frozen=True)
class Handoff:
    """A job check's decision and what it was decided for."""

    argv: tuple[str, ...]
    world_size: int
    start: Startup


def write_handoff(path: str, argv: Sequence[str], world_size: int, start: Startup) -> None:
    """Write the check's decision for `argv` on `world_size` ranks, atomically (renamed into place)."""
    target = Path(path)
    tmp = target.with_name(target.name + ".tmp")
    tmp.write_bytes(pickle.dumps(Handoff(tuple(argv), world_size, start)))
    tmp.replace(target)


def read_handoff(argv: Sequence[str], world_size: int) -> Startup | None:
    """The job check's decision when the launcher handed one (`HANDOFF_ENV`), else None;
    ConfigError when it was made for other arguments or another world size (a variable left
    in the environment by another job), or cannot be read."""
    path = os.environ.get(HANDOFF_ENV)
    if not path:
        return None
    try:
        handed = pickle.loads(Path(path).read_bytes())
    except (OSError, pickle.UnpicklingError, EOFError, AttributeError) as err:
        raise ConfigError(f"{HANDOFF_ENV}={path}: the job check's file cannot be read ({err})") from None
    if not isinstance(handed, Handoff):
        raise ConfigError(f"{HANDOFF_ENV}={path}: not a job check's file")
    if handed.argv != tuple(argv) or handed.world_size != world_size:
        raise ConfigError(
            f"{HANDOFF_ENV}={path} was checked for {handed.world_size} rank(s) and other arguments than this "
            f"rank's ({world_size} rank(s)): unset {HANDOFF_ENV} to check this run here"
        )
    return handed.start


def replan(start: Startup, world_size: int, restarts: int, ranks_on_node: int) -> Startup:
    """A handed decision for a restarted attempt: the load plan decided again (the attempt
    resumes from the newest checkpoint) for `ranks_on_node` ranks per node (a two-level
    checkpoint's islands are whole nodes: without it a restarted multi-node job counted one
    island and refused its own checkpoint), the checked options kept."""
    if not restarts:
        return start
    return dataclasses.replace(start, load=plan_load(start.cfg, world_size, restarts, ranks_on_node))


def main(argv: Sequence[str] | None = None) -> int:
    """run.sh's check, once per node before torchrun starts any rank: `--world-size N
    --ranks-on-node R --node-rank K [--handoff FILE]` then pretrain_gpt.py's arguments; silent
    when fine. Node 0 also checks that no other job writes the `--save` directory (its rank 0
    then takes the lock: `checkpoint.lock`). With `--handoff`, the decision is written to FILE for
    the ranks (`read_handoff`)."""
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument("--ranks-on-node", type=int, required=True)
    parser.add_argument("--node-rank", type=int, required=True)
    parser.add_argument("--handoff")
    known, rest = parser.parse_known_args(list(sys.argv[1:] if argv is None else argv))
    if known.world_size < 1 or known.ranks_on_node < 1 or known.node_rank < 0:
        raise ConfigError(
            f"--world-size {known.world_size} --ranks-on-node {known.ranks_on_node} "
            f"--node-rank {known.node_rank}: expected sizes >= 1 and a rank >= 0"
        )
    start = prepare(rest, known.world_size, ranks_on_node=known.ranks_on_node, check_lock=known.node_rank == 0)
    if known.handoff:
        write_handoff(known.handoff, rest, known.world_size, start)
    return 0


if __name__ == "__main__":
    from megazpp.cli import run_tool
    from megazpp.training import startup  # this module by its name: the handoff pickles its classes

    run_tool(startup.main, prog="pretrain_gpt.py")
