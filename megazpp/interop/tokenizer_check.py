"""Does a SentencePiece `tokenizer.model` (as shipped with Llama checkpoints) fit a model?

Llama's tokenizer has no pad piece (pad_id -1) and ids unk 0, bos 1, eos 2; megazpp's
Tokenizer accepts that (it needs only an eos, its end-of-document token). What can go wrong
when the tokenizer travels with a checkpoint is a mismatch: ids the embedding does not have,
or bos/eos ids that differ from the ones the model was trained with. Both are checked here
before a converted model is written, rather than discovered as garbage text later.
"""

from __future__ import annotations

import os

from megazpp.data.tokenizer import Tokenizer
from megazpp.errors import DataError
from megazpp.unique_keys import JSONObject


def check_tokenizer(
    tokenizer_model: str | os.PathLike[str], vocab_size: int, hf_config: JSONObject | None = None
) -> Tokenizer:
    """Load the tokenizer and check it against the model's vocabulary (and the HF config's
    special ids, when given); raise DataError naming the mismatch."""
    tokenizer = Tokenizer(tokenizer_model)
    if tokenizer.vocab_size > vocab_size:
        raise DataError(
            f"tokenizer model {tokenizer_model} has {tokenizer.vocab_size} pieces, "
            f"more than the model's vocab_size {vocab_size}"
        )
    for key, actual in (("bos_token_id", tokenizer.bos_id), ("eos_token_id", tokenizer.eos_id)):
        expected = (hf_config or {}).get(key)
        if isinstance(expected, list):  # Llama 3 style: several eos ids; ours must be one of them
            ok = actual in expected
        else:
            ok = expected is None or actual == expected
        if not ok:
            raise DataError(
                f"tokenizer model {tokenizer_model}: {key.removesuffix('_token_id')} "
                f"id is {actual}, but config.json has {key} = {expected!r}"
            )
    return tokenizer
