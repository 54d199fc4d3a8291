#!/usr/bin/env bash
# The engine's GPU checks on a machine with one CUDA GPU, in one bounded run (CI never has a GPU).
#
#   bash benchmarks/gpu_suite.sh [stage ...]     stages: env tests pd decode async triton bench optin bisect mamba
#                                                (default: all but optin and bisect)
#
# Logs go to $OUT (or ./gpu-out), one file per stage; each stage prints its tail and its exit code.
# STAGE_LIMIT (seconds) caps every stage's time limit; XDIST=N runs the test stages on N workers;
# BENCH_ARGS are passed to engine_gpu.py (e.g. --async-scheduling). SIDE_BY_SIDE=1 runs the named
# benchmark stages first, alone, then the test stages (tests pd decode async triton) at once, each
# printing its tail when all are done: the whole suite but mamba took 7 minutes so on an H200.
# The GPU machine has torch, Triton and transformers but not pydantic or gguf: put their wheels in
# .whl/ (see benchmarks/README.md) and they are installed into a temporary target first. Ray and
# NIXL are not needed: the engine never imports ray, and P/D runs on the `local` backend (CUDA IPC).
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-gpu-out}"
mkdir -p "$out"
site="${TMPDIR:-/tmp}/kvfleet-site"
if [ -d .whl ] && [ ! -d "$site/pydantic" ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" .whl/*.whl \
        || { echo "gpu_suite: installing .whl/ failed" >&2; exit 1; }
fi
if [ -d "$site" ]; then
    export PYTHONPATH="$site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
else
    export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false KVFLEET_CACHE="${TMPDIR:-/tmp}/kvfleet-cache"
stages=("$@")
[ ${#stages[@]} -eq 0 ] && stages=(env tests pd decode async triton bench mamba)
pytest_args=(-q -p no:cacheprovider -o addopts="" --timeout 300)
[ "${XDIST:-0}" -gt 0 ] && pytest_args+=(-n "$XDIST")

run_stage() {  # name, limit in seconds, command...
    local name=$1 limit=$2
    shift 2
    [ -n "${STAGE_LIMIT:-}" ] && [ "$STAGE_LIMIT" -lt "$limit" ] && limit=$STAGE_LIMIT
    local started=$SECONDS
    timeout "$limit" "$@" >"$out/$name.log" 2>&1
    local rc=$?
    tail -n "${TAIL_LINES:-15}" "$out/$name.log"
    echo "== $name: rc=$rc in $((SECONDS - started)) s"
}

one_stage() {
    local stage=$1
    case "$stage" in
    env)
        run_stage env 60 bash -c 'nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv;
            python3 -c "import sys, torch, triton, transformers; print(sys.version.split()[0], torch.__version__,
            torch.version.cuda, triton.__version__, transformers.__version__, torch.cuda.get_device_name())"' ;;
    tests)  # the logits tests on CUDA (fp32 atol 1e-4 with TF32 off; bf16 closeness), the GPU budget, and
        # tests/model/test_mixed_step.py's cuda cases (piecewise-captured mixed steps against eager, every preset)
        run_stage tests 420 python3 -m pytest "${pytest_args[@]}" tests/model -k "cuda" tests/kv_layout/test_gpu_budget.py ;;
    pd)  # P/D on the GPU: the local backend over CUDA IPC, the export race, the engine P/D tests
        KVFLEET_TEST_DEVICE=cuda run_stage pd 420 python3 -m pytest "${pytest_args[@]}" tests/engine/test_export_race.py \
            tests/transfer/test_local_cuda.py tests/engine/test_pd.py tests/engine/test_pd_race.py ;;
    decode)  # the static, padded decode step captured as CUDA graphs against the eager step, every preset
        # (its engines capture the mixed step's piecewise graphs too)
        KVFLEET_TEST_DEVICE=cuda run_stage decode 300 python3 -m pytest "${pytest_args[@]}" tests/engine/test_decode_step.py ;;
    async)  # scheduler.async_scheduling on CUDA against the synchronous engine: decode, prefill and mixed
        # steps launched while the step before runs (captured graphs, on-device placeholder ids, two
        # staging buffers); its passing is what turning the flag on by default on CUDA waits for
        KVFLEET_TEST_DEVICE=cuda run_stage async 360 python3 -m pytest "${pytest_args[@]}" \
            tests/engine/test_async_scheduling.py tests/engine/test_async_mixed_steps.py ;;
    triton)  # every Triton kernel of engine/model/kernels/ against the torch path, compiled for the GPU
        run_stage triton 300 python3 -m pytest "${pytest_args[@]}" tests/model/test_triton_attention.py \
            tests/model/test_triton_mamba.py tests/model/test_triton_norm.py tests/model/test_triton_rope.py \
            tests/model/test_triton_act.py tests/model/test_triton_split_decode.py tests/model/test_triton_ssd.py ;;
    bench)
        run_stage bench 420 python3 -m benchmarks.engine_gpu --device cuda ${BENCH_ARGS:-} ;;
    optin)  # the bench again with the opt-in kernels on (split decode attention, the Triton SSD prefill),
        # to compare with the bench stage's run before making them the CUDA default
        KVFLEET_SPLIT_DECODE=triton KVFLEET_SSD_KERNEL=triton run_stage optin 420 \
            python3 -m benchmarks.engine_gpu --device cuda --no-eager-decode ${BENCH_ARGS:-} ;;
    bisect)  # the hybrid P/D divergence under async scheduling, one change at a time (see its docstring)
        KVFLEET_TEST_DEVICE=cuda run_stage bisect 300 python3 -m benchmarks.async_pd_bisect \
            --variants base,sync_launch,no_graphs,torch_mamba,sync_reads --seeds 1 --sync-debug ;;
    mamba)  # benchmarks/mamba_decode.py's decode measurement (per-request vs batched Mamba path) on the GPU
        run_stage mamba 240 python3 -m benchmarks.mamba_decode --device cuda --dtype bfloat16 --num-requests 32 ;;
    *) echo "gpu_suite: unknown stage $stage" >&2; exit 2 ;;
    esac
}

if [ "${SIDE_BY_SIDE:-0}" = 1 ]; then
    side=()
    for stage in "${stages[@]}"; do
        case "$stage" in
        tests | pd | decode | async | triton) side+=("$stage") ;;
        *) one_stage "$stage" ;;
        esac
    done
    summaries="$(mktemp -d)"
    for stage in "${side[@]}"; do
        one_stage "$stage" >"$summaries/$stage.txt" 2>&1 &
    done
    wait
    for stage in "${side[@]}"; do
        cat "$summaries/$stage.txt"
    done
    rm -rf "$summaries"
else
    for stage in "${stages[@]}"; do
        one_stage "$stage"
    done
fi
