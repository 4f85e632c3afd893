# pagewalk on a CUDA GPU: `docker build -t pagewalk . && docker run --gpus all -p 8000:8000 pagewalk`
# (add `--model /models/x` with `-v /path/to/checkpoint:/models/x:ro` to serve a local checkpoint).
# The base image brings a CUDA build of torch and triton; pip keeps them (pagewalk asks for torch>=2.4).
FROM pytorch/pytorch:2.5.1-cuda12.4-cudnn9-runtime

ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1
WORKDIR /opt/pagewalk
COPY pyproject.toml README.md ./
COPY server ./server
COPY kernels ./kernels
COPY kvcache ./kvcache
COPY loadtest ./loadtest
RUN pip install --no-cache-dir . && useradd --create-home --uid 10001 pagewalk
# Triton compiles kernels on first use and caches them under $HOME/.triton
USER pagewalk
EXPOSE 8000
HEALTHCHECK --interval=30s --timeout=5s --start-period=120s \
  CMD python -c "import httpx, sys; sys.exit(httpx.get('http://127.0.0.1:8000/health').status_code != 200)"
ENTRYPOINT ["pagewalk", "serve", "--host", "0.0.0.0", "--port", "8000"]
CMD ["--model", "tiny"]
