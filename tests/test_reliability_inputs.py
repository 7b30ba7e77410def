"""Inputs that used to lose data or crash without a word, tried as a user would: a YAML file
with a section given twice, a blend with an empty dataset, an empty dataset alone, a split
with no training share, and data tokenized with a larger vocabulary than the model's.
Each must stop `pretrain_gpt.py` before step 1 with one `error:` line (exit code 2)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from support import checkout_env
from test_training_pretrain import tiny_args

from megazpp.config.load import load_config
from megazpp.data.indexed_dataset import IndexedDataset, IndexedDatasetBuilder
from megazpp.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]


def pretrain(*args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    env = checkout_env()
    return subprocess.run(
        [sys.executable, str(ROOT / "pretrain_gpt.py"), *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def refused(proc: subprocess.CompletedProcess) -> str:
    """The single error line of a refused run (and that nothing was trained)."""
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr and "iter " not in proc.stdout, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("pretrain_gpt.py: error: "), proc.stderr
    return lines[0]


def write_dataset(prefix: Path, documents: list[list[int]]) -> str:
    with IndexedDatasetBuilder(prefix, np.uint16) as builder:
        for doc in documents:
            builder.add_document(np.asarray(doc, dtype=np.int64))
    return str(prefix)


def test_a_section_given_twice_is_refused(tmp_path):
    config = tmp_path / "twice.yaml"
    config.write_text(
        "model:\n  hidden_size: 64\n  num_layers: 2\ntraining:\n  train_iters: 3\nmodel:\n  num_attention_heads: 4\n"
    )
    line = refused(pretrain("--config", str(config)))
    assert line.endswith(f"config file {config}: not valid YAML (duplicate key 'model' at lines 1 and 6)")
    # at any depth, and in a DeepSpeed JSON too
    config.write_text("model:\n  hidden_size: 64\n  hidden_size: 32\n")
    with pytest.raises(ConfigError, match="duplicate key 'hidden_size' at lines 2 and 3"):
        load_config(["--config", str(config)])
    ds = tmp_path / "ds.json"
    ds.write_text(
        '{"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 1}, "zero_optimization": {"stage": 3}}'
    )
    with pytest.raises(ConfigError, match="duplicate key 'zero_optimization' in one JSON object"):
        load_config(["--deepspeed_config", str(ds)])


@pytest.mark.slow
def test_empty_datasets_splits_and_foreign_token_ids_are_refused(tmp_path, tiny_indexed_prefix, tiny_tokenizer_model):
    empty = write_dataset(tmp_path / "empty", [])
    single = write_dataset(tmp_path / "single", [list(range(3, 40))])
    wide = write_dataset(tmp_path / "wide", [list(range(3, 200)), [5, 2047, 9] * 30])

    def args(*data_path: str, split: str = "90,10,0") -> list[str]:
        base = tiny_args(tiny_indexed_prefix, tiny_tokenizer_model, "--train-iters", "2")
        at = base.index("--data-path")
        base[at + 1 : at + 2] = list(data_path)
        return base + ["--split", split]

    a = str(tiny_indexed_prefix)
    # the blend trained on A alone without a word; now the empty member is named
    line = refused(pretrain(*args("0.5", a, "0.5", empty)))
    assert line.endswith(
        f"dataset '{empty}' holds no documents ({empty}.idx): nothing to train "
        "on; remove it from --data-path or preprocess it again"
    )
    # alone it crashed with "TypeError: object of type 'NoneType' has no len()"
    assert refused(pretrain(*args(empty))) == line
    # a split without a training share: the same TypeError before
    line = refused(pretrain(*args(a, split="0,100,0")))
    docs = IndexedDataset(a).num_documents
    assert line.endswith(
        f"--split '0,100,0' leaves the train split no documents of '{a}' "
        f"({docs} documents): it would train without them; give a split with "
        "a larger training share or more documents"
    )
    # a blend member too small for its training share was dropped from training silently
    line = refused(pretrain(*args("0.5", a, "0.5", single, split="50,50,0")))
    assert f"leaves the train split no documents of '{single}' (1 documents)" in line
    # data from a 2048-token tokenizer under the 512-token one: IndexError in the embedding
    line = refused(pretrain(*args(wide)))
    assert line.endswith(
        f"dataset '{wide}' holds token id 2047, but the model's vocabulary has "
        "512 entries (ids 0..511): was it tokenized with another, larger "
        "tokenizer than --tokenizer-model?"
    )
    assert IndexedDataset(wide).max_token_id() == 2047  # cached beside the data after one scan
    assert len(list(tmp_path.glob("wide_max_token_*.npy"))) == 1
    # a vocabulary multiple of 0 beside a tokenizer: ZeroDivisionError while sizing the embedding
    line = refused(pretrain(*args(a), "--make-vocab-size-divisible-by", "0"))
    assert line.endswith("data.make_vocab_size_divisible_by = 0: expected a value >= 1")
