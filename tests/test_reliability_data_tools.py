"""The data side's faults a user meets, tried as a user would (subprocesses, real files, real
SIGINT to the process group, as Ctrl-C sends it): data made by one tokenizer trained with
another of the same vocabulary size; `DATA_DIR=<my own data> bash run.sh`; `preprocess_data.py`
into an existing prefix, over an empty input or the wrong key, over a file starting with a
UTF-8 BOM; Ctrl-C during preprocessing and during the tokenizer build. Each refusal is one
line and exit code 2, Ctrl-C one line and 130, and what was there before is unchanged."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from support import as_from_a_terminal, checkout_env, paused_at, run_sh_variables, wait_until_paused
from test_training_pretrain import tiny_args

from megazpp.data.indexed_dataset import IndexedDataset
from megazpp.data.tokenizer import Tokenizer
from megazpp.data.tokenizer_record import model_sha256, read_record
from megazpp.errors import DataError
from megazpp.preprocess.pipeline import preprocess
from megazpp.preprocess.sample_dir import describe
from megazpp.preprocess.tokenizer_training import train_tokenizer

ROOT = Path(__file__).resolve().parents[1]


def tool(name: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(ROOT / "tools" / name), *args, "--no-progress"],
        env=checkout_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )


def run_sh(data_dir: Path, *args: str, nproc: int = 2) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(ROOT / "run.sh"), *args],
        env=checkout_env(**run_sh_variables(data_dir, nproc, MAX_RESTARTS="0")),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )


def one_line(proc: subprocess.CompletedProcess, prog: str, code: int = 2, kind: str = "error") -> str:
    assert proc.returncode == code, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"{prog}: {kind}"), proc.stderr
    return lines[0]


def snapshot(directory: Path) -> dict[str, str]:
    """Every file under `directory` (links followed) by its sha256: what must stay untouched."""
    return {
        str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(directory.rglob("*"))
        if p.is_file()
    }


@pytest.fixture(scope="module")
def other_tokenizer(tiny_corpus_dir, tiny_tokenizer_model, tmp_path_factory) -> Path:
    """A second tokenizer of the same vocabulary size, trained on the docstrings alone."""
    out = tmp_path_factory.mktemp("other_tokenizer")
    model, _ = train_tokenizer(
        [tiny_corpus_dir / "stdlib_docs.jsonl"], Tokenizer(tiny_tokenizer_model).vocab_size, out / "other"
    )
    assert Tokenizer(model).vocab_size == Tokenizer(tiny_tokenizer_model).vocab_size
    assert model_sha256(model) != model_sha256(tiny_tokenizer_model)
    return model


@pytest.mark.slow
def test_data_of_another_tokenizer_is_refused_once_per_job_unless_accepted(
    tmp_path, run_sh_data_dir, tiny_indexed_prefix, tiny_tokenizer_model, other_tokenizer
):
    record = read_record(tiny_indexed_prefix)
    assert record is not None and record.sha256 == model_sha256(tiny_tokenizer_model)
    before = snapshot(run_sh_data_dir)
    args = tiny_args(
        tiny_indexed_prefix,
        other_tokenizer,
        "--train-iters",
        "2",
        "--eval-iters",
        "0",
        "--tensorboard-dir",
        str(tmp_path / "tb"),
        "--save",
        str(tmp_path / "ckpt"),
    )
    proc = run_sh(run_sh_data_dir, *args)
    line = one_line(proc, "pretrain_gpt.py")
    assert line.endswith(
        f"dataset '{tiny_indexed_prefix}' was tokenized by {record.model} (sha256 {record.sha256[:16]}, "
        f"{tiny_indexed_prefix}.tokenizer.json), but --tokenizer-model {other_tokenizer} is sha256 "
        f"{model_sha256(other_tokenizer)[:16]}: train with the tokenizer that made the data, or pass "
        "--allow-tokenizer-mismatch to accept it"
    ), line
    # refused before torchrun started a rank; run.sh said what it would use instead of DATA_DIR's data
    assert "node_launcher" not in proc.stdout + proc.stderr and "iter " not in proc.stdout
    assert (
        f"run.sh: DATA_DIR={run_sh_data_dir} holds run.sh's sample data: training on "
        f"{run_sh_data_dir}/corpus_text_document with the tokenizer {run_sh_data_dir}/tokenizer.model; but the "
        f"command line's --data-path {tiny_indexed_prefix} and --tokenizer-model {other_tokenizer} win over it"
    ) in proc.stdout.splitlines()
    # accepted knowingly, in a blend with a dataset made before records existed: a note each, once per job
    legacy = tmp_path / "legacy_text_document"
    for suffix in (".bin", ".idx"):
        shutil.copyfile(f"{tiny_indexed_prefix}{suffix}", f"{legacy}{suffix}")
    at = args.index("--data-path")
    args[at + 1 : at + 2] = ["0.5", tiny_indexed_prefix, "0.5", str(legacy)]
    proc = run_sh(run_sh_data_dir, *args, "--allow-tokenizer-mismatch")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.count(f"dataset '{tiny_indexed_prefix}' was tokenized by") == 1
    assert proc.stdout.count("(accepted: --allow-tokenizer-mismatch)") == 1
    assert (
        proc.stdout.count(
            f"'{legacy}': no tokenizer record (.tokenizer.json; made before megazpp wrote one, or by Megatron)"
        )
        == 1
    )
    assert snapshot(run_sh_data_dir) == before


@pytest.mark.slow
def test_run_sh_never_builds_among_other_data(tmp_path):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "web.jsonl").write_text('{"text": "my own document"}\n')
    (mine / "tokenizer.model").write_bytes(b"my own tokenizer")  # a sample-build name, among others
    before = snapshot(mine)
    line = one_line(run_sh(mine, "--train-iters", "1", nproc=1), "run.sh")
    assert line == (
        f"run.sh: error: DATA_DIR={mine} holds files that are not run.sh's sample data (web.jsonl): "
        "run.sh builds and trains on its sample data only in an empty directory or one it built; "
        "give another DATA_DIR (your own data goes in with --data-path PREFIX --tokenizer-model FILE)"
    )
    assert snapshot(mine) == before and sorted(p.name for p in mine.iterdir()) == ["tokenizer.model", "web.jsonl"]
    line = one_line(run_sh(mine / "web.jsonl", nproc=1), "run.sh")
    assert line.endswith(
        f"DATA_DIR={mine / 'web.jsonl'} is not a directory: give run.sh a directory for its sample data"
    )
    assert snapshot(mine) == before


def test_what_data_dir_holds_is_said(tmp_path):
    root = tmp_path / "data"
    assert describe(root).startswith(f"DATA_DIR={root} is absent: building the sample data there")
    root.mkdir()
    assert describe(root).startswith(f"DATA_DIR={root} is empty: building")
    # an interrupted build: the corpus and the temp names of each step
    (root / "corpus").mkdir()
    for name in (
        "corpus/stdlib_code.jsonl",
        "corpus/stdlib_docs.jsonl",
        "tokenizer.tmp.tmp123.model",
        "corpus.tmp_text_document.bin.tmp77",
    ):
        (root / name).write_text("")
    (root / "corpus.tmp_shards").mkdir()
    assert describe(root).startswith(f"DATA_DIR={root} holds an unfinished build of run.sh's sample data")
    for name in (
        "tokenizer.model",
        "tokenizer.vocab",
        "corpus_text_document.bin",
        "corpus_text_document.idx",
        "corpus_text_document.tokenizer.json",
        "corpus_text_document_train_0123abcd_sample_index.npy",
        "corpus_text_document_max_token_0123abcd.npy",
    ):
        (root / name).write_text("")
    assert describe(root) == (
        f"DATA_DIR={root} holds run.sh's sample data: training on {root}/corpus_text_document "
        f"with the tokenizer {root}/tokenizer.model"
    )
    (root / "corpus" / "extra.jsonl").write_text("")
    with pytest.raises(DataError, match=r"not run.sh's sample data \(corpus/extra.jsonl\)"):
        describe(root)


def test_preprocess_never_overwrites_and_refuses_what_would_be_empty(tmp_path, tiny_tokenizer_model):
    tok = str(tiny_tokenizer_model)
    (tmp_path / "a.jsonl").write_text('{"text": "first"}\n{"text": "second"}\n')
    assert (
        tool(
            "preprocess_data.py",
            "--input",
            str(tmp_path / "a.jsonl"),
            "--tokenizer-model",
            tok,
            "--output-prefix",
            str(tmp_path / "out"),
        ).returncode
        == 0
    )
    before = snapshot(tmp_path)
    (tmp_path / "b.jsonl").write_text('{"text": "another corpus"}\n')
    line = one_line(
        tool(
            "preprocess_data.py",
            "--input",
            str(tmp_path / "b.jsonl"),
            "--tokenizer-model",
            tok,
            "--output-prefix",
            str(tmp_path / "out"),
        ),
        "preprocess_data.py",
    )
    assert line == (
        f"preprocess_data.py: error: {tmp_path}/out_text_document.bin: already exists (a preprocessed "
        "dataset); choose another --output-prefix, or remove that dataset first (outputs are never "
        "overwritten)"
    )
    # split by source: any <prefix>_<source>_text_document is an output of the same prefix
    (tmp_path / "s_web_text_document.idx").write_bytes(b"")
    line = one_line(
        tool(
            "preprocess_data.py",
            "--input",
            str(tmp_path / "b.jsonl"),
            "--tokenizer-model",
            tok,
            "--output-prefix",
            str(tmp_path / "s"),
            "--split-by-source",
        ),
        "preprocess_data.py",
    )
    assert f"{tmp_path}/s_web_text_document.idx: already exists" in line
    (tmp_path / "s_web_text_document.idx").unlink()
    assert snapshot(tmp_path) == {**before, "b.jsonl": snapshot(tmp_path)["b.jsonl"]}

    (tmp_path / "empty.jsonl").write_bytes(b"")
    line = one_line(
        tool(
            "preprocess_data.py",
            "--input",
            str(tmp_path / "empty.jsonl"),
            "--tokenizer-model",
            tok,
            "--output-prefix",
            str(tmp_path / "e"),
        ),
        "preprocess_data.py",
    )
    assert line.endswith(
        f"no document under key 'text' or 'raw_content' in {tmp_path}/empty.jsonl: it holds no "
        "records; nothing to write"
    )
    (tmp_path / "keys.jsonl").write_text('{"content": "x", "id": 1}\n{"content": "y", "meta": {}}\n')
    line = one_line(
        tool(
            "preprocess_data.py",
            "--input",
            str(tmp_path / "keys.jsonl"),
            "--tokenizer-model",
            tok,
            "--output-prefix",
            str(tmp_path / "k"),
            "--workers",
            "2",
        ),
        "preprocess_data.py",
    )
    assert line.endswith(
        f"no document under key 'text' or 'raw_content' in {tmp_path}/keys.jsonl (skipped: "
        "missing_key=2; keys seen in the records: 'content', 'id', 'meta'): nothing to write; "
        "give --json-keys the key that holds the text"
    )
    assert not list(tmp_path.glob("e_*")) and not list(tmp_path.glob("k_*"))  # no dataset, no shards


def test_a_byte_order_mark_keeps_the_first_document(tmp_path, tiny_tokenizer_model):
    (tmp_path / "bom.jsonl").write_bytes('\ufeff{"text": "first"}\n{"text": "second"}\n'.encode())
    summary = preprocess(tmp_path / "bom.jsonl", tiny_tokenizer_model, tmp_path / "out", progress=False)
    tok = Tokenizer(tiny_tokenizer_model)
    ds = IndexedDataset(summary.outputs["text"])
    assert [ds[i].tolist() for i in range(len(ds))] == [tok.encode("first"), tok.encode("second")]
    assert not summary.skipped
    # a plain-text tokenizer input starting with a BOM: the mark is not a piece of the first line
    (tmp_path / "bom.txt").write_bytes("\ufeffdef f():\n    return 1\n".encode())
    from collections import Counter

    from megazpp.preprocess.tokenizer_training import iter_training_lines

    assert list(iter_training_lines([tmp_path / "bom.txt"], "text", Counter())) == ["def f():", "    return 1"]


def interrupt_at(cmd: list[str], point: str, cwd: Path) -> subprocess.CompletedProcess:
    """Start `cmd` in a process group of its own, stopped at pause point `point`
    (megazpp/pause.py); once it waits there, send SIGINT to the whole group (as Ctrl-C does) and
    collect it. The moment is the point, whatever the machine's load."""
    pause = cwd / f"paused-at-{point}"
    proc = subprocess.Popen(
        cmd,
        env=checkout_env(**paused_at(point, pause)),
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        preexec_fn=as_from_a_terminal,
    )
    try:
        wait_until_paused(proc, pause)
    except AssertionError:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise AssertionError(out[-2000:] + err[-2000:]) from None
    os.killpg(proc.pid, signal.SIGINT)
    out, err = proc.communicate(timeout=600)
    pause.unlink()
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


