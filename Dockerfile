# One image for every Nori role; compose.yaml picks the command.
FROM python:3.11-slim
ARG TORCH_SPEC="torch==2.13.0"
WORKDIR /opt/nori
COPY pyproject.toml README.md ./
COPY shared ./shared
COPY services ./services
COPY proto ./proto
RUN pip install --no-cache-dir "${TORCH_SPEC}" && pip install --no-cache-dir ".[gpu]"
ENV NORI_CACHE_DIR=/var/cache/nori
ENTRYPOINT ["nori"]
