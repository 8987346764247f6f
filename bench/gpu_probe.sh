#!/usr/bin/env bash
# The open speed questions of issue #60, measured in one device call (about 9 minutes):
#   1. the UNet DoRA row's host profile: which of our op calls reach Python (no C++ replay),
#      synchronizing calls, device time per op class; PEFT compiled and the CUDA-graph rows
#      (ours-graphs / peft-graphs) beside it;
#   2. the step-down tier: LoKr cells whose backward is out of the fused scope (factor > 128)
#      with the compile tier on and off (TORCHDYNAMO_DISABLE=1: the compile tier runs the
#      eager step-down body): warm ms and the cold first call of each;
#   3. deferred cold keys (LYCORIS_KERNEL_TUNE_DEFER=0 / 1) on Flux cells: cold first calls,
#      background seconds and warm ms;
#   4. the GPU tests of the tuner, the Triton precompile children, the launch replay and CUDA graphs.
#
#   bash bench/gpu_probe.sh            (OUT=dir for the logs and JSONs; default bench/out/probe)
#
# Runs on a CUDA machine; .whl/ as for gpu_check.sh. Stages run in order of value: a device
# call cut short keeps the first ones' results.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
OUT=${OUT:-bench/out/probe}; mkdir -p "$OUT"
py=${PYTHON:-python3}
if compgen -G ".whl/*.whl" >/dev/null; then
  $py -m pip install -q --no-index --no-deps --no-compile --target /tmp/peer_site .whl/*.whl >/dev/null 2>&1 \
    && export LYCORIS_PEER_PATH=/tmp/peer_site
fi
T=$SECONDS
MAX_JOBS=16 $py -m pip install -q --no-build-isolation --no-deps -e . >"$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; exit 1; }
export LYCORIS_BENCH_COMMIT=${LYCORIS_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
echo "built in $((SECONDS - T)) s; commit $LYCORIS_BENCH_COMMIT"
$py -c "import torch, triton; print('torch', torch.__version__, '| triton', triton.__version__, '|', torch.cuda.get_device_name())"

echo "== 1. e2e UNet DoRA: host profile, sync debug, profile"
timeout 170 $py bench/e2e.py --quick --reps 8 --warmup 3 --model unet --adapters dora \
  --variants ours-compiled,peft-compiled,ours-graphs,peft-graphs --profile --host-profile --sync-debug \
  --out "$OUT/e2e" 2>&1 | grep -v "^\s*$" | grep -iv "warn" | tee "$OUT/e2e.log" | head -220
echo "stage 1 done at $((SECONDS - T)) s"

cells() {  # one line per measured cell of a matrix JSON
  $py - "$1" <<'PY'
import json, sys
for c in json.load(open(sys.argv[1]))["cells"]:
    o, e = c.get("ours") or {}, c.get("eager") or {}
    print(f'{c["algo"]} {c["model"]} {c["layer"]} {c["setting"]}: cold {o.get("cold_fwd_s")} + {o.get("cold_fwdbwd_s")} s'
          f' (background {o.get("background_fwd_s")} + {o.get("background_fwdbwd_s")}) | ms ours {o.get("fwd")} / {o.get("fwdbwd")}'
          f' eager {e.get("fwd")} / {e.get("fwdbwd")} {o.get("error", "")}'[:400])
PY
}
for d in 0 1; do
  echo "== 2. step-down tier: TORCHDYNAMO_DISABLE=$d"
  TORCHDYNAMO_DISABLE=$d timeout 75 $py bench/matrix.py --algo lokr --model bench,flux --setting f8,f4 --dtype bf16 \
    --limit 3 --compile none --no-peer --seconds 60 --out "$OUT/tier$d" --results "$OUT/tier$d.md" >"$OUT/tier$d.log" 2>&1
  cells "$OUT/tier$d/matrix.json"
done
echo "stage 2 done at $((SECONDS - T)) s"
for d in 0 1; do
  echo "== 3. cold keys: LYCORIS_KERNEL_TUNE_DEFER=$d"
  LYCORIS_KERNEL_TUNE_DEFER=$d timeout 65 $py bench/matrix.py --algo lora,oft,boft,lokr --model flux --layer attn.to_q \
    --dtype bf16 --setting r32,dim32,f-1 --limit 4 --compile none --no-peer --seconds 50 --out "$OUT/cold$d" \
    --results "$OUT/cold$d.md" >"$OUT/cold$d.log" 2>&1
  cells "$OUT/cold$d/matrix.json"
done
echo "stage 3 done at $((SECONDS - T)) s"
echo "== 4. GPU tests: tuner, precompile children, launch replay, CUDA graphs (DoRA rescale, ad2919d)"
timeout -s INT 100 $py -m pytest -q -n 8 -m "" -p no:cacheprovider --timeout 90 tests/tuner \
  tests/triton/test_precompile.py tests/backends/test_launch_replay.py tests/backends/test_cuda_graphs.py 2>&1 | tail -8
echo "total $((SECONDS - T)) s"
