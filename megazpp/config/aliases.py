"""Megatron-LM's spellings of flags that megazpp names differently, and the Megatron flags it
refuses with a reason.

Why a table instead of a second name on each field: a Megatron launch script should run with
its flags as written, but the config (and its YAML keys, checkpoints, TensorBoard text) keeps
one name per idea. An alias is rewritten to megazpp's flag before parsing; giving both the
alias and megazpp's flag with different values is an error (there is one value to set).
"""

from __future__ import annotations

from megazpp.errors import ConfigError

# Megatron flag -> megazpp flag (the value follows as given), or the tokens it stands for.
MEGATRON_ALIASES: dict[str, str | tuple[str, ...]] = {
    "--max-position-embeddings": "--seq-length",
    "--init-method-std": "--init-std",
    "--norm-epsilon": "--norm-eps",
    "--rotary-base": "--rope-theta",
    "--recompute-activations": ("--activation-checkpointing",),
    # Megatron's distributed optimizer shards optimizer state over data-parallel ranks and
    # keeps parameters and gradients whole: ZeRO-1, PaRO NNG.
    "--use-distributed-optimizer": ("--zero-stage", "1"),
}

# Why an alias cannot carry a second value next to megazpp's flag.
_ONE_VALUE = {
    "--seq-length": " (megazpp has one length: model.seq_length sizes the training "
    "sequences and gpt2's position table; RoPE has no table)"
}

REFUSED_FLAGS: dict[str, str] = {
    "--no-load-optim": "not implemented: a resume restores the optimizer with the weights. To "
    "start a fresh optimizer from trained Llama weights, convert them "
    "(tools/convert_hf.py export, then import) and pass the imported "
    "checkpoint as --load",
}


def _value_of(args: list[str], i: int) -> str | None:
    """The value token of the flag at `args[i]` (`--f=v` or `--f v`), None for a switch."""
    token = args[i]
    if "=" in token:
        return token.split("=", 1)[1]
    if i + 1 < len(args) and not args[i + 1].startswith("--"):
        return args[i + 1]
    return None


def translate_megatron_flags(args: list[str]) -> list[str]:
    """Rewrite Megatron aliases to megazpp's flags; ConfigError for a refused flag or for an
    alias that contradicts megazpp's own flag given alongside it."""
    out: list[str] = []
    given: dict[str, tuple[str, str | None]] = {}  # megazpp flag -> (how it was spelled, value)
    for i, token in enumerate(args):
        name = token.split("=", 1)[0]
        if not name.startswith("--"):
            out.append(token)
            continue
        if name in REFUSED_FLAGS:
            raise ConfigError(f"command line: {name}: {REFUSED_FLAGS[name]}")
        target = MEGATRON_ALIASES.get(name, name)
        if isinstance(target, tuple):
            if "=" in token:
                raise ConfigError(f"command line: {name} takes no value (it stands for {' '.join(target)})")
            flag, value = target[0], (target[1] if len(target) > 1 else None)
            replaced = list(target)
        else:
            flag, value = target, _value_of(args, i)
            replaced = [target + token[len(name) :]]
        earlier = given.get(flag)
        if earlier is not None and earlier[0] != name and earlier[1] != value:
            raise ConfigError(
                f"command line: {earlier[0]} {earlier[1] or ''} and {name} "
                f"{value or ''} both set {flag} to different values; give one"
                f"{_ONE_VALUE.get(flag, '')}".replace("  ", " ")
            )
        given[flag] = (name, value)
        out.extend(replaced)
    return out
