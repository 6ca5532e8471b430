#!/bin/bash
# A/B: ITL of ar-vllm before (629a786) and after (26c889b+) joined rows stream; same loadgen.
set -u
OUT=${OUT:-/tmp/s27/itl_ab}
mkdir -p $OUT
for rep in 1 2; do
  for side in before after; do
    dir=/work/main; [ $side = before ] && dir=/tmp/s27/before
    (cd $dir && .venv/bin/python -m bench.engines.engines_compare --out-dir $OUT/$side-$rep --device cpu --dtype float32 \
      --target random:tiny-llama-hd64 --systems ar-vllm --concurrencies 4,16 --max-tokens 128 --max-model-len 1024 \
      --num-warmup 2 --enforce-eager --requests-per-client 3 --min-requests 8 --m 8 \
      --data /work/shared/data/spec_bench/question.jsonl) > $OUT/$side-$rep.log 2>&1
    echo "$side-$rep rc=$?"
  done
done
