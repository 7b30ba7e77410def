"""megazpp: Megatron-style pretraining with ZeRO++, LoCo and PaRO for slow inter-node links."""

__version__ = "0.1.0"
