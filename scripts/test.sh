#!/usr/bin/env bash
# Run the test suite. On a fresh clone it first creates .venv and installs the package, exactly
# as the README's set-up does (scripts/venv.sh).
#
#   scripts/test.sh [pytest arguments]      e.g. scripts/test.sh tests/test_config.py -x
#
# Two pytest-xdist workers, one per core, each taking whole test files (`--dist loadfile`: a
# file's module fixtures are built once): most tests are single-threaded or wait on
# subprocesses. TEST_WORKERS=0 runs in one process (as does `-n 0` among the arguments).
set -euo pipefail
cd "$(dirname "$0")/.."

scripts/venv.sh
# Sleeping rather than spinning OpenMP waits: on a shared 2-core machine spinning threads make CPU
# tests many times slower (see trinity_train/cli.py); the console script sets the same.
export OMP_WAIT_POLICY="${OMP_WAIT_POLICY:-PASSIVE}"
exec .venv/bin/python -m pytest -n "${TEST_WORKERS:-2}" --dist loadfile "$@"
