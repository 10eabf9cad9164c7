#!/usr/bin/env bash
# On the GPU host (repo root as cwd): install the verl bundle into /tmp/verl-site, a folder used ONLY by the verl
# run (benchmarks/vs_verl.py puts it first on PYTHONPATH for verl's subprocess; hybridrl's run never sees it).
#   bash scripts/gpu/install_verl.sh .stage/verl
#   TARGET=/tmp/verl-tf-site bash scripts/gpu/install_verl.sh .stage/verl-tf   (verl's pinned transformers 5.9.0: vs_verl.py's default)
# The shared bundles (.stage/slim, .stage/ray, .stage/deps) go to /tmp/site as usual (scripts/gpu/setup_host.sh).
# Then `python3 benchmarks/vs_verl.py --check-imports` lists what verl's run imports and from where.
set -euo pipefail
target=${TARGET:-/tmp/verl-site}
whls=()
for d in "$@"; do whls+=("$d"/*.whl); done
t0=$(date +%s)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$target" "${whls[@]}"
echo "installed ${#whls[@]} wheels into $target in $(( $(date +%s) - t0 )) s; $(du -sh "$target" | cut -f1)"
