"""Tokenizer training and the Tokenizer wrapper: Llama ids, exact round trip, clear failures."""

import json

import pytest

from megazpp.data.tokenizer import Tokenizer
from megazpp.errors import DataError
from megazpp.preprocess.tokenizer_training import train_tokenizer


def test_llama_style_special_ids_and_vocab(tiny_tokenizer_model):
    tok = Tokenizer(tiny_tokenizer_model)
    assert (tok.vocab_size, tok.unk_id, tok.bos_id, tok.eos_id, tok.pad_id, tok.eod_id) == (512, 0, 1, 2, 3, 2)


@pytest.mark.parametrize(
    "text",
    [
        "def f(x):\n    return x  # indentation and newlines are content\n\n\n",
        "  leading spaces,\ttabs and trailing spaces  ",
        "Unicode: héllo wörld ☃ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 ünseen 中文",
        "digits 1234567890",
    ],
)
def test_decode_gives_the_text_back(tiny_tokenizer_model, text):
    tok = Tokenizer(tiny_tokenizer_model)
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert tok.encode_batch([text, "x"]) == [ids, tok.encode("x")]
    assert tok.unk_id not in ids  # byte fallback: nothing is unknown


def test_characters_outside_the_vocabulary_fall_back_to_bytes(tiny_tokenizer_model):
    tok = Tokenizer(tiny_tokenizer_model)
    ids = tok.encode("中")  # three UTF-8 bytes, not in a 512-piece vocabulary learned from Python
    assert ids == [4 + b for b in "中".encode()]  # <0x00> is id 4, right after the specials


def test_training_is_deterministic_and_counts_skipped_records(tmp_path, tiny_corpus_dir):
    lines = (tiny_corpus_dir / "stdlib_docs.jsonl").read_text(encoding="utf-8").splitlines()
    (tmp_path / "in.jsonl").write_text("\n".join(lines + ["{broken", json.dumps({"raw_content": "v2 text"})]) + "\n")
    first, skipped = train_tokenizer([tmp_path / "in.jsonl"], 400, tmp_path / "a")
    second, _ = train_tokenizer([tmp_path / "in.jsonl"], 400, tmp_path / "b")
    # the .model also records its (differing) output prefix; the learned pieces and scores must match
    assert (tmp_path / "a.vocab").read_bytes() == (tmp_path / "b.vocab").read_bytes()
    assert dict(skipped) == {"malformed_json": 1}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.model", "a.vocab", "b.model", "b.vocab", "in.jsonl"]


def test_unusable_models_and_inputs_are_named(tmp_path):
    with pytest.raises(DataError, match=r"tokenizer model .*absent\.model does not exist"):
        Tokenizer(tmp_path / "absent.model")
    (tmp_path / "bad.model").write_bytes(b"\x00garbage")
    with pytest.raises(DataError, match=r"bad\.model is not a valid SentencePiece model"):
        Tokenizer(tmp_path / "bad.model")
    with pytest.raises(DataError, match=r"training input .*nope\.jsonl does not exist"):
        train_tokenizer([tmp_path / "nope.jsonl"], 512, tmp_path / "t")
    with pytest.raises(DataError, match="vocab-size 100 is too small"):
        train_tokenizer([tmp_path / "bad.model"], 100, tmp_path / "t")
    # more distinct characters than a 262-piece vocabulary can hold next to 256 byte pieces
    (tmp_path / "chars.txt").write_text("".join(chr(0x4E00 + i) * 3 + "\n" for i in range(50)))
    with pytest.raises(DataError, match=r"SentencePiece training on .*chars\.txt.* vocab size 262 failed"):
        train_tokenizer([tmp_path / "chars.txt"], 262, tmp_path / "t")
    assert not list(tmp_path.glob("t*"))
