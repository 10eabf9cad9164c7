#!/usr/bin/env bash
# Stage everything the offline GPU host needs, on a machine WITH network (run from the repo root).
# Copies ../shared/gpu (the SGLang recipe) to .stage/gpu, downloads the wheels and builds:
#   .stage/slim  SGLang 0.5.16 without xgrammar (48.3 MiB)      .stage/ray   Ray 2.60.0 (43.0 MiB)
#   .stage/deps  hybridrl's own deps the host lacks (hydra-core, omegaconf, antlr4 runtime, aiohttp, liger-kernel; 4.3 MiB)
#                (msgspec, which the engine servers need, comes with .stage/slim: sglang needs it too)
# reasoning-gym (the default task's verifier) is staged apart: scripts/gpu/stage_reasoning_gym.sh (.stage/rg).
# One transfer to the host holds 64 MiB in all: slim + deps + the JIT cache + the repo fit together; Ray
# travels in a separate call while the host is still held (see ../shared/gpu/README.md).
# Needs .git/info/exclude to ignore /.stage/ and /.whl/.
set -euo pipefail
shared=${SHARED_GPU:-../shared/gpu}
mkdir -p .stage
[ -d .stage/gpu ] || { cp -r "$shared" .stage/gpu; chmod -R u+w .stage/gpu; }
bash .stage/gpu/fetch_wheels.sh .stage/gpu/wheels-sglang.txt .whl/dl >/dev/null
bash .stage/gpu/fetch_wheels.sh .stage/gpu/wheels-ray.txt .whl/ray >/dev/null
NO_XGRAMMAR=1 bash .stage/gpu/make_bundle.sh .whl/dl .stage/slim | tail -2
bash .stage/gpu/make_bundle_ray.sh .whl/ray .stage/ray | tail -1
# hybridrl's own dependencies that the host image does not have (pure Python; antlr4 4.9.3 is an sdist: build it)
mkdir -p .whl/deps .stage/deps
python3 -m pip download -q --no-deps -d .whl/deps hydra-core==1.3.8 omegaconf==2.3.1 antlr4-python3-runtime==4.9.3
python3 -m pip wheel -q --no-deps -w .whl/deps .whl/deps/antlr4-python3-runtime-4.9.3.tar.gz
# the engine server of rollout.mode=async (aiohttp and its closure) and model.use_liger, both absent on the host
for p in aiohttp yarl multidict frozenlist aiosignal propcache attrs aiohappyeyeballs liger-kernel; do
  python3 -m pip download -q --no-deps --python-version 3.12 --only-binary=:all: --platform manylinux2014_x86_64 \
    --platform manylinux_2_17_x86_64 --platform any -d .whl/deps "$p"
done
cp .whl/deps/*.whl .stage/deps/
du -sh .stage/slim .stage/ray .stage/deps
