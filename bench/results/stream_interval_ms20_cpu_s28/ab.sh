#!/usr/bin/env bash
# A/B on this CPU: the 50 ms cap (default) against a 20 ms cap, tiny Llama, alternating order
cd "$(dirname "$0")/../../.."
for pair in 1 2 3; do
  if [ $((pair % 2)) = 1 ]; then S=ar-vllm,ar-vllm-ms20; else S=ar-vllm-ms20,ar-vllm; fi
  .venv/bin/python -m bench.engines.engines_compare --out-dir bench/results/stream_interval_ms20_cpu_s28/$pair --work-dir /tmp/s28/ms20/work$pair \
    --device cpu --dtype float32 --target random:tiny-llama-hd64 --systems $S --concurrencies 4,16 \
    --max-tokens 256 --m 32 --k 4 --max-model-len 2048 --num-warmup 2 --enforce-eager \
    --requests-per-client 3 --min-requests 4 --max-requests 96 > /tmp/ms20_$pair.log 2>&1
done
