"""The network benchmark's figure: tokens/s and inter-node bytes of every configuration, one
bar per link setting, from the `<setting>.json` files bench_netlab writes.

Why one figure for all settings: the point of the benchmark is where each strategy wins, which
shows only side by side (a strategy that leads at 1 Gbit/s can trail on loopback).
"""

from __future__ import annotations

import json
from pathlib import Path

from matplotlib.figure import Figure

from megazpp.analysis.plots import save_png
from megazpp.errors import DataError
from megazpp.unique_keys import JSONObject

SETTING_ORDER = ("1gbit", "10gbit", "loopback")


def _load(out_dir: Path) -> dict[str, list[JSONObject]]:
    found = {p.stem: json.loads(p.read_text())["rows"] for p in sorted(out_dir.glob("*.json"))}
    if not found:
        raise DataError(f"{out_dir}: no <setting>.json from tools/bench_netlab.py to plot")
    order = [s for s in SETTING_ORDER if s in found] + sorted(s for s in found if s not in SETTING_ORDER)
    return {s: found[s] for s in order}


def plot_settings(out_dir: str | Path, png: str | Path) -> Path:
    """Draw `png` from every setting under `out_dir`; configurations in the first setting's order."""
    settings = _load(Path(out_dir))
    configs: list[str] = []
    for rows in settings.values():
        configs += [r["config"] for r in rows if r["config"] not in configs]
    figure = Figure(figsize=(11, 0.32 * len(configs) + 2.2), dpi=110)
    speed, traffic = figure.subplots(1, 2, sharey=True)
    height = 0.8 / len(settings)
    for i, (setting, rows) in enumerate(settings.items()):
        by_name = {r["config"]: r for r in rows}
        ys = [j + i * height for j in range(len(configs))]
        speed.barh(ys, [(by_name.get(c) or {}).get("tokens_per_s") or 0 for c in configs], height, label=setting)
        traffic.barh(
            ys,
            [((by_name.get(c) or {}).get("counted_inter_bytes_per_step") or 0) / 1e6 for c in configs],
            height,
            label=setting,
        )
    speed.set_yticks([j + 0.4 - height / 2 for j in range(len(configs))], configs)
    speed.invert_yaxis()
    speed.set_xlabel("tokens/s (higher is better)")
    traffic.set_xlabel("inter-node MB per step, counted (lower is better)")
    speed.legend(loc="lower right")
    for axes in (speed, traffic):
        axes.grid(axis="x", alpha=0.3)
    figure.suptitle("2 nodes x 2 CPU ranks, netlab link per setting (no bar: did not run, or not counted)")
    figure.tight_layout()
    out = Path(png)
    save_png(figure, out)
    return out
