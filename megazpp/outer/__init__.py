"""Two-level data parallelism: islands of synchronous ZeRO joined by an outer optimizer."""
