#!/usr/bin/env bash
# Stage py-spy (a sampling profiler: Python and native frames of a running process, ~2.9 MiB) for the offline GPU
# host, on a machine WITH network (run from the repo root):
#   .stage/pyspy   py_spy-0.4.3 (manylinux wheel, one static binary)
# What it is for: telling where a host-bound engine loop spends its time (benchmarks/vllm_generation_gap.py --pyspy,
# through benchmarks/host_profile.py). On the host, in the call that profiles (it fits beside .stage/vllm3: 55 + 2.9
# MiB):
#   python3 -m pip install -q --no-index --no-deps --target /tmp/pyspy .stage/pyspy/*.whl
#   python3 benchmarks/vllm_generation_gap.py --model-dir /tmp/q05 --pyspy /tmp/pyspy/bin/py-spy \
#     --sequences repeated,trainer_first --batches 3 --out $OUT/gap.json
set -euo pipefail
rm -rf .stage/pyspy && mkdir -p .stage/pyspy
python3 -m pip download -q --no-deps --only-binary=:all: --platform manylinux_2_5_x86_64 -d .stage/pyspy py-spy==0.4.3
du -sh --apparent-size .stage/pyspy
