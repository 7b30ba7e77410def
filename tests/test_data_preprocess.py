"""JSONL -> .bin/.idx: every token back in order, bad records counted, failures leave no debris."""

import gzip
import json
import multiprocessing
import re
import signal
import sys
from pathlib import Path

import numpy as np
import pytest
from support import load_tool

from megazpp.data.indexed_dataset import IndexedDataset
from megazpp.data.tokenizer import Tokenizer
from megazpp.errors import DataError
from megazpp.preprocess.chunk_encoder import init_worker
from megazpp.preprocess.pipeline import preprocess
from megazpp.preprocess.signal_filter import FilterSpec


def corpus_texts(corpus_dir):
    return [
        json.loads(line)["text"]
        for path in sorted(Path(corpus_dir).glob("*.jsonl"))
        for line in path.read_text(encoding="utf-8").splitlines()
    ]


def test_round_trip_every_token_in_order(tiny_corpus_dir, tiny_tokenizer_model, tmp_path):
    tok = Tokenizer(tiny_tokenizer_model)
    texts = corpus_texts(tiny_corpus_dir)
    # small chunks: many work units, so the 2-worker run really interleaves
    two = preprocess(
        tiny_corpus_dir,
        tiny_tokenizer_model,
        tmp_path / "w2",
        workers=2,
        append_eod=True,
        chunk_bytes=8192,
        progress=False,
    )
    ds = IndexedDataset(two.outputs["text"])
    assert len(ds) == ds.num_documents == len(texts) == two.documents["text"]
    assert ds.document_indices.tolist() == list(range(len(texts) + 1))
    for i, text in enumerate(texts):
        assert ds[i].tolist() == tok.encode(text) + [tok.eod_id]
        assert tok.decode(ds[i][:-1]) == text
    assert two.tokens["text"] == int(ds.sequence_lengths.sum()) and not two.skipped
    one = preprocess(tiny_corpus_dir, tiny_tokenizer_model, tmp_path / "w1", workers=1, append_eod=True, progress=False)
    for suffix in (".bin", ".idx"):
        assert Path(one.outputs["text"] + suffix).read_bytes() == Path(two.outputs["text"] + suffix).read_bytes()


BAD_LINES = [
    (b'{"text": "first good document", "meta": {"source": "x"}}\n', None),
    (b'{"raw_content": "a RedPajama v2 document", "quality_signals": {}}\n', None),
    (b'{"text": "broken json\n', "malformed_json"),
    (b'{"meta": {"source": "no text here"}}\n', "missing_key"),
    (b'{"text": "caf\xe9 in latin-1"}\n', "non_utf8"),
    (b'{"text": "\\ud800 lone surrogate"}\n', "non_utf8"),
    (b'{"text": "   \\n\\t "}\n', "empty_document"),
    (b'{"text": 42}\n', "not_a_string"),
    (b'["text", "a list"]\n', "not_an_object"),
    (b"\n", "blank_line"),
    (b'{"text": "last good document"}', None),  # no trailing newline
]


def test_bad_records_are_skipped_and_counted(tiny_tokenizer_model, tmp_path):
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.jsonl").write_bytes(b"".join(line for line, _ in BAD_LINES))
    with gzip.open(tmp_path / "in" / "b.jsonl.gz", "wb") as f:
        f.write(b'{"text": "gzipped document"}\n{"text": ""}\n')
    summary = preprocess(str(tmp_path / "in" / "*.jsonl*"), tiny_tokenizer_model, tmp_path / "out", progress=False)
    expected = {}
    for _, reason in BAD_LINES:
        if reason:
            expected[reason] = expected.get(reason, 0) + 1
    expected["empty_document"] += 1
    assert dict(summary.skipped) == expected
    tok = Tokenizer(tiny_tokenizer_model)
    ds = IndexedDataset(summary.outputs["text"])
    good = ["first good document", "a RedPajama v2 document", "last good document", "gzipped document"]
    assert [ds[i].tolist() for i in range(len(ds))] == [tok.encode(t) for t in good]
    assert summary.documents["text"] == 4
    assert "skipped: blank_line=1, empty_document=2, malformed_json=1" in summary.line()


