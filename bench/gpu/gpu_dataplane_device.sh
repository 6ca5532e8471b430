#!/usr/bin/env bash
# The device run of issue 9 part B on nvidia-h200-x2 (two H200, NVLink), results under $1 (default $OUT):
#  1. bench/gpu/gpu_dataplane_tp.py: verifier TP = 2 (torchrun, NCCL) vs TP = 1 -> gpu_tp.json;
#  2. bench/gpu/gpu_dataplane.py: per-step data-plane time NCCL / CUDA IPC / inline, drafter on cuda:1,
#     verifier rank 0 on cuda:0, and verify-step times of the random-weight targets
#     -> gpu_dataplane.{json,md}; it gets what is left of TOTAL_S (default 125) seconds.
# Each part has its own time limit, so one failing part still leaves the other's results.
set -u
out=${1:-$OUT}
total_s=${TOTAL_S:-125}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
nvidia-smi topo -m > "$out/topo.txt" 2>&1
tp=/tmp/minedraft_tp
mkdir -p $tp
{ timeout 30 python3 bench/gpu/gpu_dataplane_tp.py save $tp/model &&
  timeout 45 python3 bench/gpu/gpu_dataplane_tp.py run $tp/model $tp/tp1.json &&
  timeout 50 python3 -m torch.distributed.run --standalone --nproc-per-node 2 bench/gpu/gpu_dataplane_tp.py run $tp/model $tp/tp2.json &&
  python3 bench/gpu/gpu_dataplane_tp.py compare $tp/tp1.json $tp/tp2.json "$out/gpu_tp.json"; } > "$out/tp.log" 2>&1
echo "tp rc=$? after ${SECONDS}s"
timeout $((total_s - SECONDS)) python3 bench/gpu/gpu_dataplane.py --out "$out" --iters 15 --warmup 2 > "$out/dataplane.log" 2>&1
echo "dataplane rc=$? after ${SECONDS}s"
tail -n 3 "$out/tp.log" "$out/dataplane.log"
