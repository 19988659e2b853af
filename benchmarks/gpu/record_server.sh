#!/usr/bin/env bash
# record_server.sh OUT_TGZ — on a GPU server with vLLM installed by ../shared/gpu's recipe:
# two vLLM lifetimes in one appended log (prefix caching on, then off), each serving an operator's
# traffic without X-Request-Id (20 good completions and chats, 3 invalid requests refused with
# 400), NVML sampled every 0.5 s throughout. Packs the log, the NVML samples, the client's own
# count and `nvidia-smi -q` into OUT_TGZ: the recordings tests/fixtures/gpu/ holds.
set -u
OUT_TGZ=${1:?usage: record_server.sh OUT_TGZ}
HERE=$(cd "$(dirname "$0")" && pwd)
SERVE=${SERVE:-$PWD/.gpu/c/serve.sh}
W=$(mktemp -d /tmp/record.XXXX)
export VLLM_LOG=$W/vllm-h100.log PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
nvidia-smi -q > "$W/nvidia-smi-q.txt" 2>&1
python3 "$HERE/nvml_record.py" "$W/nvml-samples.jsonl" 0.5 & REC=$!
for flags in "--enable-prefix-caching" "--no-enable-prefix-caching"; do
  "$SERVE" start --enable-log-requests $flags || break
  python3 "$HERE/operator_traffic.py" http://127.0.0.1:8000 llama8b-dummy >> "$W/client.jsonl"
  "$SERVE" stop
done
kill $REC; wait $REC 2>/dev/null
tar -C "$W" -czf "$OUT_TGZ" .
ls -la "$W"; tail -3 "$W/client.jsonl"
