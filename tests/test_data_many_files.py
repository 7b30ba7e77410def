"""Many input files: shards merged in file order, kept per shard, resumed after an interruption,
split by source; progress bars for terminals and plain lines for logs."""

import fcntl
import json
import os
import pty
import struct
import subprocess
import sys
import termios
from pathlib import Path

import pytest

import megazpp.preprocess.chunk_reader as reader
import megazpp.preprocess.pipeline as pp
from megazpp.data.indexed_dataset import IndexedDataset
from megazpp.data.tokenizer import Tokenizer
from megazpp.preprocess.pipeline import preprocess

ROOT = Path(__file__).resolve().parent.parent


def write_tree(root: Path, files: int = 12) -> list[list[str]]:
    """Files in nested directories (two sources, `a/` and `b/`), each a few documents."""
    texts = []
    for f in range(files):
        path = root / ("a" if f % 3 else "b") / f"part{f // 6}" / f"{f:03d}.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        docs = [f"file {f} document {d} " + "x y z " * ((f + d) % 5) for d in range(3 + f % 4)]
        path.write_text("".join(json.dumps({"text": t}) + "\n" for t in docs))
        texts.append((path, docs))
    (root / "a" / "empty.jsonl").write_text("")  # an empty shard
    texts.append((root / "a" / "empty.jsonl", []))
    return [docs for _, docs in sorted(texts)]


def _read(prefix: str) -> list[list[int]]:
    ds = IndexedDataset(prefix)
    return [ds[i].tolist() for i in range(len(ds))]


def test_merged_shards_equal_one_pass_in_file_order(tiny_tokenizer_model, tmp_path):
    texts = write_tree(tmp_path / "in")
    tok = Tokenizer(tiny_tokenizer_model)
    summary = preprocess(
        tmp_path / "in",
        tiny_tokenizer_model,
        tmp_path / "out",
        workers=2,
        append_eod=True,
        chunk_bytes=64,
        progress=False,
    )
    assert _read(summary.outputs["text"]) == [tok.encode(t) + [tok.eod_id] for docs in texts for t in docs]
    assert summary.documents["text"] == sum(map(len, texts)) and len(summary.files) == len(texts)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "in",
        "out_text_document.bin",
        "out_text_document.idx",
        "out_text_document.tokenizer.json",
    ]


def test_per_shard_outputs_one_dataset_per_file(tiny_tokenizer_model, tmp_path):
    texts = write_tree(tmp_path / "in")
    tok = Tokenizer(tiny_tokenizer_model)
    summary = preprocess(
        str(tmp_path / "in" / "**" / "*.jsonl"), tiny_tokenizer_model, tmp_path / "out", per_shard=True, progress=False
    )
    prefixes = summary.shard_outputs["text"]
    assert not summary.outputs and len(prefixes) == len(texts)
    assert prefixes[:2] == [
        str(tmp_path / "out_shards" / "a" / "empty_text_document"),
        str(tmp_path / "out_shards" / "a" / "part0" / "001_text_document"),
    ]
    assert [_read(p) for p in prefixes] == [[tok.encode(t) for t in docs] for docs in texts]


def test_interrupted_run_resumes_without_redoing_finished_shards(tiny_tokenizer_model, tmp_path, monkeypatch):
    write_tree(tmp_path / "in")
    reference = preprocess(tmp_path / "in", tiny_tokenizer_model, tmp_path / "ref", progress=False)
    real_marker, calls = pp.write_marker, []

    def interrupt_third(*args):
        calls.append(args[0])
        if len(calls) == 3:  # shard 3's outputs are in place, its marker is not: it counts as unfinished
            raise KeyboardInterrupt
        real_marker(*args)

    monkeypatch.setattr(pp, "write_marker", interrupt_third)
    with pytest.raises(KeyboardInterrupt):
        preprocess(tmp_path / "in", tiny_tokenizer_model, tmp_path / "out", workers=2, chunk_bytes=64, progress=False)
    assert not list(tmp_path.glob("out_text_document*"))
    markers = sorted(p.name for p in (tmp_path / "out_shards").rglob("*.done.json"))
    assert markers == ["001.done.json", "empty.done.json"]
    stale = tmp_path / "out_shards" / "a" / "part0" / "002_text_document.bin.tmp99999"  # a killed run's leftover
    stale.write_bytes(b"junk")
    monkeypatch.setattr(pp, "write_marker", real_marker)
    real_read, read = reader.iter_line_chunks, []
    monkeypatch.setattr(reader, "iter_line_chunks", lambda path, n: (read.append(path.name), real_read(path, n))[1])
    summary = preprocess(tmp_path / "in", tiny_tokenizer_model, tmp_path / "out", workers=1, progress=False)
    assert summary.resumed == 2 and "empty.jsonl" not in read and "001.jsonl" not in read and "002.jsonl" in read
    assert len(read) == len(summary.files) - 2 and not stale.exists()
    assert summary.documents == reference.documents and summary.tokens == reference.tokens
    for suffix in (".bin", ".idx"):
        ours, ref = Path(summary.outputs["text"] + suffix), Path(reference.outputs["text"] + suffix)
        assert ours.read_bytes() == ref.read_bytes()
    assert not (tmp_path / "out_shards").exists()


