"""`.jsonl.zst` input: the same dataset as plain JSONL, multi-frame files, and damaged files named
with their last good line while everything read before the damage is kept."""

import json
import random
import re
from pathlib import Path

import pytest
import zstandard

from megazpp.data.indexed_dataset import IndexedDataset
from megazpp.data.tokenizer import Tokenizer
from megazpp.errors import DataError
from megazpp.preprocess.compressed import zstd_damage
from megazpp.preprocess.jsonl import iter_line_chunks
from megazpp.preprocess.pipeline import preprocess

_WORDS = "data token model shard corpus frame block line signal source merge resume".split()
_RNG = random.Random(0)
# varied text, so zstd's blocks are not one long back-reference and a cut leaves whole blocks before it
DOCS = [f"document {i}: " + " ".join(_RNG.choices(_WORDS, k=5 + i % 30)) for i in range(3000)]
PAYLOAD = b"".join(json.dumps({"text": t}).encode() + b"\n" for t in DOCS)


def _zstd(data: bytes, **kwargs) -> bytes:
    return zstandard.ZstdCompressor(**kwargs).compress(data)


def test_zst_gives_the_bytes_plain_jsonl_gives(tiny_tokenizer_model, tmp_path):
    (tmp_path / "plain").mkdir()
    (tmp_path / "zst").mkdir()
    (tmp_path / "plain" / "a.jsonl").write_bytes(PAYLOAD)
    half = len(PAYLOAD) // 2 + PAYLOAD[len(PAYLOAD) // 2 :].index(b"\n") + 1
    # two frames (as pzstd and concatenated downloads write them), one of them with a checksum
    (tmp_path / "zst" / "a.jsonl.zst").write_bytes(_zstd(PAYLOAD[:half]) + _zstd(PAYLOAD[half:], write_checksum=True))
    outs = {}
    for name, workers in (("plain", 1), ("zst", 2)):
        summary = preprocess(
            tmp_path / name,
            tiny_tokenizer_model,
            tmp_path / f"out_{name}",
            workers=workers,
            chunk_bytes=4096,
            progress=False,
        )
        assert not summary.damage and not summary.skipped and summary.documents["text"] == len(DOCS)
        outs[name] = [Path(summary.outputs["text"] + s).read_bytes() for s in (".bin", ".idx")]
    assert outs["plain"] == outs["zst"]


def test_every_cut_of_a_zstd_file_is_detected(tmp_path):
    data = _zstd(PAYLOAD[:20000], write_checksum=True) + _zstd(PAYLOAD[20000:40000])
    assert zstd_damage(_write(tmp_path / "whole.zst", data)) is None
    for cut in range(1, len(data), 97):
        assert zstd_damage(_write(tmp_path / "cut.zst", data[:cut])) is not None, cut


def _write(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


@pytest.mark.parametrize("damage", ["truncated", "corrupt"])
def test_damaged_zst_names_file_and_line_and_keeps_the_rest_of_the_run(tiny_tokenizer_model, tmp_path, damage):
    data = bytearray(_zstd(PAYLOAD, write_checksum=True))
    if damage == "truncated":
        data = data[: len(data) // 2]
    else:
        data[len(data) // 2] ^= 0xFF  # caught by the frame checksum at the end of the frame
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a_bad.jsonl.zst").write_bytes(bytes(data))
    good = 10
    (tmp_path / "in" / "b_good.jsonl.zst").write_bytes(_zstd(b"".join(PAYLOAD.splitlines(keepends=True)[:good])))
    with pytest.raises(DataError, match=r"a_bad\.jsonl\.zst: cannot read past line \d+, truncated or corrupt"):
        [line for chunk in iter_line_chunks(tmp_path / "in" / "a_bad.jsonl.zst", 4096) for line in chunk]
    summary = preprocess(tmp_path / "in", tiny_tokenizer_model, tmp_path / "out", chunk_bytes=4096, progress=False)
    [message] = summary.damage
    kept = int(re.search(r"a_bad\.jsonl\.zst: cannot read past line (\d+)", message).group(1))
    assert 0 < kept < len(DOCS)
    ds = IndexedDataset(summary.outputs["text"])
    tok = Tokenizer(tiny_tokenizer_model)
    # a corrupt block may garble text before the checksum catches it; every kept line still parsed
    assert len(ds) + sum(summary.skipped.values()) == kept + good
    assert ds[len(ds) - 1].tolist() == tok.encode(DOCS[good - 1])
    if damage == "truncated":
        assert not summary.skipped and [ds[i].tolist() for i in (0, kept - 1)] == [
            tok.encode(DOCS[0]),
            tok.encode(DOCS[kept - 1]),
        ]
