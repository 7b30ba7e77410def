"""RedPajama-V2's layout (documents/, quality_signals/, duplicates/) joined by document id,
filtered by rules, split by snapshot; damaged signals files named with their line."""

import gzip
import json
import re
from pathlib import Path

import pytest
from support import load_tool

from megazpp.data.indexed_dataset import IndexedDataset
from megazpp.data.tokenizer import Tokenizer
from megazpp.errors import DataError
from megazpp.preprocess.pipeline import preprocess
from megazpp.preprocess.redpajama_v2 import have_pyarrow
from megazpp.preprocess.signal_filter import DUPLICATE_RULE, FilterSpec

SHARDS = {
    "2023-06/0000/en_head": 40,
    "2023-06/0000/en_middle": 30,
    "2023-06/0000/en_tail": 10,
    "2023-14/0001/en_head": 25,
}
WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()
RULES = (
    "rps_doc_word_count >= 5",
    "ccnet_perplexity < 600",
    "rps_doc_ml_palm_score > 0.15 or mean(rps_lines_num_words) >= 3.5",
)


def _document(base: str, row: int) -> tuple[str, dict]:
    seed = sum(map(ord, base)) + row
    n = seed * 7 % 23 + 1
    words = [WORDS[(seed + k) % len(WORDS)] for k in range(n)]
    lines = [" ".join(words[k : k + 4]) for k in range(0, n, 4)]
    text = "\n".join(lines)
    spans, start = [], 0
    for line in lines:
        spans.append([start, start + len(line), len(line.split())])
        start += len(line) + 1
    palm = None if seed % 5 == 0 else round(0.1 * (seed % 10), 2)
    signals = {
        "rps_doc_word_count": [[0, len(text), n]],
        "ccnet_perplexity": [[0, len(text), 100 + seed * 37 % 900]],
        "rps_lines_num_words": spans,
        "rps_doc_ml_palm_score": [[0, len(text), palm]],
    }
    return text, signals


def build_layout(root: Path) -> dict[str, list[tuple[str, dict]]]:
    """Writes the published layout; the tail partition, as published, has no signals."""
    docs = {}
    for base, n in SHARDS.items():
        docs[base] = [_document(base, row) for row in range(n)]
        doc_path = root / "documents" / f"{base}.json.gz"
        doc_path.parent.mkdir(parents=True, exist_ok=True)
        doc_path.write_bytes(
            gzip.compress(
                b"".join(
                    json.dumps({"url": f"https://x/{row}", "raw_content": text, "language": "en"}).encode() + b"\n"
                    for row, (text, _) in enumerate(docs[base])
                )
            )
        )
        if not base.endswith("tail"):
            sig_path = root / "quality_signals" / f"{base}.signals.json.gz"
            sig_path.parent.mkdir(parents=True, exist_ok=True)
            sig_path.write_bytes(gzip.compress(_signal_lines(base, docs[base])))
    return docs


def _signal_lines(base: str, docs: list[tuple[str, dict]]) -> bytes:
    return b"".join(
        json.dumps(
            {
                "id": f"{base}.json.gz/{row}",
                "id_int": row,
                "metadata": {"snapshot_id": base[:7]},
                "quality_signals": signals,
            }
        ).encode()
        + b"\n"
        for row, (_, signals) in enumerate(docs)
    )


def oracle(signals: dict) -> tuple[str, bool] | None:
    """The rules of RULES written out by hand: (first failing rule, unevaluable) or None."""
    if signals["rps_doc_word_count"][0][2] < 5:
        return RULES[0], False
    if signals["ccnet_perplexity"][0][2] >= 600:
        return RULES[1], False
    palm = signals["rps_doc_ml_palm_score"][0][2]
    if palm is None:
        return RULES[2], True
    per_line = [s[2] for s in signals["rps_lines_num_words"]]
    return None if palm > 0.15 or sum(per_line) / len(per_line) >= 3.5 else (RULES[2], False)