def test_kept_shards_redo_only_changed_or_new_files(tiny_tokenizer_model, tmp_path, monkeypatch):
    write_tree(tmp_path / "in")
    first = preprocess(tmp_path / "in", tiny_tokenizer_model, tmp_path / "out", keep_shards=True, progress=False)
    changed = tmp_path / "in" / "b" / "part0" / "003.jsonl"
    changed.write_text('{"text": "replaced"}\n')
    (tmp_path / "in" / "b" / "new.jsonl").write_text('{"text": "new file"}\n')
    real_read, read = reader.iter_line_chunks, []
    monkeypatch.setattr(reader, "iter_line_chunks", lambda path, n: (read.append(path.name), real_read(path, n))[1])
    second = preprocess(tmp_path / "in", tiny_tokenizer_model, tmp_path / "out", keep_shards=True, progress=False)
    assert sorted(read) == ["003.jsonl", "new.jsonl"] and second.resumed == len(first.files) - 1
    read.clear()
    third = preprocess(tmp_path / "in", tiny_tokenizer_model, tmp_path / "out", append_eod=True, progress=False)
    assert len(read) == len(third.files) and third.resumed == 0  # other options: nothing is reused


def test_split_by_source_v1(tiny_tokenizer_model, tmp_path):
    (tmp_path / "in" / "cc").mkdir(parents=True)
    (tmp_path / "in" / "cc" / "x.jsonl").write_text(
        "".join(
            json.dumps(r) + "\n"
            for r in [
                {"text": "slim one", "meta": {"redpajama_set_name": "RedPajamaArXiv"}},
                {"text": "slim two", "meta": {"redpajama_set_name": "RedPajamaC4"}},
                {"text": "dir source", "meta": {}},
                {"text": "slim three", "meta": {"redpajama_set_name": "RedPajamaArXiv"}},
            ]
        )
    )
    (tmp_path / "in" / "top.jsonl").write_text('{"text": "named by the file"}\n')
    summary = preprocess(
        tmp_path / "in", tiny_tokenizer_model, tmp_path / "out", split_by_source=True, workers=2, progress=False
    )
    tok = Tokenizer(tiny_tokenizer_model)
    expected = {
        "RedPajamaArXiv": ["slim one", "slim three"],
        "RedPajamaC4": ["slim two"],
        "cc": ["dir source"],
        "top": ["named by the file"],
    }
    assert sorted(summary.outputs) == sorted(f"{s}:text" for s in expected)
    for source, texts in expected.items():
        assert summary.outputs[f"{source}:text"] == f"{tmp_path / 'out'}_{source}_text_document"
        assert _read(summary.outputs[f"{source}:text"]) == [tok.encode(t) for t in texts]


def _cli(args: list[str]) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run(
        [sys.executable, str(ROOT / "tools" / "preprocess_data.py"), *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )


def _cli_on_terminal(args: list[str]) -> tuple[int, str]:
    """(exit code, what it drew on stderr) with stderr a pseudo-terminal: bars are drawn only
    on a terminal (megazpp.cli.wants_progress)."""
    leader, follower = pty.openpty()
    # a new pseudo-terminal is 0 columns wide, and bars sized to the terminal would be empty
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 120, 0, 0))
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.Popen(
        [sys.executable, str(ROOT / "tools" / "preprocess_data.py"), *args],
        stdout=subprocess.DEVNULL,
        stderr=follower,
        env=env,
    )
    os.close(follower)
    drawn = bytearray()
    while True:  # read as it draws, so a full terminal buffer never blocks the tool
        try:
            chunk = os.read(leader, 4096)
        except OSError:  # EIO: the tool closed its end
            break
        if not chunk:
            break
        drawn += chunk
    os.close(leader)
    return proc.wait(timeout=300), drawn.decode(errors="replace")


def test_progress_bars_and_plain_logs(tiny_tokenizer_model, tmp_path):
    write_tree(tmp_path / "in", files=3)
    common = ["--input", str(tmp_path / "in"), "--tokenizer-model", str(tiny_tokenizer_model)]
    quiet = _cli(common + ["--output-prefix", str(tmp_path / "q"), "--no-progress"])
    assert quiet.returncode == 0, quiet.stderr
    assert "\r" not in quiet.stdout + quiet.stderr and "preprocessed 4 files" in quiet.stdout
    code, drawn = _cli_on_terminal(common + ["--output-prefix", str(tmp_path / "b")])
    assert code == 0, drawn
    assert "files: 100%" in drawn and "4/4" in drawn and "tok/s" in drawn
    bad = _cli(common + ["--output-prefix", str(tmp_path / "x"), "--filter", "rps_doc_word_count >="])
    assert bad.returncode == 2 and bad.stderr.strip().count("\n") == 0
    assert "error: filter rule 'rps_doc_word_count >=': expected a number" in bad.stderr
