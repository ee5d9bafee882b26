#!/usr/bin/env bash
# One-shot set-up on a fresh machine: a local virtual environment with the CPU build of torch,
# the project (editable), its test tools, sglang 0.5.23 (the light way) and Mooncake's
# transfer engine. Safe to run again: it skips what is already done.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
VENV=.venv
C="-c requirements/constraints.txt"

if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
PIP="$VENV/bin/python -m pip --disable-pip-version-check"

# Mooncake's transfer engine links libibverbs even when it only speaks TCP.
if ! ldconfig -p 2>/dev/null | grep -q libibverbs.so.1; then
  if command -v apt-get >/dev/null; then
    SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo"
    $SUDO apt-get update -qq && $SUDO apt-get install -y -qq libibverbs1 >/dev/null \
      || echo "warning: could not install libibverbs1; Mooncake tests will be skipped" >&2
  fi
fi

$PIP install -q torch==2.13.0 $C
$PIP install -q -r requirements/base.txt -r requirements/conductor.txt -r requirements/test.txt $C
# sglang pins torch==2.14.1 (CUDA); install it without dependencies and add the light lists.
# pip prints "sglang requires torch==2.14.1 ..." here: expected, the exit code stays 0.
$PIP install -q --no-deps sglang==0.5.23 $C
$PIP install -q -r requirements/sglang-cpu.txt $C 2>&1 | grep -v "^ERROR: pip's dependency resolver\|requires\|^$" || true
$PIP install -q mooncake-transfer-engine-non-cuda $C || echo "warning: Mooncake transfer engine not installed" >&2
$PIP install -q --no-deps -e . $C

$VENV/bin/python - <<'PY'
import torch
assert torch.version.cuda is None, f"a CUDA torch was installed ({torch.__version__}); expected the CPU build"
print(f"set-up done: torch {torch.__version__}")
PY
