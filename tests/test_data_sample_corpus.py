"""The embedded sample corpus: RedPajama v1 layout, two sources, >= 5 MB, byte-identical."""

import json

import pytest

from megazpp.preprocess.sample_corpus import CODE_SOURCE, DOCS_SOURCE, build_sample_corpus


@pytest.mark.slow
def test_default_corpus_is_redpajama_v1_and_byte_identical(tmp_path):
    first = build_sample_corpus(tmp_path / "a")
    second = build_sample_corpus(tmp_path / "b")
    assert set(first.files) == {CODE_SOURCE, DOCS_SOURCE}
    assert sum(first.bytes.values()) >= 5_000_000
    for source, path in first.files.items():
        data = path.read_bytes()
        assert data == second.files[source].read_bytes()
        assert path.name == f"{source}.jsonl" and first.bytes[source] == len(data) > 1_000_000
        records = [json.loads(line) for line in data.decode("utf-8").splitlines()]
        assert len(records) == first.documents[source]
        assert all(set(r) == {"text", "meta"} and r["meta"]["source"] == source and r["text"].strip() for r in records)
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == ["stdlib_code.jsonl", "stdlib_docs.jsonl"]


def test_small_budget_keeps_both_sources(tmp_path):
    summary = build_sample_corpus(tmp_path, total_bytes=50_000)
    assert all(0 < summary.bytes[s] <= 50_000 for s in summary.files)
    assert summary.documents[DOCS_SOURCE] > 0 and summary.documents[CODE_SOURCE] > 0
