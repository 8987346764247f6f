#!/usr/bin/env bash
# One device call that compares this tree with an earlier one and runs the user-shape checks:
#
#   bash bench/gpu_before_after.sh BEFORE_DIR [SECONDS]
#
# BEFORE_DIR: an earlier tree of this repository (e.g. `git archive <commit> | tar -x -C
# .before`, carried beside the checkout). Stages, each capped so the whole call ends inside
# SECONDS (default 560):
#   1. build: both trees' extensions in place, side by side (setup.py build_ext --inplace);
#   2. parity: bench/gpu_backends.py on this tree, with parity_before first on the earlier one
#      (every op's cases on CUDA under each backend against the CPU result, then inside
#      torch.compile(fullgraph=True));
#   3. bench: bench/bench.py --quick in the earlier tree, then in this one (the ratios to
#      compare, measured in the same call);
#   4. matrix: bench/matrix.py (the shape matrix, as far as its budget reaches);
#   5. bridge: bench/gpu_bridge.py bench (lycoris-lora networks on our ops against its own).
# Logs and JSON land in ${OUT:-bench/out}/; .whl/ (lycoris-lora and its pure-Python needs) is
# installed into /tmp/peer_site for the peer columns.
# Environment (all optional): STAGES (default "parity bench matrix bridge"; the build always
# runs; "parity_before" adds the earlier tree's parity sweep), PARITY_ARGS / MATRIX_ARGS /
# BRIDGE_ARGS (extra arguments of those scripts), PARITY_GROUPS (the parity sweep's family groups, run
# concurrently), and each stage's cap in seconds: PARITY_S (130), BENCH_S (75 a side), MATRIX_S (190),
# BRIDGE_S (100);
# PACK=1: everything under the output folder packed into its all.tgz at the end.
set -uo pipefail
before=$(cd "${1:?usage: gpu_before_after.sh BEFORE_DIR [SECONDS]}" && pwd) || exit 2
stages=" ${STAGES:-parity bench matrix bridge} "
want() { [[ "$stages" == *" $1 "* ]]; }
budget=${2:-560}
here=$(cd "$(dirname "$0")/.." && pwd)
out=${OUT:-$here/bench/out}; mkdir -p "$out"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
py=${PYTHON:-python3}
start=$SECONDS
left() { echo $(( budget - (SECONDS - start) )); }
cap() { local want=$1 l; l=$(left); [ "$l" -lt "$want" ] && want=$l; [ "$want" -lt 5 ] && want=5; echo "$want"; }

if compgen -G "$here/.whl/*.whl" >/dev/null; then
  $py -m pip install -q --no-index --no-deps --no-compile --target /tmp/peer_site "$here"/.whl/*.whl >/dev/null 2>&1 \
    && export LYCORIS_PEER_PATH=/tmp/peer_site
fi

echo "== build ($(date -u +%FT%TZ))"
(cd "$before" && MAX_JOBS=8 $py setup.py -q build_ext --inplace >"$out/build_before.log" 2>&1) &
(cd "$here" && MAX_JOBS=8 $py setup.py -q build_ext --inplace >"$out/build_after.log" 2>&1) &
wait
for t in "$before" "$here"; do
  (cd "$t" && PYTHONPATH=$t $py -c "import torch, triton, lycoris_ops as L; print(L.__file__, torch.__version__, triton.__version__, torch.cuda.get_device_name())") \
    || { tail -20 "$out"/build_*.log; exit 1; }
done
echo "built in $((SECONDS - start)) s"

# parity: this tree; parity_before (also in STAGES): the earlier tree's sweep first, the same arguments.
# PARITY_GROUPS="lokr oft dora,loha ...": one process per family group and tree, all at once (a
# correctness sweep, compile-bound: the host's cores, not the GPU, set its time)
want parity_before && sides="before after" || sides="after"
parity_run() {  # side group
  local tree=$before log="$out/parity_$1${2:+_${2//,/-}}.log"; [ "$1" = after ] && tree=$here
  (cd "$tree" && PYTHONPATH=$tree timeout "$pcap" $py bench/gpu_backends.py --dtypes float32,bfloat16,float16 \
     ${2:+--families $2} --max-seconds "$(( pcap - 20 ))" ${PARITY_ARGS:-} >"$log" 2>&1)
  echo "parity $1 ${2:-all}: exit $?"; grep -E "FAIL|mismatch|Traceback|Error" "$log" | head -5; tail -2 "$log"
}
if want parity; then
  pcap=$(cap "${PARITY_S:-130}")
  if [ -n "${PARITY_GROUPS:-}" ]; then
    echo "== parity ($sides; groups: $PARITY_GROUPS; cap $pcap s)"
    for side in $sides; do for g in $PARITY_GROUPS; do parity_run "$side" "$g" >"$out/.p_${side}_$g" & done; done
    wait; cat "$out"/.p_*; rm -f "$out"/.p_*
  else
    for side in $sides; do echo "== parity ($side)"; parity_run "$side" ""; done
  fi
fi

want bench && for side in before after; do
  tree=$before; [ $side = after ] && tree=$here
  echo "== bench --quick ($side)"
  (cd "$tree" && PYTHONPATH=$tree timeout "$(cap "${BENCH_S:-75}")" $py bench/bench.py --quick --no-host --max-seconds "$(( ${BENCH_S:-75} - 15 ))" \
     --out "$out/bench_$side" --results "$out/bench_$side.md" >"$out/bench_$side.log" 2>&1)
  echo "bench $side: exit $?"; tail -22 "$out/bench_$side.log"
done

if want matrix; then
echo "== matrix"
# the matrix's own budget ends a minute before the cap: its summary and plot come after the cells
m=$(cap "${MATRIX_S:-190}")
PYTHONPATH=$here timeout "$m" $py "$here/bench/matrix.py" --seconds "$(( m > 120 ? m - 60 : m / 2 ))" --out "$out/matrix" \
  --results "$out/matrix/RESULTS.md" ${MATRIX_ARGS:-} >"$out/matrix.log" 2>&1
echo "matrix: exit $?"; tail -40 "$out/matrix.log"
fi

if want bridge; then
echo "== bridge"
PYTHONPATH=$here timeout "$(cap "${BRIDGE_S:-100}")" $py "$here/bench/gpu_bridge.py" bench --models transformer --steps 10 --warmup 2 \
  --out "$out/bridge" ${BRIDGE_ARGS:-} >"$out/bridge.log" 2>&1
echo "bridge: exit $?"; tail -25 "$out/bridge.log"
fi
echo "== done in $((SECONDS - start)) s"
# a device call returns at most 8 files: PACK=1 leaves one archive of everything in $out
if [ "${PACK:-0}" = 1 ]; then
  tar -czf "$out.tgz" -C "$out" --exclude='*cache*' --exclude='*tuning*' . && rm -rf "${out:?}"/* && mv "$out.tgz" "$out/all.tgz"
fi
