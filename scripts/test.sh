#!/usr/bin/env bash
# Install the project with its test extras, make sure PostgreSQL and Chromium are there, run the whole suite.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q -e '.[test]'
extra_env=$(bash scripts/ensure-services.sh)
if [ -n "$extra_env" ]; then export "$extra_env"; fi
exec python3 -m pytest -q "$@"
