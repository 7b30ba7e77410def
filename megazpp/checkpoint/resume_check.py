"""Whether the checkpoint a run starts from can start it, decided from its `metadata.json`
before any rank exists.

Why here and not in the loader: the loader (`load.load_checkpoint`, `reshard.py`)
refuses the same mismatches, but only once every rank has started, so a user read one error
per rank and a launcher's failure block, and an architecture change surfaced as torch's raw
`Error(s) in loading state_dict` with the key list. The checkpoint records the layout it was
saved under, its model config and (for a run's checkpoints) the run's whole resolved config,
which is enough to name what differs and the way to convert, in one line per job.

What a checkpoint can start:
  - the same tensor- and pipeline-parallel sizes only (resharding cuts the data-parallel state
    of one (tp, pp) part; a new tp / pp split goes through an export and an import);
  - a model whose tensors have the same names and shapes (LoRA adapters aside: a fine-tune
    adds them to imported weights);
  - a run's checkpoint (not an import): the engine kind it was saved by. `reshard.py`
    reassembles ZeRO shards at another data-parallel size or PaRO strategy, but the
    single-replica engine (LocalEngine: one data-parallel rank, no zero stage or strategy)
    neither writes nor reads ZeRO shards; and an adapters-only checkpoint resumes only under
    the layout that saved it (resharding needs the frozen weights it leaves out);
  - a run's checkpoint: the precision whose engine state it holds (fp16's loss scaler;
    LocalEngine's fp32 masters of a 16-bit model; the ZeRO engine keeps fp32 masters in
    every precision, so it resumes fp32 as bf16 and back);
  - a run's checkpoint: the optimizer (`optimizer.name`) whose state it holds (AdamW's moments
    and SGD's momentum buffer are different state; SGD's momentum may change, a buffer missing
    starts from the first gradient as at step 1).
  - a two-level (DiLoCo) run's checkpoint (`_check_two_level`): a two-level run with the same
    islands and data-parallel size (each island's optimizer state and parameters are its
    own), the same `outer.fragments` (the outer state is cut into them), and with an exchange
    in flight the same `outer.quantize` (it is encoded in it); int4 needs int4's error
    buffers; at an iteration at or after this run's `outer.start_iter` (the islands cannot go
    back to synchronous training). Legitimate changes: a synchronous run's checkpoint (or a
    two-level run's before its `outer.start_iter`: `format.is_two_level`) starts two-level
    training (the warm start: the first interval starts at its weights, zero outer momentum),
    or its synchronous phase when saved before this run's `outer.start_iter`; H, the
    outer lr and momentum, overlap and merge-alpha may change; int4 may become bf16 or none,
    and bf16 and none each other, when nothing is in flight.
Anything else (dropout, sequence length, the optimizer's hyper-parameters, ...) a `--load` may change.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from megazpp.checkpoint.format import (
    CONFIG_KEY,
    METADATA_FILE,
    MODEL_CONFIG_KEY,
    WEIGHTS_ONLY_KEY,
    is_two_level,
    latest_checkpoint,
    rank_file_name,
    read_metadata,
)
from megazpp.checkpoint.frozen_base import BASE_KEY
from megazpp.checkpoint.resume_rule import shown
from megazpp.config.checks import islands_of
from megazpp.config.schema import Config
from megazpp.errors import CheckpointError, ConfigError
from megazpp.model.config import ModelConfig
from megazpp.model.gpt import GPTModel
from megazpp.model.lora import is_adapter
from megazpp.outer.diloco import OUTER_STATE_KEY
from megazpp.state import StateDict
from megazpp.unique_keys import JSONObject
from megazpp.zero.options import ZeroOptions


def _tensor_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Name -> shape of the whole (tp 1) model's tensors, adapters left out; built on the meta
    device, so it costs no memory."""
    with torch.device("meta"):
        model = GPTModel(cfg)
    return {k: tuple(v.shape) for k, v in model.state_dict().items() if not is_adapter(k)}


def _model_diff(saved: JSONObject, current: ModelConfig) -> list[str]:
    """`model.key saved -> current` for the model settings that change a tensor's name or
    shape; empty when the checkpoint's weights fit `current`."""
    try:
        old = ModelConfig(**saved)
    except (TypeError, ConfigError):
        return []  # not a model config this version reads: the loader names it
    shapes = _tensor_shapes(current)
    if _tensor_shapes(old) == shapes:
        return []
    new = dataclasses.asdict(current)

    def shapes_differ(key: str) -> bool:
        """Whether the saved value of `key` alone changes a tensor (or makes no valid model)."""
        try:
            return _tensor_shapes(dataclasses.replace(current, **{key: saved[key]})) != shapes
        except ConfigError:
            return True

    keys = [k for k in saved if k in new and saved[k] != new[k]]
    shaping = [k for k in keys if shapes_differ(k)] or keys
    return [f"model.{k} {saved[k]} -> {new[k]}" for k in shaping]


