"""Hostile input, property-based (hypothesis): every reader of user files either succeeds or
raises one of the project's own errors (MegazppError) with a message; never another exception,
never a hang (each call runs under a SIGALRM deadline). Plus a scan of the code base for
constructs that execute input (eval, exec, shell=True, unsafe yaml/torch loading).

Examples per property are bounded so the whole file stays within a few seconds of CPU."""

from __future__ import annotations

import gzip
import json
import re
import signal
import string
import struct
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from megazpp.config.checks import validate_config
from megazpp.config.deepspeed import map_deepspeed_config, read_deepspeed_config
from megazpp.config.load import load_config
from megazpp.config.schema import SECTIONS, flag_table
from megazpp.data.indexed_dataset import MAGIC, IndexedDataset
from megazpp.errors import MegazppError
from megazpp.interop.hf_llama import model_config_from_hf
from megazpp.interop.safetensors_io import read_json
from megazpp.preprocess.jsonl import SkipReason, extract_text, iter_line_chunks

ROOT = Path(__file__).resolve().parents[1]
DEADLINE_S = 5
FEW = settings(
    max_examples=60,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


class Hang(BaseException):
    """Raised by the alarm; a BaseException so no `except Exception` in the code swallows it."""


def _alarm(_signum: int, _frame: Any) -> None:
    raise Hang(f"no result within {DEADLINE_S} s")


def succeeds_or_refuses(fn: Callable[..., Any], *args: Any) -> Any:
    """fn(*args), or the MegazppError it raised (which must carry a message)."""
    previous = signal.signal(signal.SIGALRM, _alarm)
    signal.setitimer(signal.ITIMER_REAL, DEADLINE_S)
    try:
        return fn(*args)
    except MegazppError as exc:
        assert str(exc).strip(), f"{type(exc).__name__} without a message"
        return exc
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=12)
)
JSON = st.recursive(
    SCALARS,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=8,
)


_SCRATCH = tempfile.TemporaryDirectory(prefix="megazpp_hostile_")  # removed at exit


def _tmp_file(name: str, data: bytes) -> Path:
    directory = Path(tempfile.mkdtemp(dir=_SCRATCH.name))
    path = directory / name
    path.write_bytes(data)
    return path


# -- JSONL ---------------------------------------------------------------------------------


@FEW
@given(
    st.binary(max_size=200) | JSON.map(lambda v: json.dumps(v).encode()),
    st.sampled_from(["text", "raw_content", "body"]),
)
def test_jsonl_lines(line: bytes, key: str) -> None:
    out = succeeds_or_refuses(extract_text, line, key)
    assert isinstance(out, (str, SkipReason))
    if isinstance(out, str):
        assert out.strip()


