"""Every shell script of the repository parses (`bash -n`): a script the suite never runs
end to end (netlab calibration, SLURM, the GPU check) would otherwise only fail on the
machine it was written for. The calibration script once did, over an apostrophe in its
usage text."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = sorted([REPO / "run.sh", REPO / ".ci" / "run", *REPO.glob("tools/**/*.sh"), *REPO.glob("tools/**/*.sbatch")])


def test_the_scripts_are_found():
    assert {p.name for p in SCRIPTS} >= {"run.sh", "run", "calibrate_netlab.sh", "netlab.sh", "pretrain.sbatch"}


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: str(p.relative_to(REPO)))
def test_script_parses(script):
    run = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
