#!/usr/bin/env bash
# The GPU check, in one call: build, GPU tests, tuner check, per-op benchmark, end-to-end
# benchmark; a short table last.
#
#   bash bench/gpu_check.sh [all|tests|bench|verify] [bench.py args...]
#
# Stages: "tests" = the tuner check (empty table, then a fresh process that must not time),
# the GPU test suite, the backend sweep; "bench" = bench.py and bench/e2e.py. With two or
# more GPUs: bench.py on GPU 0 while e2e (then the tests) run on GPU 1, so a benchmark
# never shares its GPU; with one GPU, one after the other. "verify" (fits one 10-minute
# device call): the tuner check at the small and large bench token counts, the GPU suite
# and host_overhead.py (per call, --ops, --fb); no sweep, benchmark, host_profile or --plans. Stopped early (an outer
# timeout), the script still packs what it has and prints the summary.
#
# Runs on a CUDA machine (the device tool's H200: torch 2.11, triton 3.6).
# Optional, carried beside the repo (ignored by git):
#   .whl/      lycoris-lora 4.1.3 + toml wheels (the peer column of the benchmark)
#   TileLang:  a folder on PYTHONPATH holding tilelang, apache-tvm-ffi, torch-c-dlpack-ext
#              and z3-solver (pass it as LYCORIS_TILELANG_SITE=/path), or .tlsite/tl.tar.xz
#              from bench/pack_tilelang.sh (unpacked into /tmp/tl)
# Environment (all optional): LYCORIS_TESTS (pytest targets), LYCORIS_TESTS_SECONDS (the
# suite is interrupted after this, its summary still printed), LYCORIS_TUNING_ARGS,
# LYCORIS_BACKENDS_ARGS (empty: skip the sweep if "skip"), LYCORIS_E2E_ARGS ("skip": no e2e),
# LYCORIS_E2E_SECONDS, LYCORIS_BENCH_SECONDS, LYCORIS_TUNING_SECONDS, LYCORIS_COMMIT (no git checkout on the device),
# LYCORIS_HOST_PROFILE ("skip": no bench/host_profile.py after the lanes, when the GPUs are idle).
# Output: logs, CSVs and the e2e plot packed as ${OUT:-bench/out}/results.tgz.
set -uo pipefail
cd "$(dirname "$0")/.."
what=${1:-all}; shift || true
if [ "$what" = verify ]; then
  LYCORIS_BACKENDS_ARGS=skip
  LYCORIS_TUNING_ARGS=${LYCORIS_TUNING_ARGS:---shapes 3072x3072:r32,4096x4096:r64 --tokens 8192,32768}
  LYCORIS_TESTS_SECONDS=${LYCORIS_TESTS_SECONDS:-300}
  LYCORIS_TUNING_SECONDS=${LYCORIS_TUNING_SECONDS:-200}
fi
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
final=${OUT:-bench/out}; mkdir -p "$final"
work=$(mktemp -d)  # everything lives here until packed: the device returns few files
out=$work/out; mkdir -p "$out"
py=${PYTHON:-python3}

if [ -z "${LYCORIS_TILELANG_SITE:-}" ] && [ -f .tlsite/tl.tar.xz ]; then  # bench/pack_tilelang.sh
  mkdir -p /tmp/tl && tar -C /tmp/tl -xJf .tlsite/tl.tar.xz && export LYCORIS_TILELANG_SITE=/tmp/tl
