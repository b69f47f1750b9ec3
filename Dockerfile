# syntax=docker/dockerfile:1.7
# Two images from one file:
#   docker build --target sidecar -t r3-sidecar:0.1.0 .          the FastAPI sidecar (slim, non-root)
#   docker build --target engine  -t r3-sidecar-engine:0.1.0 .   SGLang 0.5.23 + the plugin (entry point)
# The engine image runs SGLang's own command line unchanged: SGLang finds the plugin through the
# `sglang.srt.plugins` entry point the wheel installs.

ARG PYTHON_IMAGE=python:3.12.11-slim-bookworm
ARG SGLANG_IMAGE=lmsysorg/sglang:v0.5.23

# ---- wheel: build this package once, as a wheel; no build tool reaches a final stage ------------------
FROM ${PYTHON_IMAGE} AS wheel
WORKDIR /src
COPY pyproject.toml README.md ./
COPY service ./service
COPY engine_ext ./engine_ext
RUN python -m pip wheel --no-cache-dir --no-deps --wheel-dir /wheels .

# ---- sidecar-deps: the service's runtime dependencies in a venv ---------------------------------------
FROM ${PYTHON_IMAGE} AS sidecar-deps
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1
COPY --from=wheel /wheels /wheels
RUN python -m venv /opt/r3 \
 && /opt/r3/bin/pip install --no-cache-dir /wheels/*.whl \
 && /opt/r3/bin/pip uninstall --yes pip \
 && rm -rf /wheels

# ---- sidecar: slim runtime, non-root, read-only-root friendly -----------------------------------------
FROM ${PYTHON_IMAGE} AS sidecar
ARG UID=10001
LABEL org.opencontainers.image.title="r3-sidecar" \
      org.opencontainers.image.description="Serves SGLang routed experts from the shared-memory spool to RL trainers" \
      org.opencontainers.image.licenses="Apache-2.0"
RUN groupadd --system --gid "${UID}" r3 \
 && useradd --system --uid "${UID}" --gid r3 --no-create-home --home-dir /nonexistent --shell /usr/sbin/nologin r3
COPY --from=sidecar-deps /opt/r3 /opt/r3
ENV PATH=/opt/r3/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    R3_SPOOL_DIR=/var/run/r3-spool \
    R3_PORT=8000
USER ${UID}:${UID}
EXPOSE 8000
HEALTHCHECK --interval=15s --timeout=3s --start-period=10s --retries=3 \
  CMD ["python", "-c", "import os, urllib.request as u; u.urlopen('http://127.0.0.1:' + os.environ.get('R3_PORT', '8000') + '/healthz', timeout=2)"]
ENTRYPOINT ["r3-sidecar"]
CMD ["serve", "--host", "0.0.0.0", "--port", "8000"]

# ---- engine: the official SGLang image plus the plugin -------------------------------------------------
# The constraint file is the image's own package set: installing the plugin may add packages but never
# changes a version SGLang was built against (pip fails instead).
FROM ${SGLANG_IMAGE} AS engine
COPY --from=wheel /wheels /tmp/wheels
RUN python3 -m pip list --format=freeze > /tmp/sglang-image.txt \
 && python3 -m pip install --no-cache-dir --constraint /tmp/sglang-image.txt "$(ls /tmp/wheels/*.whl)[engine]" \
 && python3 -c "from importlib.metadata import entry_points; assert any(e.value == 'engine_ext.sglang:register' for e in entry_points(group='sglang.srt.plugins'))" \
 && rm -rf /tmp/wheels /tmp/sglang-image.txt
ENV R3_SPOOL_DIR=/var/run/r3-spool
