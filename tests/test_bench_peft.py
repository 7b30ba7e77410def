"""The network benchmark's LoRA mode: the configurations it runs and its verdict line."""

from __future__ import annotations

from benchmarks.peft import peft_configs, verdict
from benchmarks.results import Row
from benchmarks.suite import all_configs


def test_lora_mode_runs_what_works_with_frozen_weights():
    names = [c.name for c in peft_configs(all_configs(2))]
    assert names[:2] == ["zero3", "zero3+qgz"] and "paro-ING" in names
    # 16 synchronous rows and the 3 two-level ones (frozen weights train inside islands too)
    assert len(names) == 19 and sum(n.startswith("diloco-") for n in names) == 3
    assert not [n for n in names if "qwz" in n or "hpz" in n or n.startswith(("ds-", "zeropp"))]


def _row(name: str, tokens: float, rss: int) -> Row:
    return Row(name, "megazpp", "ok", 3, tokens_per_s=tokens, peak_rss_bytes=rss)


def test_verdict_needs_speed_and_memory():
    base = _row("zero3", 100.0, 1000)
    assert "1.60x" in verdict([base, _row("paro-ING", 160.0, 1200)], "paro-ING")
    assert "NOT" not in verdict([base, _row("paro-ING", 160.0, 1200)], "paro-ING")
    assert "NOT met" in verdict([base, _row("paro-ING", 160.0, 1300)], "paro-ING")  # memory 1.3x
    assert "NOT met" in verdict([base, _row("paro-ING", 140.0, 900)], "paro-ING")  # 1.4x only
    assert "not measured" in verdict([base], "paro-ING")