@FEW
@given(st.binary(max_size=400), st.booleans())
def test_jsonl_files(data: bytes, gz: bool) -> None:
    name = "x.jsonl.gz" if gz else "x.jsonl"
    path = _tmp_file(name, data)
    succeeds_or_refuses(lambda: [line for chunk in iter_line_chunks(path, 64) for line in chunk])
    if not gz:  # a truncated gzip of real content
        path = _tmp_file("y.jsonl.gz", gzip.compress(data)[: max(1, len(data) // 2)])
        succeeds_or_refuses(lambda: [line for chunk in iter_line_chunks(path, 64) for line in chunk])


# -- .idx / .bin -----------------------------------------------------------------------------


@st.composite
def index_files(draw: Any) -> tuple[bytes, int]:
    """A header that is mostly right (so the deeper checks are reached) and a hostile body."""
    magic = draw(st.sampled_from([MAGIC, MAGIC[:-1] + b"\x01", b"\x00" * 9]))
    version = draw(st.sampled_from([1, 1, 2, 2**64 - 1]))
    code = draw(st.sampled_from([4, 8, 1, 0, 9, 255]))
    n_seq = draw(st.integers(0, 5) | st.sampled_from([2**31, 2**63, 2**64 - 1]))
    n_doc = draw(st.integers(0, 6) | st.sampled_from([2**62, 2**64 - 1]))
    header = struct.pack("<9sQBQQ", magic, version, code, n_seq, n_doc)
    if draw(st.booleans()):
        lengths = draw(st.lists(st.integers(-3, 6), min_size=n_seq % 8, max_size=n_seq % 8))
        itemsize = {4: 4, 8: 2, 1: 1}.get(code, 4)
        pointers = np.concatenate([[0], np.cumsum(lengths)[:-1]]) * itemsize if lengths else []
        docs = draw(st.lists(st.integers(-1, 6), min_size=n_doc % 8, max_size=n_doc % 8))
        body = (
            np.asarray(lengths, np.int32).tobytes()
            + np.asarray(pointers, np.int64).tobytes()
            + np.asarray(docs, np.int64).tobytes()
        )
    else:
        body = draw(st.binary(max_size=120))
    cut = draw(st.none() | st.integers(0, 80))
    data = header + body
    return (data if cut is None else data[:cut]), draw(st.integers(0, 64))


@FEW
@given(index_files())
def test_indexed_dataset(case: tuple[bytes, int]) -> None:
    idx, bin_size = case
    path = _tmp_file("d.idx", idx)
    path.with_suffix(".bin").write_bytes(bytes(range(256))[:bin_size] if bin_size else b"")
    ds = succeeds_or_refuses(IndexedDataset, str(path.with_suffix("")))
    if isinstance(ds, IndexedDataset):
        for i in range(min(len(ds), 8)):
            assert len(ds[i]) == int(ds.sequence_lengths[i])


# -- the config loader (YAML + flags) and the DeepSpeed mapper --------------------------------

FIELDS = {section: [f for f in cls.__dataclass_fields__] for section, cls in SECTIONS.items()}
SECTION_NAMES = sorted(SECTIONS) + ["modle", "zero_optimization"]
YAML_TEXT = st.text(alphabet=string.printable, max_size=120)


@st.composite
def config_mappings(draw: Any) -> Any:
    """Mostly real section/field names (so type and consistency checks run) with hostile values."""
    out: dict[Any, Any] = {}
    for section in draw(st.lists(st.sampled_from(SECTION_NAMES), max_size=3, unique=True)):
        keys = FIELDS.get(section, ["x"]) + ["unknown_key"]
        body = draw(
            st.dictionaries(
                st.sampled_from(keys),
                JSON | st.sampled_from(["3e-4", "none", "true", "-1", "1e400", "nan", "0"]),
                max_size=4,
            )
        )
        out[section] = draw(st.sampled_from([body, body, None, [], "text"]))
    return draw(st.sampled_from([out, out, out, [out], "scalar", None]))


def _load_and_validate(argv: list[str], world_size: int) -> Any:
    return validate_config(load_config(argv), world_size)


@FEW
@given(config_mappings() | YAML_TEXT, st.integers(1, 8))
def test_config_file(content: Any, world_size: int) -> None:
    text = content if isinstance(content, str) else yaml.safe_dump(content)
    path = _tmp_file("c.yaml", text.encode())
    succeeds_or_refuses(_load_and_validate, ["--config", str(path)], world_size)


FLAGS = sorted(flag_table())


@FEW
@given(
    st.lists(
        st.sampled_from(FLAGS)
        | st.sampled_from(["--no-bf16", "--bogus", "-x", "--"])
        | st.text(max_size=6)
        | st.sampled_from(["1", "0", "-3", "1e9", "nan", "true"]),
        max_size=8,
    ),
    st.integers(1, 8),
)
def test_config_flags(argv: list[str], world_size: int) -> None:
    if "--tokenizer-model" in argv or "--config" in argv or "--deepspeed_config" in argv:
        return  # files: covered by the file properties
    succeeds_or_refuses(_load_and_validate, argv, world_size)


DS_KEYS = [
    "train_batch_size",
    "train_micro_batch_size_per_gpu",
    "gradient_accumulation_steps",
    "gradient_clipping",
    "steps_per_print",
    "optimizer",
    "fp16",
    "bf16",
    "data_types",
    "tensorboard",
    "zero_optimization",
    "scheduler",
    "activation_checkpointing",
    "unknown",
]
ZERO_KEYS = [
    "stage",
    "reduce_bucket_size",
    "allgather_bucket_size",
    "overlap_comm",
    "zero_quantized_weights",
    "zero_hpz_partition_size",
    "zero_quantized_gradients",
    "zeropp_loco_param",
    "offload_optimizer",
    "stage3_module_granularity_threshold",
]


@st.composite
def deepspeed_configs(draw: Any) -> Any:
    value = JSON | st.dictionaries(
        st.sampled_from(ZERO_KEYS + ["type", "params", "enabled", "lr", "err_beta"]), JSON, max_size=4
    )
    return draw(st.dictionaries(st.sampled_from(DS_KEYS), value, max_size=5) | JSON)


@FEW
@given(deepspeed_configs(), st.integers(1, 8))
def test_deepspeed_config(raw: Any, world_size: int) -> None:
    if isinstance(raw, dict):
        succeeds_or_refuses(map_deepspeed_config, raw, "ds.json")
    path = _tmp_file("ds.json", json.dumps(raw).encode())
    succeeds_or_refuses(read_deepspeed_config, str(path))
    succeeds_or_refuses(_load_and_validate, ["--deepspeed_config", str(path)], world_size)


# -- the Hugging Face converter's config reader -----------------------------------------------

HF_KEYS = [
    "model_type",
    "max_position_embeddings",
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "rms_norm_eps",
    "rope_theta",
    "rope_scaling",
    "rope_parameters",
    "tie_word_embeddings",
    "hidden_act",
    "attention_bias",
    "mlp_bias",
    "attention_dropout",
    "torch_dtype",
    "sliding_window",
]
HF_GOOD = {
    "model_type": "llama",
    "max_position_embeddings": 64,
    "vocab_size": 128,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}


@settings(FEW, max_examples=200)
@given(
    st.dictionaries(st.sampled_from(HF_KEYS), JSON | st.integers(-4, 64), max_size=6),
    st.booleans(),
    st.binary(max_size=40),
)
def test_hf_config(changes: dict[str, Any], start_good: bool, garbage: bytes) -> None:
    hf = {**(HF_GOOD if start_good else {}), **changes}
    path = _tmp_file("config.json", json.dumps(hf).encode())
    read = succeeds_or_refuses(read_json, path)
    assert read == json.loads(path.read_text())
    succeeds_or_refuses(model_config_from_hf, read)
    succeeds_or_refuses(read_json, _tmp_file("config.json", garbage))


def test_hf_config_good_example_builds() -> None:
    assert model_config_from_hf(HF_GOOD).num_query_groups == 2  # the property's base case is valid


# -- code that would execute input -----------------------------------------------------------


def _python_files() -> list[Path]:
    files = [ROOT / "pretrain_gpt.py"]
    for folder in ("megazpp", "kernels", "tools"):
        files += sorted((ROOT / folder).rglob("*.py"))
    return files


def _calls(text: str, name: str) -> list[str]:
    """The full text of each call `name(...)` (balanced parentheses, possibly multi-line)."""
    out = []
    for match in re.finditer(rf"(?<![\w.]){re.escape(name)}\(" if "." not in name else re.escape(name) + r"\(", text):
        depth, i = 0, match.end() - 1
        while i < len(text):
            depth += {"(": 1, ")": -1}.get(text[i], 0)
            if depth == 0:
                break
            i += 1
        out.append(text[match.start() : i + 1])
    return out


def test_no_code_executes_input() -> None:
    offences = []
    files = _python_files()
    assert len(files) > 50
    for path in files:
        text = path.read_text()
        where = path.relative_to(ROOT)
        offences += [f"{where}: {c}" for name in ("eval", "exec") for c in _calls(text, name)]
        offences += [f"{where}: shell=True" for _ in re.finditer(r"shell\s*=\s*True", text)]
        offences += [f"{where}: {c}" for c in _calls(text, "yaml.load") if "SafeLoader" not in c]
        offences += [
            f"{where}: {c}" for c in _calls(text, "torch.load") if not re.search(r"weights_only\s*=\s*True", c)
        ]
    assert offences == []
    # the scan itself finds what it looks for
    assert _calls("x = torch.load(f,\n map_location='cpu')", "torch.load")
    assert _calls("eval(s)", "eval") and not _calls("model.eval()", "eval")
