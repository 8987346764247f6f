#!/usr/bin/env bash
# The multi-GPU check, in one call on a machine with two or more GPUs (nvidia-h200-x2):
# build; device-index/stream tests; DDP and FSDP2 training (LoRA, LoKr; eager and compiled)
# against the single-GPU curve; ranks tuning into one table, then a launch that must not time;
# step time on 1 and 2 GPUs, ours vs eager adapters. A short table last.
#
#   bash bench/gpu_multi.sh [all|parity|tuning|scaling]
set -uo pipefail
cd "$(dirname "$0")/.."
what=${1:-all}
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 OMP_NUM_THREADS=4
out=${OUT:-bench/out}; mkdir -p "$out"
py=${PYTHON:-python3}
run="$py -m torch.distributed.run --standalone --nproc-per-node 2"
status=0; summary=()
note() { summary+=("$1"); }

echo "== build ($(date -u +%FT%TZ))"
t0=$SECONDS
MAX_JOBS=16 $py -m pip install -q --no-build-isolation --no-deps -e . >"$out/build.log" 2>&1 || { tail -30 "$out/build.log"; exit 1; }
echo "built in $((SECONDS - t0)) s"
$py -c "import torch, triton, lycoris_ops as L; print('torch', torch.__version__, '| triton', triton.__version__, '|', torch.cuda.device_count(), 'x', torch.cuda.get_device_name()); print('backends', L.available_backends('cuda'))"

if [ "$what" = all ] || [ "$what" = parity ]; then
  echo "== device-index tests || single-GPU reference curves (GPU 0)"
  t0=$SECONDS
  # the reference runs while the tests run (its own process, GPU 0 only)
  CUDA_VISIBLE_DEVICES=0 $py examples/multigpu_train.py --out "$out/mg_ref.json" >"$out/mg_ref.log" 2>&1 &
  ref_pid=$!
  LYCORIS_KERNEL_TUNE=off $py -m pytest -q -n 4 -m "" -p no:cacheprovider tests/backends/test_multi_gpu.py >"$out/mg_tests.log" 2>&1; rc=$?
  tail -8 "$out/mg_tests.log"; echo "tests: exit $rc in $((SECONDS - t0)) s"; [ $rc -eq 0 ] || status=1
  note "device-index tests: $(tail -1 "$out/mg_tests.log")"
  wait $ref_pid; rc=$?; cat "$out/mg_ref.log" | tail -6; [ $rc -eq 0 ] || status=1
  echo "== DDP and FSDP2 on 2 GPUs (eager and compiled)"
  t0=$SECONDS
  $run examples/multigpu_train.py --parallel ddp,fsdp2 --out "$out/mg_dist.json" >"$out/mg_dist.log" 2>&1; rc=$?
  grep -E "^(lora|lokr)" "$out/mg_dist.log"; [ $rc -eq 0 ] || { tail -30 "$out/mg_dist.log"; status=1; }
  echo "training: exit $rc in $((SECONDS - t0)) s"
  $py examples/multigpu_train.py --compare "$out/mg_ref.json" "$out/mg_dist.json" | tee "$out/mg_compare.txt"
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
  note "$(cat "$out/mg_compare.txt")"
fi

if [ "$what" = all ] || [ "$what" = tuning ]; then
  echo "== two ranks tune into one table, then a warm launch"
  tbl=$(mktemp -d)
  t0=$SECONDS
  $run examples/multigpu_tuning.py --cache-dir "$tbl" >"$out/mg_tune_cold.log" 2>&1; rc=$?
  grep -vE "^(W|I)[0-9]{4}" "$out/mg_tune_cold.log" | tail -8; echo "cold: exit $rc in $((SECONDS - t0)) s"; [ $rc -eq 0 ] || status=1
  t0=$SECONDS
  $run examples/multigpu_tuning.py --cache-dir "$tbl" --expect-warm >"$out/mg_tune_warm.log" 2>&1; rc=$?
  grep -vE "^(W|I)[0-9]{4}" "$out/mg_tune_warm.log" | tail -8; echo "warm: exit $rc in $((SECONDS - t0)) s"; [ $rc -eq 0 ] || status=1
  note "shared table cold: $(grep -E 'table |rank ' "$out/mg_tune_cold.log" | tr '\n' ';')"
  note "shared table warm: $(grep -E 'rank |shared table' "$out/mg_tune_warm.log" | tr '\n' ';')"
fi

if [ "$what" = all ] || [ "$what" = scaling ]; then
  echo "== step time, 1 and 2 GPUs (DDP), ours vs eager adapters"
  t0=$SECONDS
  CUDA_VISIBLE_DEVICES=0 $py examples/multigpu_train.py --bench --out "$out/mg_bench1.json" >"$out/mg_bench1.log" 2>&1 || status=1
  $run examples/multigpu_train.py --bench --parallel ddp --out "$out/mg_bench2.json" >"$out/mg_bench2.log" 2>&1 || status=1
  echo "scaling in $((SECONDS - t0)) s"
  $py - "$out/mg_bench1.json" "$out/mg_bench2.json" <<'EOF' | tee "$out/mg_scaling.txt"
import json, sys
one, two = (json.load(open(p)) for p in sys.argv[1:3])
m = one["meta"]
print(f"scaling: D={m['dim']} heads={m['heads']} blocks={m['layers']} {m['seq']} tokens/GPU {m['dtype']} rank {m['rank']}, DDP, not compiled")
print(f"{'adapter':7s} {'impl':5s} {'1 GPU ms':>9s} {'2 GPU ms':>9s} {'tok/s 1':>9s} {'tok/s 2':>9s} {'scaling':>7s}")
for a in one["runs"]:
    b = next(r for r in two["runs"] if (r["adapter"], r["impl"]) == (a["adapter"], a["impl"]))
    print(f"{a['adapter']:7s} {a['impl']:5s} {a['step_ms']:9.2f} {b['step_ms']:9.2f} {a['tokens_per_s']:9.0f} "
          f"{b['tokens_per_s']:9.0f} {b['tokens_per_s'] / a['tokens_per_s']:7.2f}x")
EOF
  note "$(cat "$out/mg_scaling.txt" 2>/dev/null)"
fi

echo; echo "== summary"
printf '%s\n' "${summary[@]}"
echo "multi-GPU check: $([ $status -eq 0 ] && echo PASS || echo FAIL)"
exit $status
