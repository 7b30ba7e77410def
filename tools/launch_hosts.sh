#!/usr/bin/env bash
# Start run.sh on every host of a hostfile, from one command on any machine that reaches them:
#
#   tools/launch_hosts.sh [--workdir DIR] [--stop-grace S] HOSTFILE [run.sh args...]
#
# HOSTFILE has DeepSpeed's format, one `HOST slots=N` per line (N ranks there; the first host is
# the master). Hosts are reached with pdsh (when installed) or ssh, or MEGAZPP_RSH; each prints
# prefixed by its name; when one fails, or on Ctrl-C, all are stopped and the exit code is
# non-zero. The whole logic is megazpp/launch/hosts.py (standard library only, so nothing has
# to be installed here first).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
# This checkout on the path without changing PYTHONPATH, which is passed on to the hosts as is.
exec "${PYTHON:-python3}" -c 'import sys; sys.path.insert(0, sys.argv.pop(1))
from megazpp.launch.hosts import main; sys.exit(main(sys.argv[1:]))' "$ROOT" "$@"
