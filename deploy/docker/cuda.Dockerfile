# syntax=docker/dockerfile:1
# jaxcpp for NVIDIA GPUs: JAX's CUDA 12 plugin with its pip CUDA libraries, `jaxcpp serve` as the entry point.
#
#   docker build -f deploy/docker/cuda.Dockerfile -t jaxcpp:cuda .
#   docker run --gpus all --shm-size 16g -p 50051:50051 -p 9400:9400 jaxcpp:cuda
#
# `docker run IMAGE` serves the bundled tiny model on 0.0.0.0:50051 (metrics on 9400). Arguments after the
# image replace only the model part (`--model tiny`); a later flag wins, so `--port 8000` still works.
# Real models are mounted read-only under /models; the persistent XLA compilation cache is the
# /var/cache/jaxcpp volume. The host needs only the NVIDIA driver and container toolkit: `jax[cuda12]`
# brings cuDNN, cuBLAS and NCCL as wheels, so the base is a plain Python image. See docs/deploy.md.
#
# JAX_VERSION must lie in pyproject.toml's jax range (tests/deploy/test_docker.py checks it).
ARG PYTHON_VERSION=3.12.11
ARG JAX_VERSION=0.10.2

# -- build: a virtual environment with the dependencies (a cached layer), then the package ------------------
FROM python:${PYTHON_VERSION}-slim-bookworm AS build
ARG JAX_VERSION
ENV PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
WORKDIR /src
# Dependencies first, from pyproject.toml alone: this layer is rebuilt only when the dependencies change.
COPY pyproject.toml ./
RUN --mount=type=cache,target=/root/.cache/pip \
    python3 -c "import tomllib; print('\n'.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies']))" \
        > requirements.txt \
    && pip install -r requirements.txt "jax[cuda12]==${JAX_VERSION}" "jaxlib==${JAX_VERSION}"
COPY README.md ./
COPY jaxcpp ./jaxcpp
COPY models ./models
COPY kernels ./kernels
COPY serving ./serving
# Non-editable and without resolving: every dependency is already in the layer above.
RUN --mount=type=cache,target=/root/.cache/pip \
    pip install --no-deps . \
    && python3 -c "import jaxcpp.serving.cli, jaxcpp.models.checkpoint as c; assert c.BUNDLED_MODELS['tiny'].is_dir()"

# -- runtime: the same Python base, the venv, a non-root user -----------------------------------------------
FROM python:${PYTHON_VERSION}-slim-bookworm AS runtime
ARG JAX_VERSION
LABEL org.opencontainers.image.title="jaxcpp (CUDA)" \
      org.opencontainers.image.description="JAX/XLA pipeline-parallel LLM inference server, CUDA build" \
      jaxcpp.jax-version="${JAX_VERSION}"
RUN groupadd --system --gid 10001 jaxcpp \
    && useradd --system --uid 10001 --gid jaxcpp --home-dir /home/jaxcpp --create-home \
        --shell /usr/sbin/nologin jaxcpp \
    && mkdir -p /models /var/cache/jaxcpp \
    && chown jaxcpp:jaxcpp /var/cache/jaxcpp
COPY --from=build /opt/venv /opt/venv
# NVIDIA_*: what the NVIDIA container runtime mounts (the driver's compute libraries and nvidia-smi).
# Every path the server writes is under /var/cache/jaxcpp or /tmp, so the root filesystem can be read-only.
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    NVIDIA_VISIBLE_DEVICES=all \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility \
    JAXCPP_COMPILATION_CACHE_DIR=/var/cache/jaxcpp/xla \
    XDG_CACHE_HOME=/var/cache/jaxcpp \
    MPLCONFIGDIR=/tmp/matplotlib
USER 10001:10001
WORKDIR /home/jaxcpp
VOLUME ["/var/cache/jaxcpp"]
# 50051: gRPC (jaxcpp.v1, grpc.health.v1, reflection); 9400: Prometheus /metrics
EXPOSE 50051 9400
# Healthy once every bucket is compiled: health is NOT_SERVING during the warm-up compile.
HEALTHCHECK --interval=15s --timeout=5s --start-period=900s --retries=3 \
    CMD ["python3", "-c", "import sys; from jaxcpp.serving import Client; sys.exit(Client('127.0.0.1:50051', timeout=4).health() != 'SERVING')"]
ENTRYPOINT ["jaxcpp", "serve", "--host", "0.0.0.0", "--port", "50051", "--metrics-port", "9400"]
CMD ["--model", "tiny"]
