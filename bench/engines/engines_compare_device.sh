#!/usr/bin/env bash
# issue 24 on the lent H200: our stack on --engine vllm (and native) against vLLM itself,
# `bench.engines.engines_compare`, after `bash bench/engines/stage_device.sh` parts reached /root/stage.
#
#   bash bench/engines/engines_compare_device.sh TABLE [TOTAL_S]     (results under $OUT/TABLE)
#
# TABLE: paper  - Llama-3-8B-shape target, Qwen3-0.6B-shape draft, random weights, acceptance
#                 fixed at 0.7 on both sides (ours --bench-fixed-acceptance, vLLM synthetic);
#        smollm2 - the real SmolLM2-135M-Instruct target with our distilled draft, greedy.
# Drafter and verifier share GPU 0 under CUDA MPS (MPS=0: no MPS). Env: SYSTEMS, CONCURRENCIES, EXTRA, DATA (the prompts),
# MAX_MODEL_LEN (2048: each of the 128 Spec-Bench prompts used fits beside 256 output tokens; 1024 refused 21) override;
# system names as in bench.engines.compare_systems (e.g. psd-vllm-adaptive: adaptive k; -vsm70: the verifier on 70% of the SMs);
# ours sd / psd / auto with the same engine flags (e.g. psd-vllm-ses,sd-vllm-ses,auto-vllm-ses) run on one start of their
# engines, each behind its own coordinator and gateway (bench.engines.shared_engines; EXTRA=--no-share-engines: a start each);
# SMOKE=1 first runs bench.engines.vllm_backend_smoke (the backend's workers in-process, greedy sd = ar;
# SMOKE_ARGS its flags, SMOKE_ONLY=1 stops after it); PROFILE=1 first runs bench.engines.ar_step_profile (PROFILE_ARGS);
# DRAFT_CALLS=1 first runs bench.engines.draft_calls (DRAFT_CALLS_ARGS: one vLLM draft call per engine set-up);
# PARALLEL_DRAFTERS=1 then bench.engines.parallel_drafters (PARALLEL_DRAFTERS_ARGS: R rows in 1 process vs R / P in P);
# RPC_FLOOR=0 skips bench.engines.rpc_floor (the floor of one Verify RPC on the host, run first by default).
set -u
TABLE=${1:?TABLE: paper or smollm2}
TOTAL_S=${2:-560}
START=$(date +%s)
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export TQDM_DISABLE=1 MINEDRAFT_CACHE=/root/cache VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_ATTENTION_BACKEND=FLASH_ATTN
export VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 HF_HUB_OFFLINE=1
OUT=${OUT:-/tmp/out}
SITE=/root/site
if [ ! -f $SITE/.installed ]; then
  mkdir -p /root/stage/x && cat /root/stage/part.* | tar x -C /root/stage/x || exit 1
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target $SITE /root/stage/x/whl/*.whl || exit 1
  touch $SITE/.installed
fi
# staged: too big to travel with the tree (a checkout sent without it can leave an empty dir behind)
[ -f drafts/smollm2-135m-instruct/config.json ] || [ ! -d /root/stage/x/drafts ] || { mkdir -p drafts && cp -r /root/stage/x/drafts/. ./drafts/; }
# SmolLM2's tokenizer for the random presets (staged; needed where the SmolLM2 GGUF wheel was left out: PAPER_ONLY=1)
[ ! -f /root/stage/x/tokenizer/tokenizer.json ] || export MINEDRAFT_RANDOM_TOKENIZER=/root/stage/x/tokenizer
export PYTHONPATH=$SITE:$PWD
python3 -c 'import torch, vllm, transformers, grpc; print("torch", torch.__version__, "vllm", vllm.__version__, "transformers", transformers.__version__, "grpc", grpc.__version__, "gpus", torch.cuda.device_count())' || exit 1
nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv,noheader
mkdir -p "$OUT/$TABLE"
# host memory and GPU memory every 30 s to watch.log; our processes killed before the host runs out (WATCH_MIN_MIB)
bash bench/engines/device_watchdog.sh "$OUT/$TABLE/watch.log" "${WATCH_MIN_MIB:-8192}" 5 & WATCHDOG=$!
trap 'kill $WATCHDOG 2>/dev/null' EXIT
rm -rf /root/cache/models/random-*   # written by an older checkout (before `architectures` was set)
if [ "${RPC_FLOOR:-1}" = 1 ]; then   # this host's floor of one Verify RPC (a few s), beside the transport the step logs report
  timeout 90 python3 -m bench.engines.rpc_floor --num-calls 1000 --server-imports torch,vllm \
      --out "$OUT/$TABLE/rpc_floor.json" 2>&1 | tail -1
fi
if [ -n "${SMOKE:-}" ]; then   # SMOKE_ARGS: bench.engines.vllm_backend_smoke's flags; its profile comes back as one tar
  timeout "${SMOKE_TIMEOUT:-240}" python3 -m bench.engines.vllm_backend_smoke --device cuda --profile-out /tmp/prof \
      ${SMOKE_ARGS:---target random:smollm2-135m --draft random:smollm2-135m --enforce-eager} 2>&1 \
      | tee "$OUT/$TABLE/smoke.log" | grep -E "SMOKE|Error|error" | tail -20
  tar czf "$OUT/$TABLE/profile.tgz" -C /tmp prof 2>/dev/null
fi
if [ -n "${PROFILE:-}" ]; then   # where ours `ar` step goes against vLLM's own loop on one engine (PROFILE_ARGS: its flags)
  timeout "${PROFILE_TIMEOUT:-300}" python3 -m bench.engines.ar_step_profile --device cuda --out "$OUT/$TABLE/ar_profile/ar_profile.json" \
      ${PROFILE_ARGS:---target random:llama-8b --batch-sizes 1,16,64} 2>&1 | tee "$OUT/$TABLE/ar_profile.log" | grep -E "AR_PROFILE|Error" | tail -20
fi
if [ -n "${DRAFT_CALLS:-}" ]; then   # what one vLLM draft call costs: engine steps, add_request, step ms
  timeout "${DRAFT_CALLS_TIMEOUT:-300}" python3 -m bench.engines.draft_calls --device cuda --out-dir "$OUT/$TABLE/draft_calls" \
      ${DRAFT_CALLS_ARGS:---draft random:qwen3-0.6b --rows 1,8,16,32 --max-model-len 1024 --setups drafting,drafting-piecewise,vllm-default} 2>&1 \
      | tee "$OUT/$TABLE/draft_calls.log" | grep -E "DRAFT_CALLS|Error" | tail -20
fi
if [ -n "${PARALLEL_DRAFTERS:-}" ]; then   # one draft call of R rows in one process against R / P rows in each of P
  timeout "${PARALLEL_DRAFTERS_TIMEOUT:-340}" python3 -m bench.engines.parallel_drafters --device cuda --out-dir "$OUT/$TABLE/parallel_drafters" \
      ${PARALLEL_DRAFTERS_ARGS:---draft random:qwen3-0.6b --rows 32 --processes 1,2,4 --setup sessions --prompt-tokens 400 --max-model-len 1024 --num-calls 10 --cuda-mps} 2>&1 \
      | tee "$OUT/$TABLE/parallel_drafters.log" | grep -E "PARALLEL_DRAFTERS|Error" | tail -20
fi
[ -z "${SMOKE_ONLY:-}" ] || exit 0
left() { echo $(( TOTAL_S - ($(date +%s) - START) )); }
case "$TABLE" in
  paper) ARGS="--target random:llama-8b --draft random:qwen3-0.6b --fixed-acceptance 0.7 --max-tokens 256"
         SYSTEMS=${SYSTEMS:-vllm-ar,ar-vllm,psd-vllm,vllm-sd-k4,sd-vllm} ;;
  smollm2) ARGS="--target smollm2-135m-instruct --max-tokens 256"
           SYSTEMS=${SYSTEMS:-vllm-ar,ar-vllm,psd-vllm,vllm-sd-k4,sd-vllm,psd-native} ;;
  *) echo "unknown TABLE $TABLE" >&2; exit 2 ;;
esac
rm -rf "/tmp/work/$TABLE/logs"   # a warm machine keeps an earlier call's logs: logs.tgz holds this call's alone
python3 -m bench.engines.engines_compare --out-dir "$OUT/$TABLE" --work-dir /tmp/work/$TABLE --device cuda --dtype bfloat16 \
    $ARGS --systems "$SYSTEMS" --concurrencies "${CONCURRENCIES:-1,4,16,32,64}" --k 4 --m 32 \
    --max-model-len "${MAX_MODEL_LEN:-2048}" $([ "${MPS:-1}" = 0 ] || echo --cuda-mps) --drafter-gpu 0 --requests-per-client 2 --min-requests 4 --max-requests 128 \
    --data "${DATA:-/root/stage/x/question.jsonl}" --time-budget-s "$(( $(left) - 40 ))" ${EXTRA:-}
echo "engines_compare $TABLE done, $(left) s left"
tar czf "$OUT/$TABLE/logs.tgz" -C /tmp/work/$TABLE logs 2>/dev/null
# the compile caches a later start of the same engine reuses (a repeated vllm-ar start: torch.compile 20 -> 5 s,
# engine init 40 -> 10 s): their size, to judge carrying them to the next lease
du -sh /root/.cache/vllm /root/.triton /tmp/torchinductor_root 2>/dev/null | tee "$OUT/$TABLE/compile_caches.txt"
ls -la "$OUT/$TABLE"
