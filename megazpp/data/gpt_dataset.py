"""GPT training samples: fixed windows of `seq_length + 1` tokens over a shuffled document stream.

Three indices, as in Megatron, all built once and cached beside the data:
- document index: the split's documents, shuffled independently in each epoch and repeated
  for as many epochs as `num_samples` needs;
- sample index: where sample k starts in that stream, as (position in the document index,
  token offset). Sample k covers stream tokens [k*seq_length, (k+1)*seq_length], so
  consecutive samples share one token (the last label of k is the first input of k+1) and a
  sample runs straight across document boundaries;
- shuffle index: the order samples are served in. Samples of the last, partially used epoch
  are shuffled separately and placed last, so every sample of an epoch is served before any
  of the next.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from megazpp.data.index_cache import cache_key, load_or_build
from megazpp.data.indexed_dataset import IndexedDataset
from megazpp.errors import DataError

_INDEX_FORMAT = 1  # bump when the index construction changes: old caches then stop matching


class GPTDataset:
    """`ds[i]` -> int64 array of `seq_length + 1` tokens; `len(ds) == num_samples`."""

    def __init__(
        self,
        indexed: IndexedDataset,
        document_range: tuple[int, int],
        num_samples: int,
        seq_length: int,
        seed: int,
        name: str = "train",
        cache_dir: str | os.PathLike[str] | None = None,
    ):
        if seq_length < 1 or num_samples < 1:
            raise DataError(f"{indexed.prefix}: seq_length ({seq_length}) and num_samples ({num_samples}) must be >= 1")
        first, last = document_range
        if not 0 <= first < last <= indexed.num_documents:
            raise DataError(
                f"{indexed.prefix}: document range [{first}, {last}) is empty or outside "
                f"the {indexed.num_documents} documents"
            )
        self.indexed, self.seq_length, self.num_samples, self.name = indexed, seq_length, num_samples, name
        docs = indexed.document_indices
        # Every sequence of the documents in range; with GPT preprocessing, one per document.
        self.sequence_ids = np.arange(docs[first], docs[last], dtype=np.int64)
        lengths = indexed.sequence_lengths[self.sequence_ids]
        if int(lengths.sum()) == 0:
            raise DataError(f"{indexed.prefix}: documents [{first}, {last}) hold no tokens")
        description = {
            "format": _INDEX_FORMAT,
            "range": [first, last],
            "num_samples": num_samples,
            "seq_length": seq_length,
            "seed": seed,
            "name": name,
        }
        key = cache_key(description, lengths)
        base = Path(cache_dir) / Path(indexed.prefix).name if cache_dir else Path(indexed.prefix)
        paths = {kind: Path(f"{base}_{name}_{key}_{kind}_index.npy") for kind in ("document", "sample", "shuffle")}
        arrays, self.built_indices = load_or_build(paths, lambda: self._build_indices(lengths, seed))
        self.document_index = arrays["document"]
        self.sample_index = arrays["sample"]
        self.shuffle_index = arrays["shuffle"]
        self.cache_paths = paths

    def _build_indices(self, lengths: np.ndarray, seed: int) -> dict[str, np.ndarray]:
        seq, tokens_per_epoch = self.seq_length, int(lengths.sum())
        # Stream of E epochs holds (E * tokens - 1) // seq whole samples (each needs seq + 1 tokens).
        epochs = -(-(self.num_samples * seq + 1) // tokens_per_epoch)
        rng = np.random.default_rng(seed)
        document_index = np.concatenate([rng.permutation(self.sequence_ids) for _ in range(epochs)])
        stream_lengths = self.indexed.sequence_lengths[document_index].astype(np.int64)
        ends = np.cumsum(stream_lengths)
        total = (epochs * tokens_per_epoch - 1) // seq
        starts = np.arange(total, dtype=np.int64) * seq
        position = np.searchsorted(ends, starts, side="right")
        offset = starts - (ends[position] - stream_lengths[position])
        sample_index = np.stack([position, offset], axis=1)
        in_full_epochs = ((epochs - 1) * tokens_per_epoch - 1) // seq if epochs > 1 else 0
        shuffle_index = np.concatenate(
            [rng.permutation(in_full_epochs), in_full_epochs + rng.permutation(total - in_full_epochs)]
        )
        return {"document": document_index, "sample": sample_index, "shuffle": shuffle_index[: self.num_samples]}

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, i: int) -> np.ndarray:
        if not 0 <= i < self.num_samples:
            raise IndexError(f"sample {i} out of range for the {self.name} dataset of {self.num_samples} samples")
        position, offset = (int(v) for v in self.sample_index[self.shuffle_index[i]])
        needed = self.seq_length + 1
        out = np.empty(needed, dtype=np.int64)
        filled = 0
        while filled < needed:
            tokens = self.indexed.get(int(self.document_index[position]), offset)[: needed - filled]
            out[filled : filled + len(tokens)] = tokens
            filled += len(tokens)
            position, offset = position + 1, 0
        return out
