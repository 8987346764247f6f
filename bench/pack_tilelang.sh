#!/usr/bin/env bash
# Packs TileLang for the GPU machine (Python 3.12, no network) into one carried file:
#   bash bench/pack_tilelang.sh            # writes .tlsite/tl.tar.xz (about 37 MB)
# The four wheels (tilelang, apache-tvm-ffi, torch-c-dlpack-ext, z3-solver; ~80 MB as wheels)
# are over what one device call may carry, so they are installed here into a folder, trimmed
# (z3's command-line binary and its second copy of libz3, kept as a link) and xz-packed.
# bench/gpu_check.sh and bench/gpu_tilelang.sh unpack it into /tmp/tl when it is carried
# (carry: [".tlsite"]; the script adds ".tlsite/" to .git/info/exclude).
set -euo pipefail
cd "$(dirname "$0")/.."
wheels=$(mktemp -d); site=$(mktemp -d)
get="python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp
     --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 -d $wheels"
$get tilelang==0.1.15 'apache-tvm-ffi>=0.1.11,<0.1.13' torch-c-dlpack-ext 'z3-solver>=4.13,<4.15.5'
python3 -m pip install -q --no-index --no-deps --no-compile --target "$site" --python-version 3.12 \
  --implementation cp --only-binary=:all: "$wheels"/*.whl
rm -rf "$site/bin"                                   # z3's executable: TileLang loads the library
ln -sf libz3.so.4.15 "$site/z3/lib/libz3.so"         # libtvm_compiler needs .so.4.15, z3.py .so
mkdir -p .tlsite
# ignored by git (never committed; it travels only by carry)
grep -qx '.tlsite/' .git/info/exclude 2>/dev/null || echo '.tlsite/' >> .git/info/exclude
tar -C "$site" -cf - . | xz -T0 -9 > .tlsite/tl.tar.xz
rm -rf "$wheels" "$site"
ls -la .tlsite/tl.tar.xz
