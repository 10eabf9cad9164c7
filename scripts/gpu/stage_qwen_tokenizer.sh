#!/usr/bin/env bash
# Stage Qwen2.5's tokenizer for the offline GPU host, so the benchmarks run with its real vocabulary (--tokenizer,
# benchmarks/vocab.py). From the repo root, with the output of
#   python -m hybridrl.models.gguf_source --model qwen2.5-coder-0.5b-instruct --out /tmp/qwen25-coder-0.5b-instruct
# run
#   bash scripts/gpu/stage_qwen_tokenizer.sh [SOURCE_DIR]        # default /tmp/qwen25-coder-0.5b-instruct
# It fills .stage/qwen_tok with the tokenizer's files only (no weights) and a config.json of two entries: vocab_size,
# the real model's embedding count (151,936, which the benchmarks give their random models; the hub's Qwen2.5
# tokenizer holds 151,665 tokens, the GGUF's pads its table to 151,936), and model_type (without it transformers
# takes the directory for a Mistral one and warns). Carry .stage/qwen_tok (11 MiB) and pass --tokenizer .stage/qwen_tok.
set -euo pipefail
SOURCE=${1:-/tmp/qwen25-coder-0.5b-instruct}
STAGE=.stage/qwen_tok
[ -f "$SOURCE/tokenizer_config.json" ] && [ -f "$SOURCE/config.json" ] \
  || { echo "$SOURCE: no tokenizer_config.json and config.json (a gguf_source output directory?)" >&2; exit 1; }
rm -rf "$STAGE" && mkdir -p "$STAGE"
for name in tokenizer.json tokenizer_config.json chat_template.jinja special_tokens_map.json vocab.json merges.txt; do
  if [ -f "$SOURCE/$name" ]; then cp "$SOURCE/$name" "$STAGE/"; fi
done
python3 -c "import json, sys; config = json.load(open(sys.argv[1]))
json.dump({'model_type': config['model_type'], 'vocab_size': config['vocab_size']}, open(sys.argv[2], 'w'))" \
  "$SOURCE/config.json" "$STAGE/config.json"
python3 -c "from benchmarks.vocab import load_vocabulary; print('vocab:', load_vocabulary('$STAGE').describe())"
ls -l "$STAGE"
du -sh "$STAGE"
