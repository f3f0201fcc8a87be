#!/usr/bin/env bash
# Installs what `silofs demo` (demo) or the test suite (test) needs, then runs it.
#
#   scripts/setup.sh demo                    # FUSE, silofs; then `silofs demo`
#   scripts/setup.sh test [PYTEST ARGS...]   # and the servers' tools; then pytest -q
#
# System packages (Debian/Ubuntu, apt-get; sudo when not root, else one line naming them
# for root to install) are asked for only when what they provide is missing (on PATH or
# in the sbin directories), so a host whose Node.js came from its vendor (NodeSource
# ships npm inside its nodejs, which conflicts with Debian's npm) is left as it is. The
# demo never installs Node.js, Slurm, munge or iproute2. Python packages go into the
# active virtualenv, else into .venv (made with $PYTHON, default python3: Debian's system
# Python refuses pip installs, PEP 668). Safe to run again: each step skips what is there.
set -euo pipefail
cd "$(dirname "$0")/.."

mode=${1:-}
case $mode in
  demo | test) shift ;;
  *) echo "usage: scripts/setup.sh demo|test [pytest args...]" >&2; exit 2 ;;
esac

as_root() { if [ "$(id -u)" = 0 ]; then "$@"; else sudo "$@"; fi; }
# Whether a program is installed: looked for on PATH and in the sbin directories, which
# a user's PATH on Debian lacks (slurmctld, munged live there): a user must not be sent
# to install what root already has.
have() { PATH="$PATH:/usr/local/sbin:/usr/sbin:/sbin" command -v "$1" >/dev/null; }

py=${PYTHON:-python3}
if ! command -v "$py" >/dev/null; then
  echo "setup: $py not found: silofs needs Python >= 3.11 (set PYTHON=/path/to/python3.11)" >&2
  exit 1
fi
if ! "$py" -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
  echo "setup: silofs needs Python >= 3.11; $py is $("$py" -V 2>&1)" >&2
  exit 1
fi
if [ -n "${VIRTUAL_ENV:-}" ]; then
  venv=$VIRTUAL_ENV
else
  venv=.venv
fi

need=()
# What the demo needs: FUSE 3, and what building pyfuse3 (a source-only package) takes.
have fusermount3 || need+=(fuse3)
pkg-config --exists fuse3 2>/dev/null || need+=(libfuse3-dev pkg-config)
have gcc || need+=(gcc libc6-dev)
has_headers='import os, sys, sysconfig
sys.exit(not os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h")))'
"$py" -c "$has_headers" || need+=(python3-dev)
if [ ! -x "$venv/bin/python" ]; then
  "$py" -c 'import ensurepip' 2>/dev/null || need+=(python3-venv)
fi
if [ "$mode" = test ]; then
  # Azurite comes from npm (into .ci/node, on first use); a vendor's nodejs has its npm.
  if ! have npm; then
    if have node; then need+=(npm); else need+=(nodejs npm); fi
  fi
  # Daemons in network namespaces (tests/integration/test_remote_control.py), the
  # serving processes of a mount (pgrep), and a one-node Slurm (test_slurm.py).
  have ip || need+=(iproute2)
  have pgrep || need+=(procps)
  have slurmctld || need+=(slurm-wlm)
  have munged || need+=(munge)
  # The Slurm test installs silofs as an operator does: a venv of Debian's python3, with
  # pyfuse3 built for it, whatever Python runs the suite.
  dpkg -s python3-venv python3-dev >/dev/null 2>&1 || need+=(python3-venv python3-dev)
fi
if [ ${#need[@]} -gt 0 ]; then
  if ! have apt-get; then
    echo "setup: install these (Debian names) with your package manager: ${need[*]}" >&2
    exit 1
  fi
  if [ "$(id -u)" != 0 ] && ! have sudo; then
    echo "setup: missing: ${need[*]}; install them as root (apt-get install ${need[*]}), then run me again" >&2
    exit 1
  fi
  as_root apt-get update -q
  as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${need[@]}"
fi

[ -x "$venv/bin/python" ] || "$py" -m venv "$venv"
if [ "$mode" = demo ]; then
  "$venv/bin/python" -m pip install -q -e .
  exec "$venv/bin/python" -m silofs demo
fi
"$venv/bin/python" -m pip install -q -e '.[test]'
exec "$venv/bin/python" -m pytest -q "$@"