def test_filters_keep_exactly_what_the_rules_say_and_count_per_rule(tiny_tokenizer_model, tmp_path):
    docs = build_layout(tmp_path / "rpv2")
    summary = preprocess(
        tmp_path / "rpv2",
        tiny_tokenizer_model,
        tmp_path / "out",
        workers=2,
        chunk_bytes=512,
        filters=FilterSpec(RULES),
        progress=False,
    )
    kept, dropped, unevaluable = [], {}, {}
    for base in sorted(SHARDS):
        if base.endswith("tail"):
            continue
        for text, signals in docs[base]:
            verdict = oracle(signals)
            if verdict is None:
                kept.append(text)
            else:
                dropped[verdict[0]] = dropped.get(verdict[0], 0) + 1
                unevaluable[verdict[0]] = unevaluable.get(verdict[0], 0) + verdict[1]
    assert all(dropped.get(r) for r in RULES) and unevaluable[RULES[2]] and kept  # every path exercised
    assert dict(summary.dropped) == dropped and list(summary.dropped) == list(RULES)  # listed in rule order
    assert {r: n for r, n in summary.unevaluable.items() if n} == {r: n for r, n in unevaluable.items() if n}
    assert dict(summary.skipped) == {"missing_signals": SHARDS["2023-06/0000/en_tail"]}
    tok = Tokenizer(tiny_tokenizer_model)
    ds = IndexedDataset(summary.outputs["text"])
    assert [ds[i].tolist() for i in range(len(ds))] == [tok.encode(t) for t in kept]
    assert f"[{RULES[2]}]={dropped[RULES[2]]} ({unevaluable[RULES[2]]} unevaluable)" in summary.line()


