#!/usr/bin/env bash
# The TileLang GPU check in one call: every op under LYCORIS_KERNEL_BACKEND=tilelang against
# the CPU result (fp32/bf16/fp16) and inside torch.compile(fullgraph=True), then the same sweep
# again in fresh processes with TileLang's disk cache warm (its build seconds are what a
# second process pays); then the per-op benchmark with the TileLang column.
#
#   LYCORIS_TILELANG_SITE=/tmp/tl bash bench/gpu_tilelang.sh [bench.py args...]
#   LYCORIS_TILELANG_SITE=/tmp/tl bash bench/gpu_tilelang.sh tune [gpu_tilelang_tune.py args...]
#
# "tune" (one 10-minute call): the build, the GPU tests of
# the tuned tile configs (or LYCORIS_TESTS: pytest arguments), then bench/gpu_tilelang_tune.py (cold / warm TileLang tuning,
# winners against the fixed configs) instead of the sweep and the benchmark.
#
# TileLang is not installed on the device machine: carry .tlsite (bench/pack_tilelang.sh packs
# it; unpacked into /tmp/tl here), or install its wheels into a folder first (see
# ../shared/TOOLCHAIN.md) and pass it as LYCORIS_TILELANG_SITE.
# The sweep runs family groups as parallel processes on GPU 1 when there are two GPUs (on
# GPU 0 otherwise): TileLang's compiles are CPU-bound. The benchmark runs on GPU 0.
# Environment: LYCORIS_SWEEP_GROUPS (families, default all six groups), LYCORIS_SWEEP_DTYPES
# (gpu_backends.py --dtypes, in the order run: "bfloat16,float16" reaches the 16-bit-only
# kernels first), LYCORIS_SWEEP_SPLIT (dtype: a sweep process per group and dtype),
# LYCORIS_SWEEP_WARM (0: no second sweep), LYCORIS_TESTS (pytest
# arguments run after the sweeps, LYCORIS_TESTS_SECONDS, default 120), LYCORIS_SWEEP_SECONDS (per sweep process, default 240),
# LYCORIS_BENCH_SECONDS (default 400; 0: no benchmark), LYCORIS_COMMIT.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
final=${OUT:-bench/out}; mkdir -p "$final"
work=$(mktemp -d); out=$work/out; mkdir -p "$out"
py=${PYTHON:-python3}
if [ -z "${LYCORIS_TILELANG_SITE:-}" ] && [ -f .tlsite/tl.tar.xz ]; then  # bench/pack_tilelang.sh
  mkdir -p /tmp/tl && tar -C /tmp/tl -xJf .tlsite/tl.tar.xz && export LYCORIS_TILELANG_SITE=/tmp/tl