@pytest.fixture(scope="module")
def many_files(tmp_path_factory) -> Path:
    """8 JSONL files of ~0.5 MB of stdlib text: several files, each read in several chunks."""
    from megazpp.preprocess.sample_corpus import build_sample_corpus

    root = tmp_path_factory.mktemp("many")
    build_sample_corpus(root / "src", total_bytes=4_000_000)
    lines = [line for p in sorted((root / "src").glob("*.jsonl")) for line in p.read_text().splitlines()]
    (root / "in").mkdir()
    for i in range(8):
        (root / "in" / f"{i:02d}.jsonl").write_text("".join(f"{line}\n" for line in lines[i::8]))
    return root


@pytest.mark.slow
def test_ctrl_c_during_preprocessing_is_one_line_and_the_rerun_resumes(tmp_path, many_files, tiny_tokenizer_model):
    cmd = [
        sys.executable,
        str(ROOT / "tools" / "preprocess_data.py"),
        "--input",
        str(many_files / "in"),
        "--tokenizer-model",
        str(tiny_tokenizer_model),
        "--output-prefix",
        str(tmp_path / "out"),
        "--workers",
        "2",
        "--chunk-bytes",
        "4096",
        "--no-progress",
    ]
    shards = tmp_path / "out_shards"
    proc = interrupt_at(cmd, "preprocess_file_done", tmp_path)
    line = one_line(proc, "preprocess_data.py", 130, "interrupted")
    done = sorted(p.name for p in shards.glob("*.done.json"))
    assert line == (
        f"preprocess_data.py: interrupted (SIGINT): {len(done)} of 8 input files were finished and "
        f"are kept under {shards}/ (the same command resumes from them); the file in flight was removed"
    )
    assert len(done) == 1 and "Traceback" not in proc.stdout + proc.stderr  # paused after the first
    assert not list(tmp_path.glob("out_text_document*")) and not list(shards.glob("*.tmp*"))  # cleanup kept
    resumed = subprocess.run(cmd, env=checkout_env(), capture_output=True, text=True, timeout=900)
    assert resumed.returncode == 0, resumed.stderr
    assert f"; {len(done)} files were done by an earlier run" in resumed.stdout
    reference = preprocess(many_files / "in", tiny_tokenizer_model, tmp_path / "ref", workers=2, progress=False)
    for suffix in (".bin", ".idx"):
        assert (
            Path(f"{tmp_path}/out_text_document{suffix}").read_bytes()
            == Path(reference.outputs["text"] + suffix).read_bytes()
        )
    assert json.loads(Path(f"{tmp_path}/out_text_document.tokenizer.json").read_text())[
        "tokenizer_sha256"
    ] == model_sha256(tiny_tokenizer_model)


