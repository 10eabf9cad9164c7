#!/usr/bin/env bash
# On the offline GPU host: gather the vLLM wheel's parts (one per transfer), and once all are there, reassemble,
# check and install vLLM with its carried dependencies into /tmp/site-vllm.
#   usage: bash scripts/gpu/install_vllm.sh .stage/vllmK|.stage/vllm-deps [...]   (once per transfer, any order)
# Each call copies the parts and wheels it was given into /tmp/vllm-stage (kept while the host is held); the call
# that completes the set joins them (cat), checks the sha256 from MANIFEST, and installs. Then use
#   export PYTHONPATH=$PWD:/tmp/site-vllm:/tmp/site
# (/tmp/site-vllm first: its fastapi/starlette are the versions vLLM needs; /tmp/site, from the SGLang slim bundle
# (gpu_install.sh .stage/slim), gives the shared dependencies: pydantic, msgspec, pyzmq, openai, pybase64, ...).
#
# The whole sequence, one `run` call per line while the host stays held (each transfer <= 64 MiB with the repo):
#   1 carry .stage/gpu .stage/slim .stage/deps   source .stage/gpu/gpu_env.sh && bash scripts/gpu/setup_host.sh .stage/slim .stage/deps
#   2 carry .stage/vllm1                         bash scripts/gpu/install_vllm.sh .stage/vllm1
#   3 carry .stage/vllm2                         bash scripts/gpu/install_vllm.sh .stage/vllm2
#   4 carry .stage/vllm-deps                     bash scripts/gpu/install_vllm.sh .stage/vllm-deps
#   5 carry .stage/gpu .stage/vllm3              source .stage/gpu/gpu_env.sh && bash scripts/gpu/install_vllm.sh .stage/vllm3 \
#       && export PYTHONPATH=$PWD:/tmp/site-vllm:$PYTHONPATH VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_NO_USAGE_STATS=1 \
#       && python3 -m pytest -o addopts=-ra -p no:xdist -q -s tests/gpu/test_engine_hybrid.py -k vllm > $OUT/vllm.txt 2>&1
#   6 carry .stage/gpu .stage/ray   bash .stage/gpu/gpu_install.sh .stage/ray, then (same env, same pytest flags, each
#       its own process) tests/gpu/test_engine_worker.py -k vllm and tests/gpu/test_engine_async_server.py -k vllm
#   7 (same env)  python3 benchmarks/hybrid_engine.py --engine vllm --model-dir /tmp/q05 --make-model --override \
#                   +actor_rollout_ref.rollout.engine_kwargs.vllm.kv_cache_memory_bytes=8589934592 \
#                   --out $OUT/bench_vllm.json > $OUT/bench_vllm.txt 2>&1   (the standalone engine runs beside the
#                   hybrid one, so the KV cache is sized; about 5 minutes with --gen-repeats 6)
#   (2026-12-02: step 6 as one command, the own_process hook giving each vLLM param its own process: 127 s)
# (2026-12-01 on an H200: steps 1-5 took about 2 minutes of device time with the start, step 5's tests 185 s.)
# (VLLM_USE_FLASHINFER_SAMPLER=0: the slim bundle's flashinfer is 0.6.14, vLLM 0.24 was built against 0.6.12;
# the PyTorch sampler needs no JIT build.)
set -euo pipefail
stage=/tmp/vllm-stage
mkdir -p "$stage"
for dir in "$@"; do
  [ -f "$dir/MANIFEST" ] || { echo "install_vllm.sh: $dir has no MANIFEST (expected .stage/vllmK or .stage/vllm-deps)" >&2
                              exit 2; }
  cp "$dir"/MANIFEST "$stage/"
  if [ "$(basename "$dir")" = vllm-deps ]; then cp "$dir"/*.whl "$stage/" && touch "$stage/DEPS"
  else cp "$dir"/*.part* "$stage/"; fi
done
wheel=$(awk '$1 == "wheel" {print $2}' "$stage/MANIFEST")
parts=$(awk '$1 == "parts" {print $2}' "$stage/MANIFEST")
sha=$(awk '$1 == "sha256" {print $2}' "$stage/MANIFEST")
have=$(ls "$stage/$wheel".part* 2>/dev/null | wc -l)
if [ "$have" -lt "$parts" ] || [ ! -f "$stage/DEPS" ]; then
  echo "install_vllm.sh: have $have of $parts parts of $wheel and $([ -f "$stage/DEPS" ] || echo "not ")the dependencies" \
       "in $stage; bring the others (.stage/vllm1..vllm$parts, .stage/vllm-deps)"
  exit 0
fi
mkdir -p "$stage/whl"
cat $(ls "$stage/$wheel".part* | sort) > "$stage/whl/$wheel"
echo "$sha  $stage/whl/$wheel" | sha256sum -c --quiet - || { echo "install_vllm.sh: sha256 mismatch for $wheel" >&2; exit 3; }
t0=$(date +%s)
deps=()
for w in "$stage"/*.whl; do deps+=("$w"); done
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site-vllm \
  "$stage/whl/$wheel" "${deps[@]}"
echo "installed $wheel and ${#deps[@]} dependencies into /tmp/site-vllm in $(( $(date +%s) - t0 )) s; $(du -sh /tmp/site-vllm | cut -f1)"
PYTHONPATH=/tmp/site-vllm:/tmp/site${PYTHONPATH:+:$PYTHONPATH} python3 -c \
  "import vllm, vllm.entrypoints.llm, vllm.v1.engine.llm_engine; print('import vllm', vllm.__version__, 'ok')"
