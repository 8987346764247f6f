#!/usr/bin/env bash
# The kernel-form A/Bs in one device call (TileLang's, and the Triton t_* runs): build, then each variants script in turn,
# its whole output in $OUT/<name>.log (TileLang's INFO lines included), the tables printed last.
#
#   bash bench/gpu_variants.sh [name ...]     (default: ``profile``, device time per kernel,
#                                              bench/kernel_profile.py: no kernel-form flag is
#                                              undecided since RESULTS.md 2026-12-03 08:40,
#                                              which timed boft's COMPOSE_BWD_PAD and lora_fwd's
#                                              pipe_groups / one_group)
#
# Each script times forms of one kernel family on the bench shapes (see its docstring); the
# forms a run decides are module flags (``tilelang/*.py``) that stay off until a table here
# says on. TileLang comes from .tlsite (bench/pack_tilelang.sh) or LYCORIS_TILELANG_SITE.
# LYCORIS_VARIANT_SECONDS: the limit of each script (default 150); LYCORIS_VARIANT_ARGS: appended
# to every script's arguments (``--smoke``: the CPU twins, a dry run of this script on a CPU
# host, with LYCORIS_SKIP_BUILD=1 where the package is installed already).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
final=${OUT:-bench/out}; mkdir -p "$final"; rm -f "$final/status.txt"
py=${PYTHON:-python3}
if [ -z "${LYCORIS_TILELANG_SITE:-}" ] && [ -f .tlsite/tl.tar.xz ]; then
  mkdir -p /tmp/tl && tar -C /tmp/tl -xJf .tlsite/tl.tar.xz && export LYCORIS_TILELANG_SITE=/tmp/tl
