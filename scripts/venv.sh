#!/usr/bin/env bash
# Create .venv and install the package as the README's set-up does (torch first, so pip takes the
# CPU build on this machine's disk), unless it already holds what the tests and the docs need.
# scripts/test.sh and .ci/run call it.
set -euo pipefail
cd "$(dirname "$0")/.."

if ! .venv/bin/python -c "import trinity_train.cli, trinity_harness.jobs, pytest, xdist, matplotlib, mkdocs, material" 2>/dev/null; then
    python3 -m venv .venv
    .venv/bin/pip install torch==2.13.0
    .venv/bin/pip install -e '.[dev]'
fi
