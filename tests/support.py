"""What several test files share, written once: the tiny models they train, the flags that give
pretrain_gpt.py and run.sh the tiny Llama and its data, and the environment a subprocess of this
checkout runs in. (Fixtures that build data live in conftest.py; this module holds plain values
and functions, so tests and the ranks they spawn import it alike.)"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType

import torch

from megazpp.model.config import ModelConfig
from megazpp.model.gpt import GPTModel
from megazpp.optim.engine_protocol import Engine
from megazpp.zero.zeropp import ZeroPP

ROOT = Path(__file__).resolve().parents[1]

# The engine tests' model: a 2-layer Llama 32 wide with GQA (4 heads, 2 groups), so every
# strategy, bucket and fetch group of the engine is exercised in well under a second a step.
TINY_LLAMA = dict(
    arch="llama",
    num_layers=2,
    hidden_size=32,
    num_attention_heads=4,
    num_query_groups=2,
    vocab_size=96,
    seq_length=8,
    ffn_hidden_size=40,
)

# A Llama that Hugging Face and megazpp both build, sized for the tiny tokenizer (vocabulary 512):
# the LoRA tests import it from Hugging Face's layout and train adapters on it.
HF_SIZED_LLAMA = {
    "arch": "llama",
    "num_layers": 2,
    "hidden_size": 32,
    "num_attention_heads": 4,
    "num_query_groups": 2,
    "ffn_hidden_size": 64,
    "vocab_size": 512,
    "seq_length": 32,
    "rope_theta": 10000.0,
}
TINY_LORA = {**HF_SIZED_LLAMA, "lora_rank": 4, "lora_alpha": 8.0}

# The end-to-end tests' model as pretrain_gpt.py and run.sh take it (seconds per run on CPU):
# 2 layers, 32 wide, GQA 4 / 2, sequences of 32, micro-batches of 2. Each test adds its batch.
TINY_MODEL_FLAGS = [
    "--num-layers",
    "2",
    "--hidden-size",
    "32",
    "--num-attention-heads",
    "4",
    "--num-query-groups",
    "2",
    "--seq-length",
    "32",
    "--micro-batch-size",
    "2",
]

# No evaluation and a log line only every 100 steps: for runs whose console the test does not read.
QUIET_FLAGS = ["--eval-iters", "0", "--log-interval", "100"]


def short_run_flags(steps: int) -> list[str]:
    """A short two-level end-to-end run's schedule: a global batch of 8, lr 1e-2 after one warmup
    step, `steps` steps, no evaluation, quiet logging, seed 5."""
    schedule = "--global-batch-size 8 --lr 1e-2 --lr-warmup-iters 1 --eval-iters 0 --log-interval 100 --seed 5"
    return [*schedule.split(), "--train-iters", str(steps)]


def data_flags(prefix: str | os.PathLike, tokenizer: str | os.PathLike) -> list[str]:
    """The dataset, its tokenizer and the split every end-to-end test trains on."""
    return ["--data-path", str(prefix), "--tokenizer-model", str(tokenizer), "--split", "90,10,0"]


def load_script(path: Path, *, register: bool = False) -> ModuleType:
    """A script of the checkout (a tool, pretrain_gpt.py) loaded as a module named by its file, so a
    test calls its functions in process. `register` enters it in sys.modules first: a dataclass
    defined in the script looks its module up there. As when Python runs the script, its directory
    is first on sys.path while it loads (a tool imports its siblings, e.g. `checkout_path`)."""
    spec = importlib.util.spec_from_file_location(path.stem, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    if register:
        sys.modules[spec.name] = module
    sys.path.insert(0, str(path.parent))
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(path.parent))
    return module


def load_tool(name: str, *, register: bool = False) -> ModuleType:
    """tools/NAME.py as a module (`load_script`)."""
    return load_script(ROOT / "tools" / f"{name}.py", register=register)


def save_tiny_hf_llama(directory: Path, seed: int) -> None:
    """`HF_SIZED_LLAMA` as Hugging Face's LlamaForCausalLM, seeded, saved in its layout (the
    caller's test needs transformers)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=512,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    LlamaForCausalLM(config).save_pretrained(directory)


def write_lora_run(path: Path, model: dict, data_prefix: str, tokenizer: Path, checkpoint: dict, **training) -> Path:
    """The LoRA tests' run as a YAML config at `path`: `model` trained 4 steps of batch 2 at lr
    1e-2 on the data, evaluated and logged too rarely to matter; `checkpoint` and `training`
    add to those sections."""
    import yaml

    config = {
        "model": model,
        "data": {"data_path": [data_prefix], "split": "90,10,0", "tokenizer_model": str(tokenizer)},
        "optimizer": {"lr": 1e-2},
        "training": {
            "micro_batch_size": 2,
            "global_batch_size": 2,
            "train_iters": 4,
            "eval_interval": 1000,
            "eval_iters": 1,
            **training,
        },
        "checkpoint": checkpoint,
        "logging": {"log_interval": 1000},
    }
    path.write_text(yaml.safe_dump(config))
    return path


# Caches Python and the tools keep beside the code; anything else a test adds to the checkout is
# a test writing outside its temporary directory.
CACHE_NAMES = frozenset({".git", "__pycache__", ".pytest_cache", ".mypy_cache", ".ruff_cache", ".hypothesis"})


