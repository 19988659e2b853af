#!/usr/bin/env bash
# record_kv_statements.sh OUT_TGZ SHAPE [U:L ...] — on a GPU server with vLLM installed by
# ../shared/gpu's recipe: for each --gpu-memory-utilization U and --max-model-len L, start vLLM
# on the dummy model of SHAPE (8b: the recipe's Llama-3-8B shape; 13b: a Llama-2-13B shape made
# here from it), keep its log up to its KV-cache statement, stop it. What `servescope capacity`
# is checked against (benchmarks/bench_capacity_gpu.py reads the logs). Packs the logs into OUT_TGZ.
set -u
OUT_TGZ=${1:?usage: record_kv_statements.sh OUT_TGZ SHAPE [U:L ...]}; SHAPE=${2:?shape}; shift 2
W=$(mktemp -d /tmp/kv.XXXX)
BASE=$(cd "${MODEL:-$PWD/.gpu/c/model}" && pwd)
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
export VLLM_USE_FLASHINFER_SAMPLER=0 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 PYTHONUNBUFFERED=1
MODEL_DIR=$BASE
if [ "$SHAPE" = 13b ]; then
  MODEL_DIR=/tmp/model-13b; rm -rf $MODEL_DIR; cp -r "$BASE" $MODEL_DIR
  python3 - $MODEL_DIR/config.json <<'PY'
import json, sys
p = sys.argv[1]; c = json.load(open(p))
c.update(hidden_size=5120, intermediate_size=13824, num_hidden_layers=40,
         num_attention_heads=40, num_key_value_heads=40, head_dim=128)
json.dump(c, open(p, "w"), indent=2)
PY
fi
cp $MODEL_DIR/config.json "$W/config-$SHAPE.json"
for ul in "$@"; do
  U=${ul%%:*}; L=${ul##*:}; LOG=$W/kv-$SHAPE-u$U-l$L.log
  t0=$(date +%s)
  (cd /tmp && exec setsid python3 -m vllm.entrypoints.openai.api_server --model $MODEL_DIR \
     --served-model-name dummy-$SHAPE --load-format dummy --max-model-len $L \
     --gpu-memory-utilization $U --host 127.0.0.1 --port 8000) > "$LOG" 2>&1 &
  P=$!
  for ((i = 0; i < 300; i++)); do
    grep -q "Maximum concurrency" "$LOG" && break
    kill -0 $P 2>/dev/null || break
    sleep 1
  done
  sleep 1
  kill -KILL -- -$P 2>/dev/null; wait $P 2>/dev/null
  for ((j = 0; j < 60; j++)); do
    u=$(nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits | head -1)
    [ "${u:-99999}" -lt 2000 ] && break; sleep 1
  done
  echo "$SHAPE U=$U L=$L: $(($(date +%s) - t0)) s; $(grep -ho 'Available KV cache memory: [0-9.]* GiB\|KV cache size: [0-9,]* tokens' "$LOG" | tr '\n' ' ')"
done
tar -C "$W" -czf "$OUT_TGZ" .
