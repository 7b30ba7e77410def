"""A SentencePiece model built like the tokenizer.model shipped with Llama checkpoints (no pad
piece, unk 0 / bos 1 / eos 2, dummy prefix, byte fallback) works wherever megazpp takes
`--tokenizer-model`, and the converters check it against a model's vocabulary and ids."""

from __future__ import annotations

import json

import pytest
import sentencepiece as spm
import torch

from megazpp.config.load import load_config
from megazpp.data.indexed_dataset import IndexedDataset
from megazpp.data.tokenizer import Tokenizer
from megazpp.errors import DataError
from megazpp.interop.convert import import_hf
from megazpp.interop.hf_llama import hf_config_from_model, megazpp_to_hf
from megazpp.interop.safetensors_io import write_hf_weights
from megazpp.interop.tokenizer_check import check_tokenizer
from megazpp.model.config import ModelConfig
from megazpp.model.gpt import GPTModel
from megazpp.preprocess.jsonl import extract_text
from megazpp.preprocess.pipeline import preprocess

LLAMA_LIKE_VOCAB = 700


@pytest.fixture(scope="module")
def llama_like_tokenizer(tiny_corpus_dir, tmp_path_factory):
    """Trained with Llama's SentencePiece settings (its trainer spec, not ours)."""
    lines = []
    for path in sorted(tiny_corpus_dir.glob("*.jsonl")):
        for raw in path.read_bytes().splitlines():
            text = extract_text(raw, "text")
            if isinstance(text, str):
                lines.extend(line for line in text.split("\n") if line.strip())
    prefix = tmp_path_factory.mktemp("llama_tok") / "tokenizer"
    spm.SentencePieceTrainer.Train(
        sentence_iterator=iter(lines),
        model_prefix=str(prefix),
        model_type="bpe",
        vocab_size=LLAMA_LIKE_VOCAB,
        byte_fallback=True,
        split_digits=True,
        normalization_rule_name="identity",
        add_dummy_prefix=True,
        remove_extra_whitespaces=False,
        unk_id=0,
        bos_id=1,
        eos_id=2,
        pad_id=-1,
        input_sentence_size=20_000,
        minloglevel=2,
    )
    return prefix.with_suffix(".model")


def test_llama_tokenizer_model_works_as_tokenizer_model(llama_like_tokenizer, tiny_corpus_dir, tmp_path):
    tok = Tokenizer(llama_like_tokenizer)
    assert (tok.vocab_size, tok.unk_id, tok.bos_id, tok.eos_id, tok.pad_id, tok.eod_id) == (
        LLAMA_LIKE_VOCAB,
        0,
        1,
        2,
        -1,
        2,
    )
    sp = spm.SentencePieceProcessor(model_file=str(llama_like_tokenizer))
    text = "def main(argv):\n    return 42  # ünïcode ☃"
    assert tok.encode(text) == sp.encode(text)
    assert tok.decode(tok.encode(text)) == text
    summary = preprocess(
        tiny_corpus_dir, llama_like_tokenizer, tmp_path / "llama", workers=1, append_eod=True, progress=False
    )
    dataset = IndexedDataset(summary.outputs["text"])
    assert len(dataset) == summary.documents["text"] > 0
    assert all(dataset[i][-1] == 2 for i in range(len(dataset)))
    assert int(max(dataset[i].max() for i in range(len(dataset)))) < LLAMA_LIKE_VOCAB
    cfg = load_config(["--tokenizer-model", str(llama_like_tokenizer)])
    assert cfg.model.vocab_size == 768  # padded up to a multiple of 128


def test_check_against_model_and_hf_config(llama_like_tokenizer):
    check_tokenizer(llama_like_tokenizer, 768, {"bos_token_id": 1, "eos_token_id": [2, 7]})
    with pytest.raises(DataError, match="more than the model's vocab_size 512"):
        check_tokenizer(llama_like_tokenizer, 512)
    with pytest.raises(DataError, match="eos id is 2, but config.json has eos_token_id = 3"):
        check_tokenizer(llama_like_tokenizer, 768, {"bos_token_id": 1, "eos_token_id": 3})
    with pytest.raises(DataError, match="bos"):
        check_tokenizer(llama_like_tokenizer, 768, {"bos_token_id": 128000})


def test_tokenizer_travels_with_an_import(llama_like_tokenizer, tmp_path):
    """import_hf checks the HF directory's tokenizer.model and copies it next to the
    checkpoint; a mismatching one stops the import before anything is written."""
    cfg = ModelConfig(
        arch="llama",
        num_layers=1,
        hidden_size=16,
        num_attention_heads=2,
        ffn_hidden_size=32,
        vocab_size=768,
        seq_length=8,
    )
    hf_dir = tmp_path / "hf"
    hf_dir.mkdir()
    config = dict(hf_config_from_model(cfg, torch.float32), bos_token_id=1, eos_token_id=2)
    (hf_dir / "config.json").write_text(json.dumps(config))
    write_hf_weights(hf_dir, megazpp_to_hf(dict(GPTModel(cfg).named_parameters()), cfg))
    (hf_dir / "tokenizer.model").write_bytes(llama_like_tokenizer.read_bytes())
    import_hf(hf_dir, tmp_path / "ok")
    assert (tmp_path / "ok" / "tokenizer.model").read_bytes() == llama_like_tokenizer.read_bytes()
    (hf_dir / "config.json").write_text(json.dumps(dict(config, eos_token_id=5)))
    with pytest.raises(DataError, match="eos_token_id = 5"):
        import_hf(hf_dir, tmp_path / "bad")
    assert not (tmp_path / "bad").exists()
