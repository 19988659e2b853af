#!/usr/bin/env bash
# record_shapes.sh OUT LANE... — on a GPU server with vLLM installed by ../shared/gpu's recipe
# (folders a, b, c, and vLLM's MoE kernels for a mixture-of-experts shape): start vLLM on the
# dummy model of each shape, keep its log up to its KV-cache statement, stop it. What
# `servescope capacity` is checked against for the architectures beyond dense Llama (MoE, MLA,
# sliding window). A LANE is `GPUS:START[;START…]`, a START `SHAPE[,FLAG…]` (flags joined by
# commas, e.g. `qwen1.5-moe-a2.7b,--enforce-eager`); lanes run at once, each on its own GPUs
# (CUDA_VISIBLE_DEVICES=GPUS, a port of its own), the starts of one lane one after the other.
# SHAPE is benchmarks/gpu/shapes/SHAPE.json, served with the tokenizer of .gpu/c/model (its
# vocab_size wins). Every start: --load-format dummy --max-model-len 8192
# --gpu-memory-utilization 0.85 unless its flags say otherwise, VLLM_LOGGING_LEVEL=DEBUG (vLLM's
# memory terms). Logs: OUT/vllm-SHAPE[-TAG].log; OUT/starts.txt: each start's seconds.
# A start is skipped when fewer than NEED (default 150) seconds remain before DEADLINE (default
# 550, from the script's start).
set -u
OUT=${1:?usage: record_shapes.sh OUT LANE...}; shift
HERE=$(cd "$(dirname "$0")" && pwd)
BASE=$(cd "${MODEL:-$PWD/.gpu/c/model}" && pwd)
DEADLINE=${DEADLINE:-550}; NEED=${NEED:-150}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH=${SITE:-/tmp/site}${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export VLLM_USE_FLASHINFER_SAMPLER=0 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 VLLM_LOGGING_LEVEL=DEBUG
nvidia-smi -q > "$OUT/nvidia-smi-q.txt" 2>&1

one() {  # GPUS PORT SHAPE [FLAGS...]
  local gpus=$1 port=$2 shape=$3; shift 3
  local tag; tag=$(printf '%s' "$*" | tr -c 'a-z0-9' '-' | sed 's/--*/-/g; s/^-//; s/-$//')
  local log=$OUT/vllm-$shape${tag:+-$tag}.log dir=/tmp/model-$shape-$port
  if [ $((DEADLINE - SECONDS)) -lt "$NEED" ]; then
    echo "$shape $*: skipped, $((DEADLINE - SECONDS)) s left" >> "$OUT/starts.txt"; return
  fi
  rm -rf "$dir"; cp -r "$BASE" "$dir"
  python3 - "$HERE/shapes/$shape.json" "$BASE/config.json" "$dir/config.json" <<'PY'
import json, sys
shape, base, out = sys.argv[1:]
c = json.load(open(shape)); c["vocab_size"] = json.load(open(base))["vocab_size"]
json.dump(c, open(out, "w"), indent=2)
PY
  local t0=$SECONDS
  set -m
  (cd /tmp && CUDA_VISIBLE_DEVICES=$gpus exec python3 -m vllm.entrypoints.openai.api_server \
     --model "$dir" --served-model-name "$shape" --load-format dummy --max-model-len 8192 \
     --gpu-memory-utilization 0.85 --host 127.0.0.1 --port "$port" "$@") > "$log" 2>&1 &
  local p=$!
  set +m
  for ((i = 0; i < DEADLINE - SECONDS; i++)); do
    grep -q "Application startup complete\|Maximum concurrency" "$log" && break
    kill -0 $p 2>/dev/null || break
    sleep 1
  done
  sleep 2
  echo "$shape $*: $((SECONDS - t0)) s to the KV statement (gpus $gpus)" >> "$OUT/starts.txt"
  kill -INT $p 2>/dev/null
  for ((i = 0; i < 20; i++)); do kill -0 $p 2>/dev/null || break; sleep 1; done
  kill -KILL -- -$p 2>/dev/null; wait $p 2>/dev/null
  for ((j = 0; j < 60; j++)); do
    local busy=0 g
    for g in ${gpus//,/ }; do
      [ "$(nvidia-smi -i "$g" --query-gpu=memory.used --format=csv,noheader,nounits)" -lt 2000 ] || busy=1
    done
    [ $busy = 0 ] && break; sleep 1
  done
}

lane() {  # GPUS:START;START...
  local gpus=${1%%:*} starts=${1#*:} port=$((8000 + ${1:0:1})) s
  IFS=';' read -ra list <<< "$starts"
  for s in "${list[@]}"; do
    IFS=',' read -ra words <<< "$s"
    one "$gpus" "$port" "${words[@]}"
  done
}

for l in "$@"; do lane "$l" & done
wait
cat "$OUT/starts.txt"
grep -h "Model loading took\|Available KV cache memory\|GPU KV cache size\|Maximum concurrency\|Error\|error" "$OUT"/vllm-*.log | cut -c1-300 | head -60
