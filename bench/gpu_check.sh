#!/usr/bin/env bash
# Every GPU check of issue 5 in one go, on a machine with an NVIDIA GPU, CuPy and the project installed:
#   bash bench/gpu_check.sh [OUTDIR] [STEP ...]
# (steps: env sweep quant qengine engine kernels step qstep decode; default all)
# Each step writes its log (and JSON where it has figures) under OUTDIR and runs under its own time
# limit, so one failing or hanging step does not hide the others. Exit status: the number of failed steps.
# PYSPY_OUT=FILE: the decode step runs under `py-spy record` (every thread, collapsed stacks, without
# pausing the process) so the engine's host time per step can be read off afterwards.
set -u
out=${1:-gpu-check}
shift || true
steps=${*:-env sweep quant qengine engine kernels step qstep decode}
py=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
mkdir -p "$out"
failed=0

step() {  # step NAME SECONDS CMD...: run CMD with a time limit, log to OUTDIR/NAME.log
    local name=$1 limit=$2
    shift 2
    local t0=$SECONDS
    timeout --signal=INT --kill-after=15 "$limit" "$@" >"$out/$name.log" 2>&1
    local rc=$?
    echo "== $name: rc $rc in $((SECONDS - t0)) s" | tee -a "$out/summary.txt"
    tail -n 25 "$out/$name.log"
    [ $rc -eq 0 ] || failed=$((failed + 1))
}

for s in $steps; do
    case $s in
    env) step env 60 bash -c "nvidia-smi; $py -c 'import torch, cupy, transformers, peft; print(torch.__version__, torch.version.cuda, cupy.__version__, transformers.__version__, peft.__version__); print(torch.cuda.get_device_name())'" ;;
    sweep) step sweep "${SWEEP_LIMIT:-300}" "$py" -m pytest tests/gpu/test_ops_cuda.py -m gpu -q -rs -p no:cacheprovider --timeout 120 --maxfail 40 ${SWEEP_K:+-k "$SWEEP_K"} ;;
    quant) step quant "${QUANT_LIMIT:-180}" "$py" -m pytest tests/gpu/test_ops_quant.py -m gpu -q -rs -p no:cacheprovider --timeout 120 --maxfail 10 ${QUANT_K:+-k "$QUANT_K"} ;;
    qengine) step qengine "${QENGINE_LIMIT:-240}" "$py" -m pytest tests/gpu/test_quant_cuda_engine.py -m gpu -q -rs -p no:cacheprovider --timeout 150 ${QENGINE_K:+-k "$QENGINE_K"} ;;
    engine) step engine "${ENGINE_LIMIT:-200}" "$py" -m pytest tests/gpu/test_cuda_engine.py tests/api/test_reference_outputs.py -m gpu -q -rs -s -p no:cacheprovider --timeout 150 ;;
    kernels) step kernels "${KERNELS_LIMIT:-240}" "$py" -m bench.kernels --json "$out/kernels.json" ${KERNELS_ARGS:-} ;;
    step) step step "${STEP_LIMIT:-300}" "$py" -m bench.gpu_step --json "$out/gpu_step.json" ${STEP_ARGS:-} ;;
    qstep) step qstep "${QSTEP_LIMIT:-300}" "$py" -m bench.gpu_step --quant --shape 8b --json "$out/gpu_quant_step.json" ${QSTEP_ARGS:-} ;;
    decode) step decode "${DECODE_LIMIT:-300}" ${PYSPY_OUT:+"$($py -c 'import sysconfig; print(sysconfig.get_path("scripts"))')/py-spy" record --nonblocking --threads --rate 200 --format raw --output "$PYSPY_OUT" --} "$py" -m bench.gpu_decode --json "$out/gpu_decode.json" ${DECODE_ARGS:-} ;;
    *) echo "unknown step $s (env sweep quant qengine engine kernels step qstep decode)"; failed=$((failed + 1)) ;;
    esac
done
exit $failed
