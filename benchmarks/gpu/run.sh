#!/usr/bin/env bash
# run.sh JOB OUT — one job of docs/gpu/ on a GPU server set up by ../shared/gpu's recipe (folders
# a, b, c and d installed into $SITE, servescope installed there too: its README, step 4). JOB:
#   prefix-caching  servescope experiment run prefix-caching-gpu --repeats 5 --requests 40
#                   (2 server starts, kept up asleep in turn: 5 repeats a side in ~6 minutes)
#   max-num-seqs    servescope experiment run max-num-seqs-gpu --repeats 5 --requests 40
#   routing         servescope experiment run routing-gpu --repeats 2 (2 replicas on one GPU)
#   overhead        benchmarks/bench_sidecar_overhead.py           (1 traced start + 1 untraced)
#   capacity        benchmarks/bench_capacity_gpu.py               (two shapes × two settings)
#   spec-real       servescope experiment run speculative-decoding-real (experiments.yaml here):
#                   n-gram speculation off → on, a real model (MODEL: SmolLM2, make-smollm2)
#   routing-2gpu    servescope experiment run routing-two-gpus (experiments.yaml here): one
#                   replica a GPU on a server of two GPUs, 3 repeats (REQUESTS: per tenant)
# Everything the job made — vLLM's logs, the store, the reports, the NVML samples of the whole
# job (1 s), nvidia-smi -q, the job's JSON and console — goes into ONE tarball OUT/gpu-JOB.tar.gz
# (what a GPU server command brings back: 16 MiB at most; the script says if it is larger).
# Each job ends within ~9 minutes on an H100 (vLLM starts in ~150 s cold, ~92 s warm).
# Env: SITE=/tmp/site MODEL=<repo>/.gpu/c/model SERVESCOPE=$SITE/bin/servescope
set -u
usage="usage: run.sh {prefix-caching|max-num-seqs|routing|spec-real|routing-2gpu|overhead|capacity} OUT"
JOB=${1:?$usage}
OUT=${2:?$usage}
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
SITE=${SITE:-/tmp/site}
MODEL=$(cd "${MODEL:-$ROOT/.gpu/c/model}" && pwd) || { echo "run.sh: no model folder"; exit 2; }
SERVESCOPE=${SERVESCOPE:-$SITE/bin/servescope}
export PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH} PATH=$SITE/bin:$PATH
export VLLM_USE_FLASHINFER_SAMPLER=0 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 PYTHONUNBUFFERED=1
# NVLink multicast stays off on a shared host of several GPUs (a program that uses it can take
# the host's GPUs down); harmless on one GPU
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=$(mkdir -p "$OUT" && cd "$OUT" && pwd)
W=$(mktemp -d "/tmp/gpu-$JOB.XXXX")
cd "$W" || exit 2  # servescope-data/ (the servers' logs, the bench events) lands here
nvidia-smi -q > nvidia-smi-q.txt 2>&1
python3 -m pip list > pip-list.txt 2>&1
python3 "$ROOT/benchmarks/gpu/nvml_record.py" nvml-samples.jsonl 1 > nvml.err 2>&1 &
REC=$!
t0=$SECONDS
case "$JOB" in
  prefix-caching | max-num-seqs)
    # the arms' servers start once and sleep in turn (sleep 0.3 s, wake 0.5 s on an H100), so
    # five repeats a side of 40 requests a level fit the ~9 minutes a job has (docs/gpu)
    "$SERVESCOPE" experiment run "$JOB-gpu" --repeats 5 --requests 40 --model "$MODEL" \
      --store store.duckdb --out reports --json > result.json 2> console.txt
    ;;
  routing)
    "$SERVESCOPE" experiment run routing-gpu --repeats 2 --model "$MODEL" --store store.duckdb \
      --out reports --json > result.json 2> console.txt
    ;;
  spec-real | routing-2gpu)
    name=speculative-decoding-real; [ "$JOB" = routing-2gpu ] && name=routing-two-gpus
    "$SERVESCOPE" experiment run $name --file "$ROOT/benchmarks/gpu/experiments.yaml" \
      --profiles "$ROOT/benchmarks/gpu/profiles.yaml" --model "$MODEL" ${REQUESTS:+--requests $REQUESTS} \
      --store store.duckdb --out reports --json > result.json 2> console.txt
    ;;
  overhead)
    python3 "$ROOT/benchmarks/bench_sidecar_overhead.py" --model "$MODEL" --profile gpu-bench \
      --config gpu-saturate --pairs 3 --work overhead > result.json 2> console.txt
    ;;
  capacity)
    python3 "$ROOT/benchmarks/bench_capacity_gpu.py" --model "$MODEL" --keep-logs logs \
      > result.json 2> console.txt
    ;;
  *)
    echo "$usage"; kill $REC; exit 2
    ;;
esac
rc=$?
kill $REC 2>/dev/null; wait $REC 2>/dev/null
echo "{\"job\": \"$JOB\", \"rc\": $rc, \"seconds\": $((SECONDS - t0)), \"model\": \"$MODEL\"}" > job.json
tar -czf "$OUT/gpu-$JOB.tar.gz" -C "$W" .
size=$(stat -c %s "$OUT/gpu-$JOB.tar.gz")
echo "run.sh: $JOB rc=$rc in $((SECONDS - t0)) s; $OUT/gpu-$JOB.tar.gz $size bytes"
[ "$size" -le $((16 * 1024 * 1024)) ] || echo "run.sh: WARNING: over 16 MiB, it will not come back"
tail -5 console.txt
exit $rc
