#!/usr/bin/env bash
# One lent-GPU session's checks in one command, for a machine with CUDA, PyTorch and CuPy but none of
# the project's other packages and no network (the device tool's H100/H200 image):
#   bash bench/device_run.sh OUTDIR [STEP ...]
# Installs the wheels carried in .whl/ (fetched beforehand with `bash bench/device_wheels.sh`) and the
# project itself (editable, no dependencies), runs bench/gpu_check.sh with per-step limits that fit
# one ten-minute command, and packs every log and JSON into OUTDIR/gpu-check.tgz (plus summary.txt).
# All steps' limits add up past one ten-minute command: run them as three, e.g.
#   bash bench/device_run.sh OUT env sweep quant engine,   bash bench/device_run.sh OUT kernels step decode
#   and (the quantized base on CUDA)   bash bench/device_run.sh OUT qengine qstep
set -u
out=${1:?usage: bash bench/device_run.sh OUTDIR [STEP ...]}
shift
py=${PYTHON:-python3}
work=$(mktemp -d)
if ls .whl/*.whl >/dev/null 2>&1; then
    "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir .whl/*.whl || exit 90
fi
"$py" -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir -e . || exit 91
export SWEEP_LIMIT=${SWEEP_LIMIT:-110} QUANT_LIMIT=${QUANT_LIMIT:-100} ENGINE_LIMIT=${ENGINE_LIMIT:-90}
export KERNELS_LIMIT=${KERNELS_LIMIT:-130} QENGINE_LIMIT=${QENGINE_LIMIT:-240} QSTEP_LIMIT=${QSTEP_LIMIT:-300}
export STEP_LIMIT=${STEP_LIMIT:-100} DECODE_LIMIT=${DECODE_LIMIT:-100}
export KERNELS_ARGS=${KERNELS_ARGS:---sweep --iters 100} DECODE_ARGS=${DECODE_ARGS:---batch 64 --batch 128 --sync --repeats 1}
mkdir -p "$out"
rc=0
for s in ${*:-env sweep quant qengine engine kernels step qstep decode}; do  # packed after each step: a killed run keeps what it did
    bash bench/gpu_check.sh "$work/gpu-check" "$s" || rc=$((rc + 1))
    cp "$work/gpu-check/summary.txt" "$out/"
    tar czf "$out/gpu-check.tgz" -C "$work" gpu-check
done
exit $rc
