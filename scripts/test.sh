#!/usr/bin/env bash
# The whole test suite on a fresh install: a new virtual environment made for this run, the project
# installed into it with its `test` extra (so a dependency missing from pyproject.toml fails here
# instead of hiding behind one installed by hand), PostgreSQL and Chromium made sure of, then pytest
# over tests/ (extra arguments go to pytest). The environment is removed when the run ends.
set -euo pipefail
cd "$(dirname "$0")/.."

venv=$(mktemp -d "${TMPDIR:-/tmp}/loraledger-test-venv.XXXXXX")
trap 'rm -rf "$venv"' EXIT
if ! python3 -m venv "$venv" >/dev/null 2>&1; then
  bash scripts/ensure-services.sh --python-venv  # Debian and Ubuntu ship venv's pip in a package of its own
  python3 -m venv "$venv"
fi
started=$SECONDS
# --no-compile: the environment is removed after the run, and the suite imports a small part of what it installs
# (ray, litellm, lm-eval, triton...); byte-compiling every file at install took 80 of 197 s (AMD EPYC, AVX512-BF16,
# no AMX, load 3.5), and Python compiles what is imported, once, as the first test imports it
"$venv/bin/python" -m pip install -q --no-compile -e '.[test]'
echo "test.sh: a new virtual environment with the project and its test extra, in $((SECONDS - started)) s" >&2

# from here on python3, pip and loraledger are the new environment's
export PATH="$venv/bin:$PATH"
unset PYTHONPATH
extra_env=$(bash scripts/ensure-services.sh)
if [ -n "$extra_env" ]; then export "$extra_env"; fi
python3 -m pytest -q "$@"