fi
[ -n "${LYCORIS_TILELANG_SITE:-}" ] && export PYTHONPATH="$LYCORIS_TILELANG_SITE${PYTHONPATH:+:$PYTHONPATH}"
export TILELANG_CACHE_DIR=${TILELANG_CACHE_DIR:-/tmp/tlcache}
[ -n "${LYCORIS_SKIP_BUILD:-}" ] || MAX_JOBS=16 $py -m pip install -q --no-build-isolation --no-deps -e . >"$final/build.log" 2>&1 || { tail -30 "$final/build.log"; exit 1; }
declare -A RUNS=(
  [tucker]="bench/tilelang_tucker_variants.py --variants all-k,all-k\ pipe,all-k\ pre"
  [lora_fwd]="bench/tilelang_lora_variants.py --op bypass --variants staged\ pipe,staged\ pipe\ g,staged\ pipe\ 1g"
  [lora_bwd]="bench/tilelang_lora_variants.py --op bypass_bwd --variants ws,staged\ pipe,staged"
  [lokr]="bench/tilelang_lora_variants.py --op lokr --variants persistent,fused\\ wgrads,fused\\ bwd,persist\\ split"
  [ia3]="bench/tilelang_stream_variants.py --op ia3"
  [ia3_cf]="bench/tilelang_stream_variants.py --op ia3 --layout first --variants per_sm\ 2,per_sm\ 4,pipe\ 2,pipe\ 4"
  [dora]="bench/tilelang_stream_variants.py --op dora"
  [lokr_sum]="bench/tilelang_lora_variants.py --op lokr --variants fused\\ bwd,fused\\ bwd\\ sum8,fused\\ bwd\\ sum32"
  [lokr_tests]="-m pytest -q -n 3 -m '' -p no:cacheprovider tests/test_tilelang_lokr.py -k fused\\ or\\ split\\ or\\ sum_partials"
  [host]="bench/host_overhead.py --ops"
  [profile_t]="bench/kernel_profile.py --backend triton --specs lokr_bypass,loha_bypass,lora_bypass"
  [profile]="bench/kernel_profile.py --specs lokr_bypass,lora_bypass,boft"
  [boft]="bench/tilelang_boft_variants.py --variants compose3\ bwd\ split,compose3\ bwd\ split\ pad,compose3\ bwd\ pad"
  [merge_bwd]="bench/tilelang_lora_variants.py --op merge_bwd"
  [hada_bwd]="bench/tilelang_lora_variants.py --op hada_bwd"
  # the LoHa pair kernel's K step wider than its band (GRADS_PAIR BK): a program's serial chain of steps halves
  [hada_k]="bench/tilelang_lora_variants.py --op hada_bwd --variants pair\\ 32,pair\\ 32\\ k64,pair\\ 32\\ k128,pair\\ 32\\ k128\\ s1,pair\\ 64\\ k128,split"
  [merge]="bench/tilelang_lora_variants.py --op merge --variants staged,stream,stream\\ s3,stream\\ n256,stream\\ m128"
  [merge_tests]="-m pytest -q -n 3 -m '' -p no:cacheprovider tests/test_tilelang_lora.py -k merge_stream"
  [loha_tests]="-m pytest -q -n 3 -m '' -p no:cacheprovider tests/test_tilelang_loha.py -k pair\\ or\\ parity\\ or\\ tile"
  [boft_tests]="-m pytest -q -n 3 -m '' -p no:cacheprovider tests/test_tilelang_boft.py -k compose\\ or\\ leading"
  # the Triton launch options wired in and off (RESULTS 2026-12-04 21:20): BOFT's position-major
  # tiles and Cayley warps, diag-OFT's L2 prefetch; their GPU parity first
  # (t_boft compiles ~20 configs a shape: LYCORIS_VARIANT_SECONDS=280)
  [t_oft_tests]="-m pytest -q -n 8 -m '' -p no:cacheprovider tests/test_triton_oft.py tests/test_boft.py tests/test_oft.py"
  [t_boft]="bench/variants.py boft --shapes small,large"
  [t_oft]="bench/variants.py oft --shapes large,small --phases fwd"
  # TileLang's one-pass LoKr merge backward and streamed forward (GRADS one_pass, KRON stream: tuned configs' keys,
  # off in the fixed configs)
  [lokr_merge_tests]="-m pytest -q -n 3 -m '' -p no:cacheprovider tests/test_tilelang_lokr.py -k one_pass\\ or\\ streamed\\ or\\ tile_configs\\ or\\ parity"
  [lokr_merge_bwd]="bench/tilelang_lora_variants.py --op lokr_merge_bwd"
  [lokr_merge_fwd]="bench/tilelang_lora_variants.py --op lokr_merge_fwd"
  # where one TileLang build's seconds go on the device's host (3-10 s there, 2.4 s median on the CPU host:
  # RESULTS 2026-12-04 23:06): nvcc, the host compiler, TileLang's passes
  [tl_build_dora]="bench/tilelang_build_profile.py dora 2"
  [tl_build_lokr]="bench/tilelang_build_profile.py lokr 23"  # kron_wgrads_kernel, the one-pass bypass backward
  # TileLang cold keys with the deferred shortlists (plans/tilelang.DEFER, 2026-12-05): each op's cold call
  # alone in a fresh process with empty caches, the background builds' seconds, the call that then times them,
  # and a warm process that must time and build nothing
  # the one-pass LoKr bypass backward (g_w1 from U = G·W2 since 2026-12-05) against its async-WGMMA form
  [lokr_async]="bench/tilelang_lora_variants.py --op lokr --variants fused\\ bwd,fused\\ bwd\\ async,fused\\ bwd\\ finish,fused\\ bwd\\ async\\ finish"
  [lokr_async_tests]="-m pytest -q -n 3 -m '' -p no:cacheprovider tests/test_tilelang_lokr.py -k async\\ or\\ staged_gx\\ or\\ wgrads_finish"
  # TileLang's Cayley / chain Gauss–Jordan stepping over the blocks' entries alone (oft.GJ_PINGPONG "entries", the default):
  # its GPU parity (every solve form), then the A/B against each step over the whole group (BOFT small: s = 24, 2 blocks in 64)
  [gj_tests]="-m pytest -q -n 8 -m '' -p no:cacheprovider tests/test_tilelang_oft.py tests/test_tilelang_boft.py -k cayley\\ or\\ test_oft\\ or\\ test_boft"
  [gj_entries]="bench/tilelang_boft_variants.py --shapes small,large --variants gj\\ steps,gj\\ entries"
  # the backward's 96-wide composed units (BOFT small: GC = 48) unpadded, the stream on mma.sync (COMPOSE_BWD_MMA,
  # on since 2026-12-06): boft_tests first (its "mma" cases), then the A/B against those units one launch a stage
  [boft_mma]="bench/tilelang_boft_variants.py --shapes small --variants compose3\\ bwd\\ split,compose3\\ bwd\\ split\\ mma,compose3\\ bwd\\ mma"
  # the leading stages that share one box as one unit (COMPOSE_LEADING, on since 2026-12-06): its parity (boft_tests),
  # then the A/B
  [boft_lead]="bench/tilelang_boft_variants.py --shapes small --variants defaults,leading,defaults,leading"
  # the chain kernel over the blocks' entries (oft.CHAIN_BLOCKS, on) and Cayley's row-wise Fᵀ stores: their GPU
  # parity (every oft / boft chain and Cayley form, the batched partials), then the chain A/B
  [chain_tests]="-m pytest -q -n 8 -m '' -p no:cacheprovider tests/test_tilelang_oft.py tests/test_tilelang_boft.py -k not\\ compile"
  [boft_chain]="bench/tilelang_boft_variants.py --shapes small,large --variants chain\\ full,chain\\ blocks,chain\\ full,chain\\ blocks"
  # BOFT small's kernels one by one under each backend: where TileLang's backward spends what Triton's does not
  [profile_boft]="bench/kernel_profile.py --specs boft --shape small --backend tilelang"
  [profile_boft_t]="bench/kernel_profile.py --specs boft --shape small --backend triton"
  [tl_cold]="bench/gpu_tilelang_tune.py --families lokr,lora,loha,boft --shapes 3072x3072:r32 --tokens 8192"
)
names=("$@"); [ ${#names[@]} -eq 0 ] && names=(profile)
for n in "${names[@]}"; do
  [ -n "${RUNS[$n]:-}" ] || { echo "unknown run $n (of: ${!RUNS[*]})"; continue; }
  eval "timeout ${LYCORIS_VARIANT_SECONDS:-150} $py ${RUNS[$n]} ${LYCORIS_VARIANT_ARGS:-}" >"$final/$n.log" 2>&1
  echo "$n: exit $?" >>"$final/status.txt"
done
cat "$final/status.txt"
for n in "${names[@]}"; do
  echo "== $n: ${RUNS[$n]:-}"
  grep -v -e "INFO" -e "^\s*$" "$final/$n.log" | tail -20
done
