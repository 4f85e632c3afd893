# pagewalk on an NVIDIA GPU: `pagewalk serve` on port 8000, the playground at /.
#   docker build -t pagewalk .
#   docker run --gpus all -p 8000:8000 -v /path/to/checkpoints:/models:ro pagewalk --model /models/Llama-3.2-1B
# With no arguments it serves the `tiny` preset (random weights). PAGEWALK_API_KEY=... requires a key.
ARG CUDA_IMAGE=nvidia/cuda:12.8.1-runtime-ubuntu24.04

# ---- build: a virtual environment with torch (CUDA wheels) and pagewalk -----------------------------------
FROM ${CUDA_IMAGE} AS build
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128
ENV DEBIAN_FRONTEND=noninteractive PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
# Ubuntu's python3 of the base release, unpinned: pins would break on every point release of the base image
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv \
 && rm -rf /var/lib/apt/lists/*
RUN python3 -m venv /opt/pagewalk
ENV PATH=/opt/pagewalk/bin:$PATH
# torch first, from the CUDA index: the project's `torch>=2.4` is then already satisfied
RUN pip install --index-url "${TORCH_INDEX_URL}" "torch>=2.4"
WORKDIR /src
COPY pyproject.toml README.md ./
COPY server server
COPY kernels kernels
COPY kvcache kvcache
COPY loadtest loadtest
RUN pip install .

# ---- runtime ------------------------------------------------------------------------------------------
FROM ${CUDA_IMAGE}
# Triton compiles its small launcher modules at run time: it needs a C compiler and Python's headers.
ENV DEBIAN_FRONTEND=noninteractive
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-dev gcc libc6-dev \
 && rm -rf /var/lib/apt/lists/* \
 && useradd --create-home --uid 10001 --shell /usr/sbin/nologin pagewalk \
 && mkdir /models && chown pagewalk:pagewalk /models
COPY --from=build /opt/pagewalk /opt/pagewalk
ENV PATH=/opt/pagewalk/bin:$PATH PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 HOME=/home/pagewalk
USER 10001
WORKDIR /home/pagewalk
VOLUME ["/models"]
EXPOSE 8000
# Loading a checkpoint and capturing the decode graphs take a while before /health answers 200.
HEALTHCHECK --interval=15s --timeout=5s --start-period=180s --retries=3 \
  CMD ["python3", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=4)"]
ENTRYPOINT ["pagewalk", "serve", "--host", "0.0.0.0", "--port", "8000"]
CMD ["--model", "tiny"]
