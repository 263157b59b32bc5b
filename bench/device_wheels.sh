#!/usr/bin/env bash
# Fetch, into .whl/, the wheels bench/device_run.sh installs on a GPU machine that has no network: the
# project's own dependencies that the device image (CUDA PyTorch, CuPy, transformers, peft) lacks, at
# the versions this environment has, for CPython 3.12 on x86-64 Linux (gguf and accelerate: the GGUF models of the
# quantized CUDA tests, read by the gguf package and by transformers' GGUF loader).
set -eu
py=${PYTHON:-python3}
mkdir -p .whl
pins=$("$py" -m pip freeze | grep -i -E '^(accelerate|alembic|annotated-types|apache-tvm-ffi|cffi|cryptography|gguf|greenlet|mako|msgspec|platformdirs|psycopg|psycopg-binary|pydantic|pydantic_core|sqlalchemy|structlog|typing-inspection|xgrammar)==')
for pin in $pins py-spy==0.4.3; do  # py-spy: gpu_check.sh's PYSPY_OUT profile of the decode step
    "$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_5_x86_64 \
        --platform manylinux1_x86_64 -d .whl "$pin"
done
ls .whl