@pytest.mark.slow
def test_ctrl_c_during_the_tokenizer_build_is_one_line(tmp_path, many_files):
    (tmp_path / "earlier.model").write_bytes(b"an earlier model")  # what was there stays
    cmd = [
        sys.executable,
        str(ROOT / "tools" / "train_tokenizer.py"),
        "--input",
        str(many_files / "in"),
        "--vocab-size",
        "4000",
        "--out",
        str(tmp_path / "tok"),
        "--no-progress",
    ]
    proc = interrupt_at(cmd, "tokenizer_reading", tmp_path)
    line = one_line(proc, "train_tokenizer.py", 130, "interrupted")
    assert line == (
        f"train_tokenizer.py: interrupted (SIGINT): {tmp_path}/tok.model and {tmp_path}/tok.vocab "
        "were not written (the partial files were removed)"
    )
    assert "Traceback" not in proc.stdout + proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["earlier.model"]  # the pause file removed
    assert (tmp_path / "earlier.model").read_bytes() == b"an earlier model"


def test_the_tokenizer_build_never_overwrites_a_model(tmp_path, tiny_corpus_dir):
    (tmp_path / "tok.vocab").write_text("an earlier vocabulary")
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "tools" / "train_tokenizer.py"),
            "--input",
            str(tiny_corpus_dir),
            "--vocab-size",
            "300",
            "--out",
            str(tmp_path / "tok"),
        ],
        env=checkout_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    line = one_line(proc, "train_tokenizer.py")
    assert line == (
        f"train_tokenizer.py: error: {tmp_path}/tok.vocab: already exists; give another --out prefix "
        "or remove it (outputs are never overwritten)"
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tok.vocab"]
    assert (tmp_path / "tok.vocab").read_text() == "an earlier vocabulary"
