# The kvfleet image: Python, torch, Ray and this repo installed, so that KubeRay's `ray start`,
# the RayJob entrypoint `python -m kvfleet.job` and the RayService app `serving.app:build_app`
# all run from it. k8s/ names it registry.example.invalid/kvfleet:0.1.0 (a placeholder; see
# k8s/README.md "Building the image"). tests/unit/test_dockerfile_*.py check this file statically.
#
# CPU (the default): python:3.11-slim and torch's CPU wheel.
#   docker build -t registry.example.invalid/kvfleet:0.1.0 .
# CUDA: another base image and torch's CUDA wheel (PyPI's Linux wheel is the CUDA build; or name
# a download.pytorch.org/whl/cuXXX index for another CUDA version).
#   docker build --build-arg BASE_IMAGE=nvidia/cuda:12.9.1-runtime-ubuntu24.04 \
#     --build-arg TORCH_INDEX_URL=https://pypi.org/simple -t registry.example.invalid/kvfleet:0.1.0 .
# A base without python3 (the CUDA images) gets its distribution's python3 (3.12 on Ubuntu
# 24.04); the build stops if it is older than 3.11.
#
# KubeRay replaces the command with `ray start ...` (through bash); the CMD below is for
# `docker run -p 8000:8000 <image>`: the OpenAI API of a local cluster on port 8000.

ARG BASE_IMAGE=python:3.11-slim
FROM ${BASE_IMAGE}

ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    RAY_USAGE_STATS_ENABLED=0 \
    VIRTUAL_ENV=/opt/kvfleet/venv \
    PATH=/opt/kvfleet/venv/bin:$PATH

# wget: KubeRay's exec probes call it. The venv keeps pip away from the distribution's Python;
# the profile.d line puts it first on PATH in login shells too (KubeRay's ENABLE_LOGIN_SHELL).
RUN export DEBIAN_FRONTEND=noninteractive \
 && apt-get update \
 && apt-get install -y --no-install-recommends ca-certificates wget \
 && if ! command -v python3 >/dev/null 2>&1; then \
        apt-get install -y --no-install-recommends python3 python3-venv python3-dev; \
    fi \
 && rm -rf /var/lib/apt/lists/* \
 && python3 -c 'import sys; assert sys.version_info >= (3, 11), "kvfleet needs Python >= 3.11"' \
 && python3 -m venv "$VIRTUAL_ENV" \
 && echo 'export PATH=/opt/kvfleet/venv/bin:$PATH' > /etc/profile.d/kvfleet-venv.sh

# torch first, from the index the build chose; `pip install .` then keeps it (pyproject allows it).
RUN pip install "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX_URL}"

# Only what the package needs (.dockerignore keeps the rest out of the build context).
WORKDIR /opt/kvfleet/src
COPY pyproject.toml setup.py README.md ./
COPY configs/ configs/
COPY engine/ engine/
COPY actors/ actors/
COPY cluster/ cluster/
COPY serving/ serving/
COPY kvfleet/ kvfleet/
# setup.py builds the routing index's compiled core (engine/routing/_core.c), the routing
# policy's load book (engine/routing/_load.c) and in-flight prefixes (engine/routing/_inflight.c)
# and the host tier's row copies (engine/_row_copy.c) with a C compiler
# installed for this step only and the Python headers (in python:*-slim; python3-dev above for a
# distribution's python3); without them the install would go on with the pure-Python holder maps,
# load book, in-flight prefixes and numpy row copies.
RUN export DEBIAN_FRONTEND=noninteractive \
 && apt-get update \
 && apt-get install -y --no-install-recommends gcc libc6-dev \
 && pip install . \
 && (cd / && python -c 'import engine.routing._core, engine.routing._load, engine.routing._inflight, engine._row_copy') \
 && apt-get purge -y --auto-remove gcc libc6-dev \
 && rm -rf /var/lib/apt/lists/* build *.egg-info

# A non-root user. Its group (10001) is the fsGroup of the k8s/ head pods, so it can write the
# data volume; HOME holds the model cache (~/.cache/kvfleet).
RUN groupadd --gid 10001 kvfleet \
 && useradd --uid 10001 --gid 10001 --create-home --shell /bin/bash kvfleet
USER 10001:10001
ENV HOME=/home/kvfleet
WORKDIR /home/kvfleet

# Ray Serve HTTP, Ray dashboard, Ray GCS.
EXPOSE 8000 8265 6379

CMD ["kvfleet", "serve", "--config", "local", "--set", "serve.host=0.0.0.0"]
