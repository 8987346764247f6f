#!/usr/bin/env bash
# The GPU check, in one call: build, GPU tests, backend check, benchmark; a short table last.
#
#   bash bench/gpu_check.sh [all|tests|bench] [bench args...]
#
# Runs on a CUDA machine (the H200 of the device tool: torch 2.11, triton 3.6).
# Optional, carried beside the repo (ignored by git):
#   .whl/      lycoris-lora 4.1.3 + toml wheels (the peer column of the benchmark)
#   TileLang:  a folder on PYTHONPATH holding tilelang, apache-tvm-ffi, torch-c-dlpack-ext
#              and z3-solver (pass it as LYCORIS_TILELANG_SITE=/path)
# Output: logs and CSVs under ${OUT:-bench/out}.
set -uo pipefail
cd "$(dirname "$0")/.."
what=${1:-all}; shift || true
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
out=${OUT:-bench/out}; mkdir -p "$out"
py=${PYTHON:-python3}
status=0

if [ -n "${LYCORIS_TILELANG_SITE:-}" ]; then export PYTHONPATH="$LYCORIS_TILELANG_SITE${PYTHONPATH:+:$PYTHONPATH}"; fi
if compgen -G ".whl/*.whl" >/dev/null; then
  $py -m pip install -q --no-index --no-deps --no-compile --target /tmp/peer_site .whl/*.whl >/dev/null 2>&1 \
    && export LYCORIS_PEER_PATH=/tmp/peer_site   # only the peer subprocess puts it on its path
fi

echo "== build ($(date -u +%FT%TZ))"
t0=$SECONDS
MAX_JOBS=16 $py -m pip install -q --no-build-isolation --no-deps -e . >"$out/build.log" 2>&1 || { tail -30 "$out/build.log"; exit 1; }
echo "built in $((SECONDS - t0)) s"
$py -c "import torch, triton, lycoris_ops as L; print('torch', torch.__version__, '| triton', triton.__version__, '|', torch.cuda.get_device_name()); print('backends', L.available_backends('cuda'))"

if [ "$what" = all ] || [ "$what" = tests ]; then
  echo "== tuning (empty table, then a fresh process that must not time)"
  t0=$SECONDS
  $py bench/gpu_tuning.py ${LYCORIS_TUNING_ARGS:-} >"$out/tuning.log" 2>&1; rc=$?
  tail -15 "$out/tuning.log"; echo "tuning: exit $rc in $((SECONDS - t0)) s"; [ $rc -eq 0 ] || status=1
  echo "== GPU tests"
  t0=$SECONDS
  # -n: pytest-xdist is on the GPU image; the CPU-only tests run too (they are fast there)
  $py -m pytest -q -n 8 -p no:cacheprovider ${LYCORIS_TESTS:-tests} >"$out/tests.log" 2>&1; rc=$?
  tail -25 "$out/tests.log"; echo "tests: exit $rc in $((SECONDS - t0)) s"; [ $rc -eq 0 ] || status=1
  echo "== backends on CUDA (every op, every LYCORIS_KERNEL_BACKEND, compiled)"
  t0=$SECONDS
  $py bench/gpu_backends.py ${LYCORIS_BACKENDS_ARGS:-} >"$out/backends.log" 2>&1; rc=$?
  tail -40 "$out/backends.log"; echo "backends: exit $rc in $((SECONDS - t0)) s"; [ $rc -eq 0 ] || status=1
fi

if [ "$what" = all ] || [ "$what" = bench ]; then
  echo "== benchmark"
  commit=$(git rev-parse --short HEAD 2>/dev/null || echo "${LYCORIS_COMMIT:-unknown}")
  $py bench/bench.py --out "$out" --commit "$commit" "$@" 2>&1 | tee "$out/bench.log"; [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
fi
exit $status