fi
if [ -n "${LYCORIS_TILELANG_SITE:-}" ]; then export PYTHONPATH="$LYCORIS_TILELANG_SITE${PYTHONPATH:+:$PYTHONPATH}"; fi
if compgen -G ".whl/*.whl" >/dev/null; then
  $py -m pip install -q --no-index --no-deps --no-compile --target /tmp/peer_site .whl/*.whl >/dev/null 2>&1 \
    && export LYCORIS_PEER_PATH=/tmp/peer_site   # only the peer subprocess puts it on its path
fi

echo "== build ($(date -u +%FT%TZ))"
t0=$SECONDS
MAX_JOBS=16 $py -m pip install -q --no-build-isolation --no-deps -e . >"$work/build.log" 2>&1 || { tail -30 "$work/build.log"; exit 1; }
echo "built in $((SECONDS - t0)) s"
$py -c "import torch, triton, lycoris_ops as L; print('torch', torch.__version__, '| triton', triton.__version__, '|', torch.cuda.device_count(), 'x', torch.cuda.get_device_name()); print('backends', L.available_backends('cuda'))"
ngpu=$($py -c "import torch; print(torch.cuda.device_count())")
commit=${LYCORIS_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}  # the device copy's .git may be stale
touch "$work/status"

finish() {  # pack and summarize, also when an outer timeout stops the script
  trap - EXIT TERM INT
  if [ -f "$out/e2e.json" ] || compgen -G "$out/bench-*.csv" >/dev/null; then  # the ratio plot, both panels
    $py bench/plot.py $([ -f "$out/e2e.json" ] && echo --e2e "$out/e2e.json") \
      $(for c in "$out"/bench-*.csv; do [ -f "$c" ] && echo --csv "$c"; done) --out "$out/e2e_ratios.png" \
      >>"$work/plot.log" 2>&1 || echo "plot: failed (matplotlib?)" >>"$work/plot.log"
  fi
  for f in "$work"/*.log; do [ -f "$f" ] && cp "$f" "$out/"; done
  tar czf "$final/results.tgz" -C "$out" . && echo "packed: $final/results.tgz"
  echo; echo "== summary"
  [ -f "$work/e2e.log" ] && grep -A40 "^E2E" "$work/e2e.log" | head -30
  [ -f "$work/host_profile.log" ] && grep -A2 "^== lora_bypass_fwd  \|^torch.add" "$work/host_profile.log"
  [ -f "$work/host_overhead.log" ] && grep "torch.add  \|lora_bypass_fwd  \|forward+backward\|_bypass   " "$work/host_overhead.log"
  [ -f "$work/bench.log" ] && tail -45 "$work/bench.log"
  cat "$work/status"
  ! grep -qv "exit 0" "$work/status"
  exit $?
}
trap finish EXIT
trap 'echo "stopped: $(date -u +%T)" >>"$work/status"; pkill -TERM -P $$ 2>/dev/null; finish' TERM INT

tests_lane() {  # $1: CUDA_VISIBLE_DEVICES for the lane
  local rc t0
  export CUDA_VISIBLE_DEVICES=$1
  echo "== tuning (empty table, then a fresh process that must not time)"
  t0=$SECONDS
  # its own empty Triton cache: the cold phase compiles everything (e2e / the bench lane fill the shared one)
  TRITON_CACHE_DIR=$(mktemp -d) timeout -s INT "${LYCORIS_TUNING_SECONDS:-900}" $py bench/gpu_tuning.py \
    ${LYCORIS_TUNING_ARGS:-} >"$work/tuning.log" 2>&1; rc=$?
  tail -15 "$work/tuning.log"; echo "tuning: exit $rc in $((SECONDS - t0)) s"
  echo "tuning: exit $rc" >>"$work/status"
  echo "== GPU tests"
  t0=$SECONDS
  # SIGINT after the limit: pytest stops and still prints its summary
  timeout -s INT "${LYCORIS_TESTS_SECONDS:-1800}" $py -m pytest -q -n 8 -m "" -p no:cacheprovider --timeout 300 \
    ${LYCORIS_TESTS:-tests} >"$work/tests.log" 2>&1; rc=$?
  grep -E "^(FAILED|ERROR)" "$work/tests.log" | head -20; tail -3 "$work/tests.log"
  echo "tests: exit $rc in $((SECONDS - t0)) s"; echo "tests: exit $rc: $(tail -1 "$work/tests.log")" >>"$work/status"
  if [ "${LYCORIS_BACKENDS_ARGS:-}" != skip ]; then
    echo "== backends on CUDA (every op, every LYCORIS_KERNEL_BACKEND, compiled)"
    t0=$SECONDS
    $py bench/gpu_backends.py ${LYCORIS_BACKENDS_ARGS:-} >"$work/backends.log" 2>&1; rc=$?
    tail -25 "$work/backends.log"; echo "backends: exit $rc in $((SECONDS - t0)) s"
    echo "backends: exit $rc" >>"$work/status"
  fi
}

bench_lane() {  # $1: CUDA_VISIBLE_DEVICES; the rest: bench.py args
  local rc dev=$1; shift
  export CUDA_VISIBLE_DEVICES=$dev
  echo "== benchmark (GPU $dev)"
  timeout -s INT "${LYCORIS_BENCH_SECONDS:-1800}" $py bench/bench.py --out "$out" --commit "$commit" "$@" \
    >"$work/bench.log" 2>&1; rc=$?
  echo "bench: exit $rc" >>"$work/status"
}

e2e_lane() {  # $1: CUDA_VISIBLE_DEVICES
  local rc
  [ "${LYCORIS_E2E_ARGS:-}" = skip ] && return
  export CUDA_VISIBLE_DEVICES=$1
  echo "== end-to-end training step (GPU $1)"
  timeout -s INT "${LYCORIS_E2E_SECONDS:-900}" $py bench/e2e.py --out "$out" --profile ${LYCORIS_E2E_ARGS:-} \
    >"$work/e2e.log" 2>&1; rc=$?
  echo "e2e: exit $rc" >>"$work/status"
}

if [ "$ngpu" -ge 2 ] && [ "$what" != tests ] && [ "$what" != verify ]; then
  echo "== two lanes: per-op benchmark on GPU 0; e2e$([ "$what" = all ] && echo ", then tests") on GPU 1"
  (bench_lane 0 "$@") >"$work/bench_lane.log" 2>&1 &
  bench_pid=$!
  e2e_lane 1
  [ "$what" = all ] && tests_lane 1
  wait $bench_pid
  cat "$work/bench_lane.log"
else
  if [ "$what" = all ] || [ "$what" = tests ] || [ "$what" = verify ]; then tests_lane "${CUDA_VISIBLE_DEVICES:-0}"; fi
  if [ "$what" = all ] || [ "$what" = bench ]; then
    bench_lane "${CUDA_VISIBLE_DEVICES:-0}" "$@"; e2e_lane "${CUDA_VISIBLE_DEVICES:-0}"
  fi
fi

if [ "$what" != tests ] && [ "${LYCORIS_HOST_PROFILE:-}" != skip ]; then  # host time per layer, GPUs idle
  if [ "$what" != verify ]; then
    echo "== host time per layer (bench/host_profile.py)"
    timeout 180 $py bench/host_profile.py --calls 2000 --top 0 >"$work/host_profile.log" 2>&1
    echo "host_profile: exit $?" >>"$work/status"
  fi
  echo "== host time per call, replay plans (bench/host_overhead.py)"
  { timeout 120 $py bench/host_overhead.py --calls 3000 && timeout 120 $py bench/host_overhead.py --ops --calls 2000 \
    && timeout 120 $py bench/host_overhead.py --fb --calls 2100 \
    && timeout 120 $py bench/host_overhead.py --specs --calls 500 \
    && { [ "$what" = verify ] || timeout 240 $py bench/host_overhead.py --plans; }; } \
    >"$work/host_overhead.log" 2>&1
  echo "host_overhead: exit $?" >>"$work/status"
fi