def test_missing_inputs_and_model_fail_before_writing(tiny_tokenizer_model, tiny_corpus_dir, tmp_path):
    with pytest.raises(DataError, match=r"nothing\*\.jsonl.*matches no JSONL file"):
        preprocess(str(tmp_path / "nothing*.jsonl"), tiny_tokenizer_model, tmp_path / "out", progress=False)
    with pytest.raises(DataError, match=r"tokenizer model .*missing\.model does not exist"):
        preprocess(tiny_corpus_dir, tmp_path / "missing.model", tmp_path / "out", progress=False)
    with pytest.raises(DataError, match=r"JSON key 'meta/title' cannot name an output file"):
        preprocess(
            tiny_corpus_dir, tiny_tokenizer_model, tmp_path / "out", json_keys=("text", "meta/title"), progress=False
        )
    (tmp_path / "garbage.model").write_bytes(b"not a protobuf")
    with pytest.raises(DataError, match=r"garbage\.model is not a valid SentencePiece model"):
        preprocess(tiny_corpus_dir, tmp_path / "garbage.model", tmp_path / "out", progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["garbage.model"]


@pytest.mark.parametrize("workers", [1, 2])
def test_damaged_file_keeps_what_was_read_and_the_previous_output_is_replaced_whole(
    tiny_tokenizer_model, tmp_path, workers
):
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.jsonl").write_text('{"text": "new data"}\n' * 2000)
    whole = gzip.compress(b"".join(b'{"text": "gzipped %d"}\n' % i for i in range(5000)))
    (tmp_path / "in" / "b.jsonl.gz").write_bytes(whole[: len(whole) // 2])
    summary = preprocess(
        tmp_path / "in", tiny_tokenizer_model, tmp_path / "out", workers=workers, chunk_bytes=1024, progress=False
    )
    good = len(gzip.decompress(whole).splitlines())
    [damage] = summary.damage
    read = int(re.search(r"cannot read past line (\d+)", damage).group(1))
    assert str(tmp_path / "in" / "b.jsonl.gz") in damage and "EOFError" in damage and 0 < read < good
    ds = IndexedDataset(summary.outputs["text"])
    tok = Tokenizer(tiny_tokenizer_model)
    assert len(ds) == 2000 + read and ds[2000 + read - 1].tolist() == tok.encode(f"gzipped {read - 1}")
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "in",
        "out_text_document.bin",
        "out_text_document.idx",
        "out_text_document.tokenizer.json",
    ]


def test_cli_prints_the_summary(tiny_corpus_dir, tiny_tokenizer_model, tmp_path, capsys):
    tool = load_tool("preprocess_data")
    assert (
        tool.main(
            [
                "--input",
                str(tiny_corpus_dir / "*.jsonl"),
                "--tokenizer-model",
                str(tiny_tokenizer_model),
                "--output-prefix",
                str(tmp_path / "cli"),
                "--workers",
                "1",
                "--json-keys",
                "text",
                "--append-eod",
                "--no-progress",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out.strip().splitlines()
    ds = IndexedDataset(tmp_path / "cli_text_document")
    assert out[-1].startswith(f"preprocessed 2 files: {len(ds)} documents, {int(ds.sequence_lengths.sum())} tokens")
    assert out[-1].endswith("skipped: none") and "tokens/s" in out[-1]


@pytest.mark.parametrize("name", ["make_sample_corpus", "train_tokenizer", "preprocess_data", "bench_preprocess"])
def test_every_tool_has_help(name, capsys):
    with pytest.raises(SystemExit) as exit_:
        load_tool(name).main(["--help"])
    assert exit_.value.code == 0 and "usage:" in capsys.readouterr().out


def test_multiple_json_keys_make_one_dataset_each(tiny_tokenizer_model, tmp_path):
    (tmp_path / "a.jsonl").write_text('{"text": "body one", "title": "t1"}\n{"text": "body two"}\n')
    summary = preprocess(
        tmp_path / "a.jsonl", tiny_tokenizer_model, tmp_path / "multi", json_keys=("text", "title"), progress=False
    )
    tok = Tokenizer(tiny_tokenizer_model)
    assert IndexedDataset(summary.outputs["title"])[0].tolist() == tok.encode("t1")
    assert len(IndexedDataset(summary.outputs["text"])) == 2
    assert dict(summary.skipped) == {"title:missing_key": 1}
    assert IndexedDataset(summary.outputs["text"]).dtype == np.uint16


def _worker_sigterm() -> object:
    return signal.getsignal(signal.SIGTERM)


def test_workers_end_at_sigterm_whatever_handler_the_caller_installed(tiny_tokenizer_model):
    """The pool stops its workers with SIGTERM; a caller's Python handler forked into them would
    run instead of ending them (once in CI the pool's join then waited forever), so a worker's
    initializer restores the default disposition."""
    own = signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # as a tool with its own cleanup installs
    try:
        with multiprocessing.get_context("fork").Pool(
            1, initializer=init_worker, initargs=(str(tiny_tokenizer_model), ("text",), True, False, FilterSpec())
        ) as pool:
            assert pool.apply(_worker_sigterm) is signal.SIG_DFL
    finally:
        signal.signal(signal.SIGTERM, own)
