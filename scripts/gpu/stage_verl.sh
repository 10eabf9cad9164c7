#!/usr/bin/env bash
# Stage verl 0.9.1 for the offline GPU host (issue 18), on a machine WITH network; run from the repo root.
# Builds, beside the bundles of stage_bundles.sh (which must already exist: verl's run also uses slim, ray, deps):
#   .stage/verl     verl 0.9.1 + the pure-Python/small native deps the host lacks (scripts/gpu/wheels-verl.txt)
#   .stage/verl-tf  transformers 5.9.0 + tokenizers 0.22.2: verl's own pin for its SGLang install (verl 0.9.1's extra
#                   "sglang" requires transformers==5.9.0; its core requirement is <5.11). benchmarks/vs_verl.py puts it
#                   first on verl's PYTHONPATH only (--verl-transformers pinned, the default); hybridrl keeps the image's.
# Each folder is one transfer (< 64 MiB). Idempotent: downloads are cached in .whl/verl, folders are rebuilt from them.
# On the host: bash scripts/gpu/install_verl.sh (installs into /tmp/verl-site, used by the verl run only).
set -euo pipefail
list=scripts/gpu/wheels-verl.txt
dl=.whl/verl
py312=${PY312:-python3.12}   # a CPython 3.12 to build the one sdist (pylatexenc) into a wheel
mkdir -p "$dl" .stage/verl .stage/verl-tf
fetch() {  # fetch SPEC...: binary wheels for CPython 3.12 on manylinux x86-64, no dependency resolution
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 --abi abi3 --abi none \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_24_x86_64 \
    --platform manylinux_2_28_x86_64 --platform any -d "$dl" "$@"
}
specs=$(sed -e 's/#.*//' -e 's/[[:space:]]//g' "$list" | grep -v '^$' | grep -v '^pylatexenc==')
# shellcheck disable=SC2086
fetch $specs
# pylatexenc ships only an sdist: build it with CPython 3.12 (pure Python, so the wheel is py3-none-any)
if ! ls "$dl"/pylatexenc-*.whl >/dev/null 2>&1; then
  python3 -m pip download -q --no-deps --no-binary=:all: -d "$dl/sdist" "$(grep -o '^pylatexenc==[^ #]*' "$list")"
  $py312 -m pip wheel -q --no-deps --no-build-isolation -w "$dl" "$dl"/sdist/pylatexenc-*.tar.gz 2>/dev/null \
    || $py312 -m pip wheel -q --no-deps -w "$dl" "$dl"/sdist/pylatexenc-*.tar.gz
fi
# the verl bundle: exactly the listed wheels (a stale wheel of another version in .whl/verl is not copied)
rm -f .stage/verl/*.whl
for spec in $(sed -e 's/#.*//' -e 's/[[:space:]]//g' "$list" | grep -v '^$'); do
  name=${spec%%==*}; version=${spec#*==}
  pattern=$(echo "$name" | tr '[:upper:]-' '[:lower:]_')
  whl=$(ls "$dl" | grep -i "^${pattern}-${version}-" | head -1)
  [ -n "$whl" ] || { echo "no wheel for $spec in $dl" >&2; exit 1; }
  cp "$dl/$whl" .stage/verl/
done
# verl's pinned transformers: 5.9.0 requires tokenizers>=0.22.0,<=0.23.0 (0.23.0 was never released: 0.22.2); the
# image has 0.23.2, and transformers checks it at import (dependency_versions_check.py)
rm -f .stage/verl-tf/*.whl
fetch transformers==5.9.0 tokenizers==0.22.2
cp "$dl"/transformers-5.9.0-*.whl "$dl"/tokenizers-0.22.2-*.whl .stage/verl-tf/
cp scripts/gpu/install_verl.sh .stage/verl/ 2>/dev/null || true
for d in .stage/verl .stage/verl-tf; do
  printf '%s: %s wheels, %s MiB\n' "$d" "$(ls "$d"/*.whl | wc -l)" \
    "$(du -cb "$d"/*.whl | tail -1 | awk '{printf "%.1f", $1 / 1048576}')"
done
