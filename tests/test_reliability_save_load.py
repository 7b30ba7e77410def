"""Checkpoint faults the atomic protocol alone did not cover, tried as a user would
(`pretrain_gpt.py` in a subprocess, real files, real mounts): an unwritable `--save` (a file,
a read-only mount), a mistyped `--load` that used to roll `latest` back, a flipped bit in a
rank file, and a disk that fills during a save. Mounts need root (CAP_SYS_ADMIN); without it
those parts are skipped, saying so."""

from __future__ import annotations

import contextlib
import hashlib
import json
import struct
import subprocess
import zipfile
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
from support import QUIET_FLAGS
from test_reliability_inputs import pretrain, refused
from test_training_pretrain import tiny_args

import pretrain_gpt
from megazpp.checkpoint.load import load_checkpoint

RANK_FILE = "rank_tp00_pp000_dp0000.pt"
ONE_RANK = SimpleNamespace(rank=0, world_size=1, tp=1, pp=1, dp=1, tp_rank=0, pp_rank=0, dp_rank=0)


def hashes(directory: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.iterdir())}


@contextlib.contextmanager
def mounted(target: Path, *mount_args: str) -> Iterator[None]:
    """`mount ... target` for the block, unmounted after; skips the test where not allowed."""
    target.mkdir(parents=True, exist_ok=True)
    made = subprocess.run(["mount", *mount_args, str(target)], capture_output=True, text=True)
    if made.returncode:
        pytest.skip(f"cannot mount here ({made.stderr.strip()}): needs root")
    try:
        yield
    finally:
        subprocess.run(["umount", str(target)], check=True)


@contextlib.contextmanager
def read_only(directory: Path) -> Iterator[None]:
    """`directory` as a read-only bind mount of itself (chmod does not stop root)."""
    with mounted(directory, "--bind", str(directory)):
        subprocess.run(["mount", "-o", "remount,ro,bind", str(directory)], check=True)
        yield


@pytest.mark.slow
def test_an_unwritable_save_stops_before_step_1(tmp_path, tiny_indexed_prefix, tiny_tokenizer_model):
    args = tiny_args(tiny_indexed_prefix, tiny_tokenizer_model, "--train-iters", "2", "--eval-iters", "0")
    not_a_dir = tmp_path / "README.md"
    not_a_dir.write_text("notes\n")
    line = refused(pretrain(*args, "--save", str(not_a_dir)))  # trained, then FileExistsError
    assert line.endswith(
        f"--save {not_a_dir} exists and is not a directory: give a directory (it is created when missing)"
    )
    assert not_a_dir.read_text() == "notes\n"
    mount = tmp_path / "ro"
    with read_only(mount):  # failed only at the first save, after the steps before it
        line = refused(pretrain(*args, "--save", str(mount / "ckpt")))
        assert line.endswith(
            f"--save {mount / 'ckpt'} is not writable: rank 0: cannot write in {mount / 'ckpt'} (Read-only file system)"
        )


@pytest.mark.slow
def test_a_mistyped_load_is_refused_and_latest_never_moves_back(tmp_path, tiny_indexed_prefix, tiny_tokenizer_model):
    real, typo = tmp_path / "checkpoints" / "llama_tiny", tmp_path / "checkpoints" / "llama_tyni"
    args = tiny_args(
        tiny_indexed_prefix, tiny_tokenizer_model, "--eval-iters", "0", "--log-interval", "100", "--save", str(real)
    )
    pretrain_gpt.main(args + ["--train-iters", "4"])
    before = hashes(real / "iter_0000004")

    # the second run started from scratch and moved latest from 4 back to 3
    line = refused(pretrain(*args, "--train-iters", "3", "--load", str(typo)))
    assert line.endswith(
        f"--load {typo}: nothing to load, {typo} does not exist (did you mean "
        f"{real}?); pass --load-optional to start from scratch when it holds "
        "no checkpoint"
    )
    # starting from scratch on purpose still may not roll back the newer checkpoints
    line = refused(pretrain(*args, "--train-iters", "3", "--load", str(typo), "--load-optional"))
    assert line.endswith(
        f"--save {real}: its latest names iter_0000004, newer than this run's "
        "start at iteration 0; saving would move latest back and overwrite the "
        "newer checkpoints. Resume it (--load with that directory), save "
        "elsewhere, or pass --overwrite-newer-checkpoints"
    )
    assert (real / "latest").read_text() == "iter_0000004\n"
    assert hashes(real / "iter_0000004") == before
    # an empty --load directory is "nothing to load" as well
    typo.mkdir()
    with pytest.raises(Exception, match=f"--load {typo}: nothing to load, {typo} holds no latest"):
        pretrain_gpt.main(args + ["--train-iters", "3", "--load", str(typo)])
    # with both flags the user gets what they asked for
    fresh = pretrain_gpt.main(
        args + ["--train-iters", "3", "--load", str(typo), "--load-optional", "--overwrite-newer-checkpoints"]
    )
    assert fresh.resumed_from is None and sorted(fresh.losses) == [1, 2, 3]
    assert (real / "latest").read_text() == "iter_0000003\n"


