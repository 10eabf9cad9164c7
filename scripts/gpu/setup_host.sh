#!/usr/bin/env bash
# On the GPU host (repo root as cwd), after `source .stage/gpu/gpu_env.sh`:
#   bash scripts/gpu/setup_host.sh BUNDLE_DIR...      e.g. .stage/slim .stage/deps  (or .stage/ray)
# installs the carried wheels into /tmp/site and restores the saved kernel (JIT) cache when it was carried.
# Then run with:  export PYTHONPATH=$PWD:$PYTHONPATH
set -euo pipefail
bash .stage/gpu/gpu_install.sh "$@"
if [ -f .stage/jit/jit_cache_all.tgz ] && [ ! -d /tmp/jit/tvm-ffi ]; then
  bash .stage/gpu/gpu_jit_cache.sh restore .stage/jit/jit_cache_all.tgz >/dev/null && echo "JIT cache restored"
fi
python3 -c "import torch, transformers, hydra, omegaconf; print('torch', torch.__version__, 'transformers', transformers.__version__, 'hydra', hydra.__version__)"