_PRECISION_FLAGS = {"fp32": "neither --bf16 nor --fp16", "bf16": "--bf16", "fp16": "--fp16"}


def _precision(bf16: bool | None, fp16: bool | None) -> str:
    return "bf16" if bf16 else "fp16" if fp16 else "fp32"


def _convert_hint(arch: str, load_dir: str) -> str:
    if arch == "llama":
        return (
            f"convert it: python tools/convert_hf.py export --load {load_dir} --hf-dir HF, then "
            "python tools/convert_hf.py import --hf-dir HF --save NEW --tp T --pp P, and "
            "--load NEW (its weights only: a new optimizer state, from iteration 0)"
        )
    return (
        f"no converter exists for model.arch {arch} (tools/export_checkpoint.py writes its "
        "full weights as one safetensors file)"
    )


def check_resumable(cfg: Config, load_dir: str, world_size: int, ranks_per_node: int | None = None) -> None:
    """Refuse, in one line, a checkpoint in `load_dir` that this run's layout, model or engine
    cannot start from (the module docstring's rules). Silent when there is nothing to read: a
    missing or damaged checkpoint is the loader's to name (or to fall back from).
    `ranks_per_node`: the launcher's, for the run's islands (`config.checks.islands_of`)."""
    try:
        path = latest_checkpoint(load_dir)
        meta = read_metadata(path) if path is not None else None
    except CheckpointError:
        return
    if path is None or meta is None:
        return
    where = f"--load {load_dir}: {path.name}"
    tp, pp = cfg.tp, cfg.pp
    if (meta["tp"], meta["pp"]) != (tp, pp):
        raise CheckpointError(
            f"{where} was saved under tensor-parallel size {meta['tp']}, pipeline size "
            f"{meta['pp']}; this run has {tp} and {pp}. A checkpoint resumes only under its own "
            f"tp and pp (resharding changes the data-parallel size and PaRO strategy only): run "
            f"with --tensor-model-parallel-size {meta['tp']} --pipeline-model-parallel-size "
            f"{meta['pp']}, or " + _convert_hint(cfg.model.arch, load_dir)
        )
    saved_model = meta.get(MODEL_CONFIG_KEY) or (meta.get(CONFIG_KEY) or {}).get("model")
    if isinstance(saved_model, dict):
        diff = _model_diff(saved_model, cfg.model)
        if diff:
            raise CheckpointError(
                f"{where} holds another model ({shown(diff)}): its weights do not fit this one. "
                f"Load it with the model settings it was saved with ({path / METADATA_FILE}), "
                "or start this model from scratch with another --save"
            )
    saved = meta.get(CONFIG_KEY)
    if meta.get(WEIGHTS_ONLY_KEY) or not isinstance(saved, dict):
        return  # an import starts any data-parallel layout; an old run's config is unknown
    _check_two_level(cfg, saved, meta, path, load_dir, world_size, ranks_per_node)
    zero = saved.get("zero", {})
    # the saved run's keys: ZeroOptions' own rule of which engine runs, on the saved values
    was_zero = ZeroOptions(stage=zero.get("stage", 0), paro_strategy=zero.get("paro_strategy")).runs_engine(meta["dp"])
    dp = world_size // (tp * pp)
    now_zero = cfg.zero.runs_engine(dp)
    if was_zero != now_zero:
        engine = {
            True: "the ZeRO engine",
            False: "the single-replica engine (one data-parallel rank, zero stage 0, no paro_strategy)",
        }
        back = (
            f"resume it with {meta['world_size']} rank(s) and its zero settings (stage "
            f"{zero.get('stage', 0)}, paro_strategy {zero.get('paro_strategy')})"
        )
        raise CheckpointError(
            f"{where} was saved by {engine[was_zero]} over {meta['dp']} data-parallel rank(s); "
            f"this run uses {engine[now_zero]} over {dp}, and resharding converts only between "
            f"ZeRO layouts: {back}, or " + _convert_hint(cfg.model.arch, load_dir)
        )
    precision = saved.get("precision", {})
    was, now = (
        _precision(precision.get("bf16"), precision.get("fp16")),
        _precision(cfg.precision.bf16, cfg.precision.fp16),
    )
    # the fp16 loss scaler's state, and LocalEngine's fp32 masters of a 16-bit model, are
    # saved only by runs that have them (`optim.engine_protocol`, `zero.engine_state`)
    if was != now and ("fp16" in (was, now) or not now_zero):
        raise CheckpointError(
            f"{where} was saved in {was}; this run is in {now}, and its engine state (fp32 "
            f"masters, fp16 loss scaler) resumes only under {was}"
            f"{' or, with the ZeRO engine, the other of fp32 / bf16' if was != 'fp16' else ''}: "
            f"run with {_PRECISION_FLAGS[was]}, or " + _convert_hint(cfg.model.arch, load_dir)
        )
    was_optimizer = (saved.get("optimizer") or {}).get("name", "adamw")  # before SGD: AdamW
    if was_optimizer != cfg.optimizer.name:
        raise CheckpointError(
            f"{where} holds {was_optimizer} optimizer state; this run's optimizer.name is "
            f"{cfg.optimizer.name}: resume it with --optimizer {was_optimizer}, or start {cfg.optimizer.name} "
            "from its weights: " + _convert_hint(cfg.model.arch, load_dir)
        )
    if BASE_KEY in meta and meta["dp"] != dp:
        raise CheckpointError(
            f"{where} is adapters-only (--save-adapters-only) and was saved over {meta['dp']} "
            f"data-parallel ranks; this run has {dp}: it resumes only under the layout that "
            "saved it (resharding needs the frozen weights it leaves out)"
        )