def flip_exponent_bit(rank_file: Path) -> None:
    """Flip the top exponent bit of the first float32 of the first tensor stored in a torch
    zip checkpoint (stored uncompressed), as a bad disk or memory would."""
    with zipfile.ZipFile(rank_file) as archive:
        info = next(i for i in archive.infolist() if i.filename.endswith("/data/0"))
    with open(rank_file, "r+b") as f:
        f.seek(info.header_offset)
        header = f.read(30)
        name_len, extra_len = struct.unpack("<HH", header[26:30])
        at = info.header_offset + 30 + name_len + extra_len + 3  # little-endian: byte 3 = sign|exp
        f.seek(at)
        byte = f.read(1)[0]
        f.seek(at)
        f.write(bytes([byte ^ 0x40]))


@pytest.mark.slow
def test_a_flipped_bit_in_a_checkpoint_is_refused(tmp_path, tiny_indexed_prefix, tiny_tokenizer_model):
    ckpt = tmp_path / "ckpt"
    args = tiny_args(
        tiny_indexed_prefix,
        tiny_tokenizer_model,
        *QUIET_FLAGS,
        "--save",
        str(ckpt),
        "--save-interval",
        "2",
    )
    pretrain_gpt.main(args + ["--train-iters", "4"])
    rank_file = ckpt / "iter_0000004" / RANK_FILE
    flip_exponent_bit(rank_file)

    # continuing with a longer schedule is a settings change: --load says so (the resume rule)
    line = refused(pretrain(*args, "--train-iters", "6", "--load", str(ckpt)))
    assert f"{rank_file}: checksum mismatch (sha256:" in line
    assert line.endswith(
        "the file changed after it was written (disk, copy or memory "
        "corruption) (pass --load-fallback to load the previous complete "
        "checkpoint)"
    )
    # what the checksum prevents: without it the damaged file loads, one weight ~1e36
    meta_file = ckpt / "iter_0000004" / "metadata.json"
    meta = json.loads(meta_file.read_text())
    meta_file.write_text(json.dumps({k: v for k, v in meta.items() if k != "checksums"}))
    weights = load_checkpoint(ckpt, ONE_RANK).state["model"]
    assert max(float(t.abs().max()) for t in weights.values() if t.is_floating_point()) > 1e30
    meta_file.write_text(json.dumps(meta))
    with pytest.warns(UserWarning, match="loading .*iter_0000002 instead"):
        fallback = pretrain_gpt.main(args + ["--train-iters", "6", "--load", str(ckpt), "--load-fallback"])
    assert fallback.resumed_from == 2


@pytest.mark.slow
def test_a_full_disk_during_a_save_leaves_no_partial_and_latest_as_it_was(
    tmp_path, tiny_indexed_prefix, tiny_tokenizer_model
):
    args = tiny_args(
        tiny_indexed_prefix,
        tiny_tokenizer_model,
        *QUIET_FLAGS,
        "--save-interval",
        "2",
        "--train-iters",
        "4",
    )
    probe = tmp_path / "probe"
    pretrain_gpt.main(args + ["--save", str(probe), "--exit-interval", "2"])
    rank_bytes = (probe / "iter_0000002" / RANK_FILE).stat().st_size
    pages = -(-rank_bytes // 4096)
    disk = tmp_path / "small_disk"  # room for one checkpoint and a half, not two
    with mounted(disk, "-t", "tmpfs", "-o", f"size={(pages + pages // 2 + 4) * 4096}", "tmpfs"):
        ckpt = disk / "ckpt"
        proc = pretrain(*args, "--save", str(ckpt))
        line = refused_after_training(proc)
        assert line.endswith(
            f"checkpoint iter_0000004 was not saved: rank 0: no space left on the device of "
            f"{ckpt / 'iter_0000004.tmp'} (writing {RANK_FILE}; No space left on device): the "
            f"partial file was removed; {ckpt / 'latest'} is unchanged"
        )
        assert (ckpt / "latest").read_text() == "iter_0000002\n"
        assert sorted(p.name for p in ckpt.iterdir()) == ["iter_0000002", "latest"]
        # the same run: equal rank files (metadata.json also records each run's own --save)
        same, other = hashes(ckpt / "iter_0000002"), hashes(probe / "iter_0000002")
        assert same.pop("metadata.json") and other.pop("metadata.json") and same == other
        assert load_checkpoint(ckpt, ONE_RANK).path.name == "iter_0000002"


def refused_after_training(proc: subprocess.CompletedProcess) -> str:
    """The single error line of a run that failed while saving, after its steps."""
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("pretrain_gpt.py: error: "), proc.stderr
    return lines[0]
