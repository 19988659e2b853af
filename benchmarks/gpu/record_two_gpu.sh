#!/usr/bin/env bash
# record_two_gpu.sh OUT_TGZ JOB... — on a GPU server with two GPUs and vLLM installed by
# ../shared/gpu's recipe (folders a, b, c): one vLLM lifetime per JOB, each serving the traffic of
# two_gpu_traffic.py (20 good requests, 4 refused with 400, one of them a prompt longer than the
# context), NVML read every 0.5 s throughout with each GPU's compute processes. JOB:
#   tp2    the 8B Llama shape, --tensor-parallel-size 2
#   dp2    the 8B Llama shape, --data-parallel-size 2 --enforce-eager, plus 64 streams with /metrics snapshots
#   fp8    the 8B Llama shape, --tensor-parallel-size 2 --kv-cache-dtype fp8 --enforce-eager
#   qwen3  a Qwen3-8B shape (shapes/qwen3-8b.json), --tensor-parallel-size 2 --enforce-eager
#   pair   two one-GPU servers of the 8B shape at once, CUDA_VISIBLE_DEVICES=0 and 1, ports 8000
#          and 8001, --enforce-eager, 32 streams each with /metrics snapshots
# Every lifetime: --enable-log-requests, --max-model-len 8192, --gpu-memory-utilization 0.85
# (serve.sh's defaults), dummy weights. Packs vLLM's logs, the client's counts, `nvidia-smi -q`,
# NVML's memory statement of both cards (nvml-memory.json), the NVML samples, `ps` and
# `nvidia-smi --query-compute-apps` while each lifetime served, into OUT_TGZ.
# A job is skipped (and said so) when fewer seconds remain before DEADLINE (default 540, counted
# from the script's start) than it needs, so the tarball is always written within a command.
set -u
OUT_TGZ=${1:?usage: record_two_gpu.sh OUT_TGZ JOB...}; shift
HERE=$(cd "$(dirname "$0")" && pwd)
SERVE=${SERVE:-$PWD/.gpu/c/serve.sh}
serve() { bash "$SERVE" "$@"; }
BASE_MODEL=$(cd "${MODEL:-$(dirname "$SERVE")/model}" && pwd)
DEADLINE=${DEADLINE:-540}
W=$(mktemp -d /tmp/record2.XXXX)
# NVLink multicast stays off on a shared host (a program that uses it can take its GPUs down)
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH=${SITE:-/tmp/site}${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
nvidia-smi -q > "$W/nvidia-smi-q.txt" 2>&1
python3 "$HERE/nvml_gpus.py" memory "$W/nvml-memory.json" 2> "$W/nvml-memory.err"
python3 "$HERE/nvml_gpus.py" record "$W/nvml-samples.jsonl" 0.5 2> "$W/nvml.err" & REC=$!

seen() {  # the processes and GPU memory while JOB's servers run
  ps -eo pid,ppid,pgid,etimes,args > "$W/ps-$1.txt"
  nvidia-smi --query-compute-apps=pid,gpu_uuid,used_memory --format=csv > "$W/compute-apps-$1.csv" 2>&1
}
lifetime() {  # JOB NEED_S MODEL_DIR NAME [serve flags...]: one server on both GPUs, its traffic, its stop
  local job=$1 need=$2 dir=$3 name=$4; shift 4
  if [ $((DEADLINE - SECONDS)) -lt "$need" ]; then echo "record_two_gpu: $job skipped, $((DEADLINE - SECONDS)) s left"; return; fi
  local streams=0; [ "$job" = dp2 ] && streams=64
  echo "== $job ($(date -Is)): $*"
  if MODEL=$dir VLLM_LOG=$W/vllm-$job.log SERVED_NAME=$name serve start --enable-log-requests "$@"; then
    seen "$job"
    python3 "$HERE/two_gpu_traffic.py" http://127.0.0.1:8000 "$name" "$W" "$job" $streams | tee -a "$W/client.jsonl"
    seen "$job-after"
  fi
  serve stop
}

for job in "$@"; do
  case "$job" in
    tp2) lifetime tp2 250 "$BASE_MODEL" llama8b-dummy --tensor-parallel-size 2 ;;
    dp2) lifetime dp2 140 "$BASE_MODEL" llama8b-dummy --data-parallel-size 2 --enforce-eager ;;
    fp8) lifetime fp8 140 "$BASE_MODEL" llama8b-dummy --tensor-parallel-size 2 --kv-cache-dtype fp8 --enforce-eager ;;
    qwen3)
      Q=/tmp/model-qwen3; rm -rf $Q; cp -r "$BASE_MODEL" $Q; cp "$HERE/shapes/qwen3-8b.json" $Q/config.json
      lifetime qwen3 140 $Q qwen3-8b-dummy --tensor-parallel-size 2 --enforce-eager ;;
    pair)
      if [ $((DEADLINE - SECONDS)) -lt 140 ]; then echo "record_two_gpu: pair skipped"; continue; fi
      echo "== pair ($(date -Is))"
      P=()
      for g in 0 1; do
        CUDA_VISIBLE_DEVICES=$g PORT=800$g MODEL=$BASE_MODEL VLLM_LOG=$W/vllm-pair-gpu$g.log \
          serve start --enable-log-requests --enforce-eager > "$W/serve-pair-gpu$g.txt" 2>&1 & P+=($!)
      done
      wait "${P[@]}"; cat "$W"/serve-pair-gpu*.txt
      seen pair
      for g in 0 1; do
        python3 "$HERE/two_gpu_traffic.py" http://127.0.0.1:800$g llama8b-dummy "$W" "pair-gpu$g" 32 >> "$W/client-pair-gpu$g.jsonl" & P+=($!)
      done
      sleep 12; seen pair-load; wait "${P[@]}"
      cat "$W"/client-pair-gpu*.jsonl
      for g in 0 1; do PORT=800$g serve stop; done ;;
    *) echo "record_two_gpu: unknown job $job" ;;
  esac
done
kill $REC; wait $REC 2>/dev/null
grep -ho 'Available KV cache memory: [0-9.]* GiB\|KV cache size: [0-9,]* tokens\|Model loading took [0-9.]* GiB' "$W"/vllm-*.log | sort | uniq -c
tar -C "$W" -czf "$OUT_TGZ" .
ls -la "$W"; echo "record_two_gpu: $(stat -c %s "$OUT_TGZ") bytes in $OUT_TGZ after $SECONDS s"
