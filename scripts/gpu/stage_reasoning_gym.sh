#!/usr/bin/env bash
# Stage reasoning-gym for the offline GPU host, on a machine WITH network (run from the repo root):
#   .stage/rg   reasoning-gym 0.1.25 and what it imports that the host lacks (wheels-reasoning-gym.txt; 28 MiB)
# The host has no reasoning_gym, so neither the embedded default task nor the gsm_symbolic recipes could be scored
# there (a 2026-11-28 GPU run failed on it after generation). One transfer while the host is held:
#   carry .stage/gpu .stage/rg      bash .stage/gpu/gpu_install.sh .stage/rg
# Checked 2026-11-28 on a clean CPython 3.12 holding only numpy, sympy, pyyaml, pillow and packaging (what torch,
# transformers and .stage/slim give the host): reasoning_gym imports, and decimal_chain_sum and gsm_symbolic score
# their own answers 1.0 and a wrong one 0.0.
# Needs CPython 3.12 (pyenv's) with pip to build the three sdists; .git/info/exclude must ignore /.stage/ and /.whl/.
set -euo pipefail
here=$(dirname "$0")
python312=${PYTHON312:-$(ls -d /root/.pyenv/versions/3.12.*/bin/python3.12 2>/dev/null | tail -1)}
[ -x "$python312" ] || { echo "stage_reasoning_gym.sh: no CPython 3.12 (set PYTHON312)" >&2; exit 2; }
[ -d .stage/gpu ] || { cp -r "${SHARED_GPU:-../shared/gpu}" .stage/gpu; chmod -R u+w .stage/gpu; }
rm -rf .whl/rg .stage/rg
mkdir -p .whl/rg/sdist .stage/rg
bash .stage/gpu/fetch_wheels.sh "$here/wheels-reasoning-gym.txt" .whl/rg >/dev/null
# sdists only on the index: pure Python but for pycosat (a C extension, built here for cp312)
python3 -m pip download -q --no-deps --no-binary=:all: -d .whl/rg/sdist cellpylib==2.4.0 pycosat==0.6.6 zss==1.2.0
"$python312" -m pip wheel -q --no-deps -w .whl/rg .whl/rg/sdist/*.tar.gz
cp .whl/rg/*.whl .stage/rg/
du -sh --apparent-size .stage/rg