fi
[ -n "${LYCORIS_TILELANG_SITE:-}" ] && export PYTHONPATH="$LYCORIS_TILELANG_SITE${PYTHONPATH:+:$PYTHONPATH}"
export TILELANG_CACHE_DIR=$work/tilelang-cache   # empty: the first sweep compiles everything
MAX_JOBS=16 $py -m pip install -q --no-build-isolation --no-deps -e . >"$work/build.log" 2>&1 || { tail -30 "$work/build.log"; exit 1; }
$py -c "import torch, tilelang, lycoris_ops as L; print('torch', torch.__version__, '| tilelang', tilelang.__version__, '|', L.available_backends('cuda'))" || exit 1
ngpu=$($py -c "import torch; print(torch.cuda.device_count())")
sweep_gpu=$([ "$ngpu" -ge 2 ] && echo 1 || echo 0)
commit=${LYCORIS_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
groups=${LYCORIS_SWEEP_GROUPS:-"lora loha lokr dora,ia3,add oft boft"}

if [ "${1:-}" = tune ]; then
  shift
  if [ "${LYCORIS_TESTS_SECONDS:-120}" != 0 ]; then
    echo "== GPU tests of the tuned tile configs"
    timeout -s INT "${LYCORIS_TESTS_SECONDS:-120}" $py -m pytest -q -m "" -p no:cacheprovider \
      ${LYCORIS_TESTS:-tests/tilelang/test_tilelang_lora.py -k gpu_tile_configs} 2>&1 | tail -5
  fi
  echo "== TileLang tuning (bench/gpu_tilelang_tune.py $*)"
  timeout -s INT "${LYCORIS_TUNE_SECONDS:-400}" $py bench/gpu_tilelang_tune.py "$@" 2>&1 | tee "$out/tilelang_tune.log"
  tar czf "$final/results.tgz" -C "$out" . 2>/dev/null
  exit 0
fi

finish() {
  trap - EXIT TERM INT
  cp "$work"/*.log "$out/" 2>/dev/null
  tar czf "$final/results.tgz" -C "$out" . && echo "packed: $final/results.tgz"
  echo; echo "== summary"
  for f in "$work"/sweep-*.log; do echo "-- $(basename "$f" .log)"; grep -E "case runs|ran as|kernels built|FAIL|DEMOTED|stopped|all equal" "$f" | head -8; done
  [ -f "$work/tests.log" ] && { echo "-- GPU tests"; tail -3 "$work/tests.log"; }
  [ -f "$work/bench.log" ] && tail -40 "$work/bench.log"
}
trap finish EXIT
trap 'pkill -TERM -P $$ 2>/dev/null; finish' TERM INT

gpu_tests() {  # LYCORIS_TESTS (pytest arguments), after the sweeps: their kernels are in the cache
  [ -n "${LYCORIS_TESTS:-}" ] || return 0
  echo "== GPU tests: $LYCORIS_TESTS"
  (export CUDA_VISIBLE_DEVICES=$sweep_gpu
   eval "timeout -s INT ${LYCORIS_TESTS_SECONDS:-120} $py -m pytest -q -m '' -p no:cacheprovider $LYCORIS_TESTS") 2>&1 \
    | tee "$work/tests.log" | tail -5
}

sweep() {  # $1: cold|warm
  local pids=() g d dt tag parts=all
  # LYCORIS_SWEEP_SPLIT=dtype: one process per group and dtype, so a group's cold builds at
  # its three dtypes overlap (as one process, a 58-case group reached 23 cases in 180 s)
  [ "${LYCORIS_SWEEP_SPLIT:-}" = dtype ] && parts=$(echo "${LYCORIS_SWEEP_DTYPES:-float32,bfloat16,float16}" | tr , ' ')
  for g in $groups; do
    for d in $parts; do
      dt=${LYCORIS_SWEEP_DTYPES:-}; tag=${g//,/-}
      [ "$d" = all ] || { dt=$d; tag=$tag-$d; }
      CUDA_VISIBLE_DEVICES=$sweep_gpu timeout -s INT "${LYCORIS_SWEEP_SECONDS:-240}" $py bench/gpu_backends.py \
        --backends tilelang --families "$g" --max-seconds "$(( ${LYCORIS_SWEEP_SECONDS:-240} - 20 ))" \
        ${dt:+--dtypes "$dt"} >"$work/sweep-$1-$tag.log" 2>&1 &
      pids+=($!)
    done
  done
  wait "${pids[@]}"
}

bench() {  # its own empty TileLang cache: the cold first-call column must not reuse the sweeps' kernels
  [ "${LYCORIS_BENCH_SECONDS:-400}" != 0 ] || return 0  # (timeout 0 would mean no limit)
  TILELANG_CACHE_DIR=$work/tilelang-cache-bench CUDA_VISIBLE_DEVICES=0 timeout -s INT "${LYCORIS_BENCH_SECONDS:-400}" \
    $py bench/bench.py --out "$out" --commit "$commit" "$@" >"$work/bench.log" 2>&1
}

if [ "$ngpu" -ge 2 ]; then
  bench "$@" &
  bench_pid=$!
  sweep cold; [ "${LYCORIS_SWEEP_WARM:-1}" = 0 ] || sweep warm; gpu_tests
  wait $bench_pid
else
  sweep cold; [ "${LYCORIS_SWEEP_WARM:-1}" = 0 ] || sweep warm; gpu_tests
  bench "$@"
fi