def _saved_outer(path: Path) -> StateDict | None:
    """The outer state of the checkpoint's first rank (the schedule, islands and fragments are
    the same on every rank), read mapped: its tensors are not loaded. None when unreadable
    (the loader names a damaged checkpoint)."""
    try:
        state = torch.load(path / rank_file_name(0, 0, 0), map_location="cpu", weights_only=True, mmap=True)
    except (OSError, RuntimeError, ValueError):
        return None
    engine = state.get("engine") if isinstance(state, dict) else None
    outer = engine.get(OUTER_STATE_KEY) if isinstance(engine, dict) else None
    return outer if isinstance(outer, dict) else None


def _check_two_level(
    cfg: Config,
    saved: JSONObject,
    meta: JSONObject,
    path: Path,
    load_dir: str,
    world_size: int,
    ranks_per_node: int | None,
) -> None:
    """The module docstring's two-level rules, before any rank (the loader refused the same
    only once every rank ran: per rank, or as a size mismatch at the first landing)."""
    was = (saved.get("outer") or {}).get("algorithm", "none")
    outer = _saved_outer(path) if is_two_level(meta) else None
    if outer is None:
        # a synchronous run's checkpoint (or a two-level run's before its outer.start_iter): any
        # run starts from it (two-level: the warm start, or the synchronous phase up to start_iter)
        return
    where = f"--load {load_dir}: {path.name}"
    islands, dp = int(outer["islands"]), int(meta["dp"])
    if cfg.outer.algorithm == "none":
        raise CheckpointError(
            f"{where} is a two-level ({was}) checkpoint of {islands} islands, each with its own parameters "
            f"and optimizer state; this run is synchronous (outer.algorithm none): continue it with "
            f"--outer-algorithm {was} and its islands, or start from the islands' averaged parameters: "
            + _convert_hint(cfg.model.arch, load_dir)
        )
    if meta["iteration"] < cfg.outer.start_iter:
        raise CheckpointError(
            f"{where} holds the islands' state at iteration {meta['iteration']}; this run's "
            f"outer.start_iter {cfg.outer.start_iter} would train synchronously until then, and the islands' "
            f"parameters and optimizer states are no one synchronous state: resume it with --outer-start-iter "
            f"at most {meta['iteration']} (0: islands from the start), or start from the islands' averaged "
            "parameters: " + _convert_hint(cfg.model.arch, load_dir)
        )
    now_islands, now_dp = islands_of(cfg, world_size, ranks_per_node), world_size // (cfg.tp * cfg.pp)
    if (islands, dp) != (now_islands, now_dp):
        raise CheckpointError(
            f"{where} was saved by {islands} islands of {dp // islands} data-parallel rank(s); this run "
            f"has {now_islands} of {now_dp // now_islands}: a two-level checkpoint resumes only under the "
            f"islands and data-parallel size that saved it (each island's optimizer state is its own): run "
            f"it on {meta['world_size']} ranks as {islands} islands, or start from the islands' averaged "
            "parameters: " + _convert_hint(cfg.model.arch, load_dir)
        )
    fragments, quantize = len(outer.get("fragments", [])), str(outer.get("quantize", "none"))
    in_flight = len(outer.get("in_flight", []))
    if fragments != cfg.outer.fragments:
        raise CheckpointError(
            f"{where} was saved with outer.fragments {fragments}, this run has {cfg.outer.fragments}: its "
            f"outer state (exchanges in flight, int4 error buffers) is cut into those fragments: resume it "
            f"with --outer-fragments {fragments}"
        )
    if in_flight and quantize != cfg.outer.quantize:
        raise CheckpointError(
            f"{where} holds {in_flight} outer exchange(s) in flight, encoded as {quantize}; this run sends "
            f"{cfg.outer.quantize}: resume it with --outer-quantize {quantize}, and change the wire from a "
            f"checkpoint saved with nothing in flight (outer.overlap_steps 0, or a step no exchange spans)"
        )
    if cfg.outer.quantize == "int4" and quantize != "int4":
        raise CheckpointError(
            f"{where} was saved with outer.quantize {quantize}, without the error buffers int4 carries from "
            f"sync to sync; this run sends int4: resume it with --outer-quantize {quantize} (int4 resumes "
            "only from int4)"
        )