def test_cli_filter_file_and_split_by_snapshot(tiny_tokenizer_model, tmp_path, capsys):
    docs = build_layout(tmp_path / "rpv2")
    rules = tmp_path / "rules.yaml"
    rules.write_text("rules:\n  - " + RULES[0] + "\n")
    assert (
        load_tool("preprocess_data").main(
            [
                "--input",
                str(tmp_path / "rpv2" / "documents" / "**" / "*.json.gz"),
                "--tokenizer-model",
                str(tiny_tokenizer_model),
                "--output-prefix",
                str(tmp_path / "out"),
                "--filter-file",
                str(rules),
                "--filter",
                RULES[1],
                "--split-by-source",
                "--no-progress",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    tok = Tokenizer(tiny_tokenizer_model)
    for snapshot in ("2023-06", "2023-14"):
        expected = [
            text
            for base in sorted(SHARDS)
            if base.startswith(snapshot) and not base.endswith("tail")
            for text, signals in docs[base]
            if oracle(signals) in (None, (RULES[2], False), (RULES[2], True))
        ]
        ds = IndexedDataset(tmp_path / f"out_{snapshot}_text_document")
        assert [ds[i].tolist() for i in range(len(ds))] == [tok.encode(t) for t in expected]
        assert f"out_{snapshot}_text_document.bin/.idx: {len(expected)} documents" in out
    assert not (tmp_path / "out_shards").exists()


def test_truncated_and_misaligned_signals_are_named_and_skip_only_what_they_must(tiny_tokenizer_model, tmp_path):
    docs = build_layout(tmp_path / "rpv2")
    head, middle = "2023-06/0000/en_head", "2023-06/0000/en_middle"
    whole = gzip.compress(_signal_lines(head, docs[head]))
    (tmp_path / "rpv2" / "quality_signals" / f"{head}.signals.json.gz").write_bytes(whole[: len(whole) * 2 // 3])
    lines = _signal_lines(middle, docs[middle]).splitlines(keepends=True)
    lines[4], lines[5] = lines[5], lines[4]
    (tmp_path / "rpv2" / "quality_signals" / f"{middle}.signals.json.gz").write_bytes(gzip.compress(b"".join(lines)))
    summary = preprocess(
        tmp_path / "rpv2", tiny_tokenizer_model, tmp_path / "out", filters=FilterSpec(RULES[:1]), progress=False
    )
    [damage] = summary.damage
    assert f"{head}.signals.json.gz: cannot read past line" in damage and "no signals" in damage
    read = int(re.search(r"cannot read past line (\d+)", damage).group(1))
    assert 0 < read < SHARDS[head]
    assert summary.skipped == {
        "missing_signals": SHARDS[head] - read + SHARDS["2023-06/0000/en_tail"],
        "signals_id_mismatch": 2,
    }
    expected = (
        [t for t, s in docs[head][:read] if oracle(s) != (RULES[0], False)]
        + [t for row, (t, s) in enumerate(docs[middle]) if row not in (4, 5) and oracle(s) != (RULES[0], False)]
        + [t for t, s in docs["2023-14/0001/en_head"] if oracle(s) != (RULES[0], False)]
    )
    tok = Tokenizer(tiny_tokenizer_model)
    ds = IndexedDataset(summary.outputs["text"])
    assert [ds[i].tolist() for i in range(len(ds))] == [tok.encode(t) for t in expected]


def test_duplicates_listed_in_parquet_are_dropped(tiny_tokenizer_model, tmp_path):
    docs = build_layout(tmp_path / "rpv2")
    head = "2023-06/0000/en_head"
    rows = [0, 3, 17, 39]
    path = tmp_path / "rpv2" / "duplicates" / f"{head}.duplicates.parquet"
    path.parent.mkdir(parents=True)
    spec = FilterSpec(drop_duplicates=True)
    if not have_pyarrow():
        path.write_bytes(b"PAR1 not readable without pyarrow PAR1")
        with pytest.raises(
            DataError,
            match=r"en_head\.duplicates\.parquet, a parquet file, which needs pyarrow: "
            r"pip install 'megazpp\[redpajama\]'",
        ):
            preprocess(tmp_path / "rpv2", tiny_tokenizer_model, tmp_path / "out", filters=spec, progress=False)
        assert not list(tmp_path.glob("out*"))
        return
    import pyarrow as pa
    import pyarrow.parquet as pq

    ids = [f"{head}.json.gz/{r}" for r in rows] + ["2023-06/0000/en_middle.json.gz/1"]  # another file's id: ignored
    pq.write_table(pa.table({"doc_id": ids}), path)
    summary = preprocess(
        tmp_path / "rpv2",
        tiny_tokenizer_model,
        tmp_path / "out",
        filters=spec,
        workers=2,
        chunk_bytes=256,
        progress=False,
    )
    assert dict(summary.dropped) == {DUPLICATE_RULE: len(rows)} and not summary.skipped
    expected = [
        t for base in sorted(SHARDS) for row, (t, _) in enumerate(docs[base]) if not (base == head and row in rows)
    ]
    tok = Tokenizer(tiny_tokenizer_model)
    ds = IndexedDataset(summary.outputs["text"])
    assert [ds[i].tolist() for i in range(len(ds))] == [tok.encode(t) for t in expected]


def test_filters_that_cannot_act_are_refused_before_any_work(tiny_tokenizer_model, tmp_path):
    (tmp_path / "v1").mkdir()
    (tmp_path / "v1" / "a.jsonl").write_text('{"text": "no signals here"}\n')
    with pytest.raises(DataError, match="filter rules need RedPajama-V2 quality signals, but none of the 1 input"):
        preprocess(tmp_path / "v1", tiny_tokenizer_model, tmp_path / "out", filters=FilterSpec(RULES), progress=False)
    with pytest.raises(DataError, match="--drop-duplicates needs RedPajama-V2's layout"):
        preprocess(
            tmp_path / "v1",
            tiny_tokenizer_model,
            tmp_path / "out",
            filters=FilterSpec(drop_duplicates=True),
            progress=False,
        )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["v1"]
