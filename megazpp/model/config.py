"""Model hyper-parameters for GPT-2 and Llama, checked once before anything is built.

One dataclass covers both architectures because they differ only in a few switches (norm,
activation, positions, biases, tying); `arch` picks sensible defaults for the switches a user
leaves as None, so a YAML file names only what it changes. Every inconsistency is refused when
the config is built (`__post_init__`), as a ConfigError naming the key and the value: whoever
holds a ModelConfig holds a consistent one, and no caller has a check to remember.
"""

from __future__ import annotations

from dataclasses import dataclass

from megazpp.errors import ConfigError, required
from megazpp.setting import setting

ARCHITECTURES = ("llama", "gpt2")
# the linears of a layer that can carry a LoRA adapter, per architecture (attribute names)
LORA_TARGETS = {"llama": ("qkv", "out", "gate_proj", "up_proj", "down_proj"), "gpt2": ("qkv", "out", "fc1", "fc2")}


def _llama_ffn_size(hidden_size: int) -> int:
    """SwiGLU width as in Llama: 2/3 of 4h (same parameter count as a 4h GELU MLP), rounded
    up to a multiple of 64 so matmuls stay aligned."""
    return (int(8 * hidden_size / 3) + 63) // 64 * 64


@dataclass(frozen=True)
class ModelConfig:
    """Shape and behaviour of a GPT-2 or Llama model.

    `None` fields are filled from `arch` in `__post_init__`, which then checks every field.
    """

    arch: str = setting("llama", "llama (RoPE, RMSNorm, SwiGLU) or gpt2 (learned positions, LayerNorm, GELU)")
    num_layers: int = setting(2, "transformer layers")
    hidden_size: int = setting(64, "model width")
    num_attention_heads: int = setting(4, "attention heads")
    num_query_groups: int | None = setting(None, "key/value heads for grouped-query attention; none: one per head")
    ffn_hidden_size: int | None = setting(None, "MLP width; none: 4h for gpt2, ~8h/3 rounded to 64 for llama")
    vocab_size: int = setting(512, "embedding rows; unless set: the tokenizer's vocabulary, padded")
    seq_length: int = setting(128, "training sequence length (also gpt2's position table size)")
    norm_eps: float = setting(1e-5, "epsilon of RMSNorm / LayerNorm")
    rope_theta: float = setting(10000.0, "RoPE base frequency")
    tie_embeddings: bool | None = setting(None, "share input embedding and output layer; none: gpt2 yes, llama no")
    hidden_dropout: float = setting(0.0, "dropout after attention and MLP")
    attention_dropout: float = setting(0.0, "dropout on attention probabilities")
    num_experts: int = setting(0, "experts per MoE layer (0: dense MLP)")
    moe_top_k: int = setting(2, "experts each token is routed to")
    moe_ffn_hidden_size: int | None = setting(None, "expert MLP width; none: ffn_hidden_size / moe_top_k")
    moe_aux_loss_coeff: float = setting(0.01, "weight of the MoE load-balancing loss")
    activation_checkpointing: bool = setting(False, "recompute each layer's activations in backward")
    lora_rank: int = setting(
        0,
        "LoRA adapter rank on the lora_targets linears (0: none); with adapters, only they train unless "
        "training.trainable adds more",
    )
    lora_alpha: float = setting(16.0, "LoRA scale numerator: adapters add lora_alpha / lora_rank x B A")
    lora_targets: list[str] | None = setting(
        None, "linears that get adapters: qkv out gate_proj up_proj down_proj (llama), fc1 fc2 (gpt2); none: all"
    )
    init_std: float = setting(0.02, "standard deviation of the weight init")
    init_seed: int = setting(1234, "seed of the weight init (same model for every parallel layout)")

    def __post_init__(self) -> None:
        if self.arch not in ARCHITECTURES:
            raise ConfigError(f"model.arch = {self.arch!r}: expected one of {list(ARCHITECTURES)}")
        # the fields left None are derived from arch, once, here (the type is frozen after)

        def fill(name: str, value: object) -> None:
            object.__setattr__(self, name, value)

        if self.num_query_groups is None:
            fill("num_query_groups", self.num_attention_heads)
        if self.ffn_hidden_size is None and isinstance(self.hidden_size, int):
            fill("ffn_hidden_size", 4 * self.hidden_size if self.arch == "gpt2" else _llama_ffn_size(self.hidden_size))
        if self.tie_embeddings is None:
            fill("tie_embeddings", self.arch == "gpt2")
        if self.moe_ffn_hidden_size is None and isinstance(self.ffn_hidden_size, int):
            fill("moe_ffn_hidden_size", max(1, self.ffn_hidden_size // max(1, self.moe_top_k)))
        if self.lora_targets is None:
            fill("lora_targets", list(LORA_TARGETS[self.arch]))
        self._check()

    @property
    def is_llama(self) -> bool:
        return self.arch == "llama"

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def use_bias(self) -> bool:
        """GPT-2 has biases on every linear layer and norm; Llama has none."""
        return self.arch == "gpt2"

    def _check(self) -> None:
        """Raise ConfigError on the first inconsistent value."""
        for key in (
            "num_layers",
            "hidden_size",
            "num_attention_heads",
            "num_query_groups",
            "ffn_hidden_size",
            "vocab_size",
            "seq_length",
        ):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ConfigError(f"model.{key} = {value!r}: expected a positive integer")
        if self.hidden_size % self.num_attention_heads:
            raise ConfigError(
                f"model.hidden_size = {self.hidden_size} is not divisible by "
                f"model.num_attention_heads = {self.num_attention_heads}"
            )
        if self.num_attention_heads % required(self.num_query_groups, "model.num_query_groups"):
            raise ConfigError(
                f"model.num_attention_heads = {self.num_attention_heads} is not divisible by "
                f"model.num_query_groups = {self.num_query_groups}"
            )
        if self.is_llama and self.head_dim % 2:
            raise ConfigError(
                f"model.hidden_size / model.num_attention_heads = {self.head_dim}: rotary "
                "embeddings need an even head dimension"
            )
        for key in ("hidden_dropout", "attention_dropout"):
            value = getattr(self, key)
            if not 0.0 <= value < 1.0:
                raise ConfigError(f"model.{key} = {value!r}: expected a probability in [0, 1)")
        for key in ("norm_eps", "init_std", "rope_theta"):
            if not getattr(self, key) > 0:
                raise ConfigError(f"model.{key} = {getattr(self, key)!r}: expected a value > 0")
        if not isinstance(self.init_seed, int) or isinstance(self.init_seed, bool):
            raise ConfigError(f"model.init_seed = {self.init_seed!r}: expected an integer")
        self._validate_moe()
        self._validate_lora()

    def _validate_lora(self) -> None:
        if isinstance(self.lora_rank, bool) or not isinstance(self.lora_rank, int) or self.lora_rank < 0:
            raise ConfigError(f"model.lora_rank = {self.lora_rank!r}: expected 0 (no adapters) or a positive integer")
        if self.lora_rank == 0:
            return
        if not self.lora_alpha > 0:
            raise ConfigError(f"model.lora_alpha = {self.lora_alpha!r}: expected a value > 0")
        valid = LORA_TARGETS[self.arch]
        unknown = [t for t in required(self.lora_targets, "model.lora_targets") if t not in valid]
        if unknown or not self.lora_targets:
            raise ConfigError(
                f"model.lora_targets = {self.lora_targets!r}: "
                f"{'unknown module ' + repr(unknown[0]) if unknown else 'empty'}; "
                f"expected names among {list(valid)} (arch {self.arch})"
            )

    def _validate_moe(self) -> None:
        if not isinstance(self.num_experts, int) or self.num_experts < 0:
            raise ConfigError(f"model.num_experts = {self.num_experts!r}: expected 0 (dense) or a positive integer")
        if self.num_experts == 0:
            return
        if not isinstance(self.moe_top_k, int) or not 1 <= self.moe_top_k <= self.num_experts:
            raise ConfigError(
                f"model.moe_top_k = {self.moe_top_k!r}: expected an integer in "
                f"[1, model.num_experts = {self.num_experts}]"
            )
        if not isinstance(self.moe_ffn_hidden_size, int) or self.moe_ffn_hidden_size <= 0:
            raise ConfigError(f"model.moe_ffn_hidden_size = {self.moe_ffn_hidden_size!r}: expected a positive integer")
        if self.moe_aux_loss_coeff < 0:
            raise ConfigError(f"model.moe_aux_loss_coeff = {self.moe_aux_loss_coeff!r}: expected a value >= 0")
        if not self.is_llama:
            raise ConfigError(
                "model.num_experts > 0 with model.arch = 'gpt2': the MoE experts are SwiGLU "
                "(Qwen2-MoE-like) and are only implemented for arch 'llama'"
            )