def tree_entries(root: Path) -> dict[str, frozenset[str]]:
    """Every directory under `root` (caches left out) with the names it holds: cheap enough
    (about a millisecond for the checkout) to take around every test."""
    entries: dict[str, frozenset[str]] = {}
    for directory, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if d not in CACHE_NAMES and not d.endswith(".egg-info")]
        entries[os.path.relpath(directory, root)] = frozenset(files) | frozenset(f"{d}/" for d in dirs)
    return entries


def tree_changes(before: dict[str, frozenset[str]], after: dict[str, frozenset[str]]) -> list[str]:
    """'+ path' for what appeared, '- path' for what went; a new or removed directory once, not
    each of its files."""
    return sorted(
        f"{'+' if name in after[d] else '-'} {name if d == '.' else f'{d}/{name}'}"
        for d in before.keys() & after.keys()
        for name in before[d] ^ after[d]
    )


def free_port() -> int:
    """A loopback port free now (for a job's MASTER_PORT)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def checkout_env(**variables: str) -> dict[str, str]:
    """This process's environment with the checkout first on PYTHONPATH (so a subprocess imports
    this copy of the project, not an installed one), plus `variables`."""
    return {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]),
        **variables,
    }


def run_sh_variables(data_dir: str | os.PathLike, nproc: int, **variables: str) -> dict[str, str]:
    """run.sh's variables for a job of `nproc` ranks on this node: DATA_DIR, this Python, a
    free MASTER_PORT, TMPDIR beside DATA_DIR (run.sh's checked-run file stays in the test's
    temporary directories), plus `variables`."""
    return {
        "DATA_DIR": str(data_dir),
        "TMPDIR": str(Path(data_dir).resolve().parent),
        "NPROC_PER_NODE": str(nproc),
        "PYTHON": sys.executable,
        "MASTER_PORT": str(free_port()),
        **variables,
    }


def paused_at(point: str, file: Path) -> dict[str, str]:
    """The environment variable that stops a subprocess at pause point `point` (megazpp/pause.py;
    `NAME@N` for its N-th arrival) until `file` is removed."""
    return {"MEGAZPP_PAUSE_AT": f"{point}:{file}"}


def wait_until_paused(proc: subprocess.Popen, file: Path, timeout_s: float = 1200) -> None:
    """Return once `proc` has reached its armed pause point (it wrote `file`); fail if it ended
    first. The timeout only bounds a broken run: the process waits at the point for the test."""
    deadline = time.monotonic() + timeout_s
    while not file.exists():
        assert proc.poll() is None, f"exited with {proc.returncode} before reaching its pause point"
        assert time.monotonic() < deadline, f"did not reach its pause point ({file}) in {timeout_s} s"
        time.sleep(0.01)


def zero_keys(zeropp: ZeroPP) -> dict[str, object]:
    """`zeropp` as the `zero` section's keys (each ZeroPP field names its key), so a test that
    shares one ZeroPP between engines builds their `ZeroOptions` from it."""
    return {f.metadata["key"]: getattr(zeropp, f.name) for f in dataclasses.fields(zeropp)}


def state_differences(a: object, b: object, where: str) -> list[str]:
    """Where two saved states differ (tensors bit for bit, with their dtypes): empty when equal."""
    if isinstance(a, torch.Tensor):
        same = isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
        return [] if same else [where]
    if isinstance(a, dict) and isinstance(b, dict):
        if a.keys() != b.keys():
            return [f"{where}: keys {sorted(map(str, a.keys() ^ b.keys()))}"]
        return [d for k in a for d in state_differences(a[k], b[k], f"{where}.{k}")]
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)) and len(a) == len(b):
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in state_differences(x, y, f"{where}[{i}]")]
    return [] if a == b else [where]


def step_batch(cfg: ModelConfig, dp_rank: int, micro: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, labels) of 2 samples for one DP rank's micro-batch of one step, seeded by all three."""
    g = torch.Generator().manual_seed(1000 * step + 100 * micro + dp_rank)
    ids = torch.randint(0, cfg.vocab_size, (2, cfg.seq_length + 1), generator=g)
    return ids[:, :-1], ids[:, 1:]


def train_losses(model: GPTModel, engine: Engine, dp_rank: int, steps: range, micro_batches: int) -> list[float]:
    """Train `steps` steps of this DP rank's `step_batch`es (`micro_batches` accumulated per step)
    through `engine`; its loss at each step."""
    losses = []
    for step in steps:
        total = 0.0
        for micro in range(micro_batches):
            loss = model(*step_batch(model.cfg, dp_rank, micro, step)).mean() / micro_batches
            engine.scale_loss(loss).backward()
            total += loss.item()
        engine.step()
        losses.append(total)
    return losses


def as_from_a_terminal() -> None:
    """`preexec_fn` of a subprocess a test interrupts as Ctrl-C would: SIGINT at its default, as a
    terminal's foreground job has it, whatever this process inherited. A suite started in the
    background by a script (`cmd &`) inherits SIGINT ignored, an ignored signal stays ignored
    across exec (and a shell cannot even trap it then), so the tool would never see the test's
    SIGINT and the test would wait for nothing."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@contextlib.contextmanager
def netlab_nodes(netlab: Callable[..., subprocess.CompletedProcess[str]], count: int = 2) -> Iterator[None]:
    """`count` fresh netlab nodes joined by 1 Gbit/s links, always removed afterwards (asserted);
    `netlab` runs tools/netlab.sh with the test file's own namespace prefix and subnet."""
    netlab("down")
    up = netlab("up", str(count), "1gbit", "0")
    assert up.returncode == 0, up.stderr
    try:
        yield
    finally:
        down = netlab("down")
        assert down.returncode == 0, down.stderr
