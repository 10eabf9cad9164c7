#!/usr/bin/env bash
# Stage vLLM for the offline GPU host, on a machine WITH network (run from the repo root).
# The vllm 0.24.0 wheel is 266 MiB and one member (_C_stable_libtorch.abi3.so, 82.7 MiB packed) is larger than a
# 64 MiB transfer, so no repacking into several wheels can fit: the trimmed wheel is cut into byte parts
# (split -b), one part per folder, and scripts/gpu/install_vllm.sh reassembles and checks it on the host.
#   .stage/vllm1 .. .stage/vllmN   one part each (<= PART_MIB) + MANIFEST (wheel name, part count, sha256).
#                                  With the default 58 MiB: 3 folders of <= 58.5 MiB.
#   .stage/vllm-deps               the dependencies neither the host nor .stage/slim has (wheels-vllm.txt, 53 MiB,
#                                  xgrammar 43 of it) + MANIFEST: one more transfer.
# Trimmed from the wheel (repack_wheel.py, RECORD rewritten):
#   vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so  FlashAttention 2 (Ampere); on Hopper vLLM uses FA3, and
#                                             flash_attn_interface.py imports _vllm_fa2_C inside try/except
#   vllm/third_party/fmha_sm100/*             Blackwell attention kernels and their CUTLASS headers
#   vllm/third_party/deep_gemm/_C.cpython-3{10,11,13,14}*  DeepGEMM builds for other Pythons (cp312 kept)
#   vllm/vllm-rs                              the optional Rust frontend binary (VLLM_RUST_FRONTEND_PATH only)
#   vllm/entrypoints/serve/instrumentator/static/*  the HTTP server's swagger UI
# Needs .git/info/exclude to ignore /.stage/ and /.whl/.
set -euo pipefail
version=0.24.0
part_mib=${PART_MIB:-58}           # leaves ~5.5 MiB of each transfer for the repository itself
shared=${SHARED_GPU:-../shared/gpu}
here=$(dirname "$0")
mkdir -p .stage .whl/vllm .whl/vllm-trim
[ -d .stage/gpu ] || { cp -r "$shared" .stage/gpu; chmod -R u+w .stage/gpu; }
bash .stage/gpu/fetch_wheels.sh "$here/wheels-vllm.txt" .whl/vllm >/dev/null
whl=$(ls .whl/vllm/vllm-$version-*.whl)
rm -f .whl/vllm-trim/*.whl
python3 .stage/gpu/repack_wheel.py "$whl" .whl/vllm-trim \
  'vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so' 'vllm/third_party/fmha_sm100/*' \
  'vllm/third_party/deep_gemm/_C.cpython-310-*' 'vllm/third_party/deep_gemm/_C.cpython-311-*' \
  'vllm/third_party/deep_gemm/_C.cpython-313-*' 'vllm/third_party/deep_gemm/_C.cpython-314-*' \
  'vllm/vllm-rs' 'vllm/entrypoints/serve/instrumentator/static/*' >/dev/null
trimmed=$(ls .whl/vllm-trim/vllm-$version-*.whl)
name=$(basename "$trimmed")
rm -rf .stage/vllm[0-9]* .stage/vllm-deps .whl/vllm-parts
mkdir -p .whl/vllm-parts
split -b "${part_mib}m" -d -a 1 "$trimmed" ".whl/vllm-parts/$name.part"
parts=(.whl/vllm-parts/*.part*)
sha=$(sha256sum "$trimmed" | cut -d' ' -f1)
for i in "${!parts[@]}"; do
  d=.stage/vllm$((i + 1)); mkdir -p "$d"
  mv "${parts[$i]}" "$d/"
  printf 'wheel %s\nparts %d\nsha256 %s\n' "$name" "${#parts[@]}" "$sha" > "$d/MANIFEST"
done
mkdir -p .stage/vllm-deps
cp .stage/vllm1/MANIFEST .stage/vllm-deps/
for w in .whl/vllm/*.whl; do [ "$w" = "$whl" ] || cp "$w" .stage/vllm-deps/; done
printf '%s\n' "wheel $(du -m "$whl" | cut -f1) MiB -> trimmed $(du -m "$trimmed" | cut -f1) MiB in ${#parts[@]} parts"
du -sh --apparent-size .stage/vllm[0-9]* .stage/vllm-deps
