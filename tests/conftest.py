"""Session-wide data fixtures shared by every area's tests.

Each is built once per test session under a temporary directory through the same code paths
as the command-line tools, so tests of other areas run on real (tiny) tokenized data.
"""

from __future__ import annotations

import os

# Triton fixes interpreter mode when it is first imported, and several tests import it
# indirectly (transformers, the kernels): set it before any of them so the Triton kernel tests
# run interpreted on CPU whatever the test order. The CUDA compile check runs in a subprocess
# with it removed.
os.environ.setdefault("TRITON_INTERPRET", "1")

import ast  # noqa: E402
import functools  # noqa: E402
import shutil  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest
from support import ROOT, tree_changes, tree_entries

from megazpp.preprocess.pipeline import preprocess
from megazpp.preprocess.sample_corpus import build_sample_corpus
from megazpp.preprocess.tokenizer_training import train_tokenizer


def netlab_unavailable() -> str | None:
    """Why tools/netlab.sh cannot make nodes here, or None: it needs root and iproute2's tools."""
    if os.geteuid() != 0:
        return "netlab needs root (network namespaces, tc)"
    for tool in ("ip", "tc", "unshare"):
        if shutil.which(tool) is None:
            return f"netlab needs '{tool}', which is not installed"
    return None


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "netlab: runs nodes on tools/netlab.sh; skipped, with the reason, where netlab cannot run"
    )
    config.addinivalue_line(
        "markers",
        "multirank: spawns gloo ranks (megazpp.launch.local_ranks.run_ranks); "
        "set by conftest on every test that reaches run_ranks",
    )
    config.addinivalue_line(
        "markers",
        "slow: takes more than ~10 s on 2 loaded cores (launches run.sh, "
        "torchrun or many subprocesses); the fast tier leaves it out",
    )
    config.addinivalue_line(
        "markers",
        "full_matrix: the whole two-level combination matrix (tests/test_outer_matrix.py, tens of "
        "minutes); .ci/run deselects it, CI runs its pairwise tier",
    )


# what spawns ranks: the local launcher, called by a test, its fixtures or helpers
SPAWNERS = frozenset({"run_ranks"})


@functools.cache
def spawning_functions(path: Path) -> frozenset[str]:
    """Names of the functions of a test module that reach a SPAWNERS call, directly or through
    other functions of the module or helpers imported from sibling test modules."""
    tree = ast.parse(path.read_text(), str(path))
    reaching = set(SPAWNERS)
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and node.module and (path.parent / f"{node.module}.py").is_file():
            helpers = spawning_functions(path.parent / f"{node.module}.py")
            reaching |= {alias.asname or alias.name for alias in node.names if alias.name in helpers}
    calls = {
        node.name: {
            c.func.id if isinstance(c.func, ast.Name) else c.func.attr
            for c in ast.walk(node)
            if isinstance(c, ast.Call) and isinstance(c.func, (ast.Name, ast.Attribute))
        }
        for node in ast.walk(tree)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
    }
    while True:
        more = {name for name, called in calls.items() if called & reaching} - reaching
        if not more:
            return frozenset(reaching - SPAWNERS)
        reaching |= more


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    reason = netlab_unavailable()
    for item in items:
        if reason is not None and item.get_closest_marker("netlab") is not None:
            item.add_marker(pytest.mark.skip(reason=reason))
        if isinstance(item, pytest.Function) and (
            {item.function.__name__, *item.fixturenames} & spawning_functions(Path(item.fspath))
        ):
            item.add_marker(pytest.mark.multirank)


@pytest.fixture(autouse=True)
def writes_only_under_temporary_directories():
    """Fails the test that adds or removes anything in the checkout: runs/, checkpoints/, data/ or
    elsewhere. (Once a test's run.sh logged into the checkout's runs/llama_tiny, and
    tools/compare_runs.py then showed it inside the user's own run.) A test gives run.sh and
    pretrain_gpt.py its own --save and --tensorboard-dir, and run.sh a DATA_DIR, under tmp_path."""
    before = tree_entries(ROOT)
    yield
    changed = tree_changes(before, tree_entries(ROOT))
    assert not changed, (
        f"this test changed the checkout {ROOT} (tests write only under their tmp_path; "
        f"or did something else write there meanwhile?): {', '.join(changed[:10])}"
    )


TINY_CORPUS_BYTES = 200_000
TINY_VOCAB_SIZE = 512


@pytest.fixture(scope="session")
def tiny_corpus_dir(tmp_path_factory) -> Path:
    """A ~200 KB RedPajama v1 corpus: `stdlib_code.jsonl` and `stdlib_docs.jsonl`."""
    out = tmp_path_factory.mktemp("tiny_corpus")
    build_sample_corpus(out, total_bytes=TINY_CORPUS_BYTES)
    return out


@pytest.fixture(scope="session")
def tiny_tokenizer_model(tiny_corpus_dir, tmp_path_factory) -> Path:
    """Path to a SentencePiece BPE `.model` (vocab 512, unk=0 bos=1 eos=2 pad=3) trained on the tiny corpus."""
    out = tmp_path_factory.mktemp("tiny_tokenizer")
    model, _ = train_tokenizer(sorted(tiny_corpus_dir.glob("*.jsonl")), TINY_VOCAB_SIZE, out / "tok512")
    return model


@pytest.fixture(scope="session")
def tiny_indexed_prefix(tiny_corpus_dir, tiny_tokenizer_model, tmp_path_factory) -> str:
    """Prefix of the tiny corpus preprocessed with `--append-eod`: `<prefix>.bin/.idx` exist."""
    out = tmp_path_factory.mktemp("tiny_indexed")
    summary = preprocess(
        tiny_corpus_dir, tiny_tokenizer_model, out / "tiny", workers=1, append_eod=True, progress=False
    )
    return summary.outputs["text"]


@pytest.fixture
def run_sh_data_dir(tmp_path, tiny_corpus_dir, tiny_tokenizer_model, tiny_indexed_prefix) -> Path:
    """run.sh's `data/` layout (its DATA_DIR) pointing at the session's tiny fixtures, so a test
    that launches run.sh rebuilds nothing."""
    data = tmp_path / "data"
    data.mkdir()
    (data / "corpus").symlink_to(tiny_corpus_dir)
    (data / "tokenizer.model").symlink_to(tiny_tokenizer_model)
    for ext in ("bin", "idx", "tokenizer.json"):
        (data / f"corpus_text_document.{ext}").symlink_to(f"{tiny_indexed_prefix}.{ext}")
    return data


@pytest.fixture
def write_token_dataset(tmp_path):
    """Factory: writes documents (lists of token ids) as an int32 indexed dataset, returns its prefix.

    Tests of the dataset layers use unique token values so every token's origin is checkable.
    """
    import numpy as np

    from megazpp.data.indexed_dataset import IndexedDatasetBuilder

    def write(documents, name: str = "synthetic", dtype=np.int32) -> str:
        prefix = str(tmp_path / name)
        with IndexedDatasetBuilder(prefix, dtype) as builder:
            for doc in documents:
                builder.add_document(np.asarray(doc, dtype=np.int64))
        return prefix

    return write
