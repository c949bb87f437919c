#!/usr/bin/env bash
# GPU check of the Triton attention kernels: the kernel tests compiled for CUDA (not under the
# interpreter, and with the larger GPU-only cases), the engine end to end on the GPU (greedy
# parity with Hugging Face, tok/s: `prefixmesh bench gpu`), then the attention benchmark.
#
#   bash kernels/gpu_check.sh [RESULTS_FILE]      # default: gpu_check_results.md
#
# Needs a CUDA GPU and a Python with a CUDA build of torch (never installed here: pick the build
# that matches your driver). Installs only what is missing of triton and pytest. Every step's
# output goes to the results file; the exit status is non-zero if any test failed.
set -uo pipefail
cd "$(dirname "$0")/.."
RESULTS=${1:-gpu_check_results.md}
PY=${PYTHON:-python3}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
unset TRITON_INTERPRET  # compiled kernels, not the CPU interpreter
# The C++ CPU kernels serve only the CPU path; the test session would otherwise compile them first.
export PREFIXMESH_CPU_KERNELS=${PREFIXMESH_CPU_KERNELS:-0}

if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "gpu_check: $PY has no CUDA-enabled torch or sees no GPU; nothing to check." >&2
    exit 2
fi
for pkg in triton pytest; do
    if ! "$PY" -c "import $pkg" 2>/dev/null; then
        spec=$pkg
        [ "$pkg" = triton ] && spec="triton>=3.0"
        echo "gpu_check: installing $spec" >&2
        "$PY" -m pip install -q "$spec" || { echo "gpu_check: cannot install $spec" >&2; exit 2; }
    fi
done

status=0
{
    echo "# Triton kernel GPU check, $(date -u +%Y-%m-%dT%H:%M:%SZ)"
    echo
    echo '```'
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null
    "$PY" -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda,
'triton', triton.__version__, torch.cuda.get_device_name())"
    echo '```'
} >"$RESULTS"

step() {  # step TITLE COMMAND...: run, append its output to the results file, keep the status
    local title=$1
    shift
    echo "== $title" >&2
    { echo; echo "## $title"; echo; echo '```'; } >>"$RESULTS"
    "$@" 2>&1 | tee -a "$RESULTS"
    local rc=${PIPESTATUS[0]}
    { echo '```'; echo "exit status: $rc"; } >>"$RESULTS"
    return "$rc"
}

# --noconftest: the kernel tests need no shared fixtures (nor the engine's dependencies).
step "kernel tests on CUDA (compiled)" \
    "$PY" -m pytest tests/test_kernels.py -q -p no:cacheprovider --noconftest -o addopts="" \
    || status=1
# Greedy output of the tiny model, triton vs torch backend (needs the replica engine's deps).
step "engine test: triton backend vs torch backend" \
    "$PY" -m pytest tests/test_triton_engine.py -q -p no:cacheprovider -o addopts="" \
    || status=1
# The engine end to end on the GPU: both backends against Hugging Face in float32, and tok/s.
# GPU_CHECK_MODEL names the model (default smollm2); GPU_CHECK_RANDOM_WEIGHTS=1 keeps only its
# config and tokenizer (a machine without the weights or the network to fetch them).
engine_on_gpu() {
    local log rc
    log=$(mktemp)
    "$PY" -m replica.bench gpu --model "${GPU_CHECK_MODEL:-smollm2}" \
        ${GPU_CHECK_RANDOM_WEIGHTS:+--random-weights} >"$log" 2>&1
    rc=$?
    cat "$log"
    grep -q "^parity: PASS" "$log" && [ "$rc" = 0 ]
    rc=$?
    rm -f "$log"
    return "$rc"
}
step "engine end to end: $(basename "${GPU_CHECK_MODEL:-smollm2}") on the GPU" engine_on_gpu \
    || status=1
step "benchmark: SmolLM2-135M shapes (9/3 heads, head_dim 64), float16" \
    "$PY" -m kernels.bench --dtype float16
step "benchmark: Llama-3-8B shapes (32/8 heads, head_dim 128), bfloat16" \
    "$PY" -m kernels.bench --num-heads 32 --num-kv-heads 8 --head-dim 128 --dtype bfloat16 \
    --decode-batches 1,32,128 --prefill-batches 1,8 --contexts 512,4096,32768

echo "gpu_check: results in $RESULTS (tests $([ $status = 0 ] && echo passed || echo FAILED))" >&2
exit $status
