# syntax=docker/dockerfile:1
# elastic-runner: the package and its dependencies in a virtual environment (/opt/venv) on
# python:3.11-slim, running as uid 10001 (the manifests' runAsUser). See deploy/README.md.
#
#   CPU image (torch 2.13.0+cpu from PyTorch's CPU index, pinned by constraints/cpu.txt):
#     docker build -t ghcr.io/elastic-runner/elastic-runner:0.1.0 .
#   CUDA image (torch from a CUDA index; CONSTRAINTS= leaves torch unpinned, while
#   CONSTRAINTS=constraints/cpu.txt keeps torch==2.13.0, which matches 2.13.0+cuXXX too):
#     docker build -t ghcr.io/elastic-runner/elastic-runner:0.1.0-cuda \
#       --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu126 --build-arg CONSTRAINTS= .
#   Extra packages, e.g. the fsspec driver of an object store for checkpoint.dir=s3://...:
#     docker build --build-arg EXTRA_PACKAGES="s3fs" ...
#   The package's extras, e.g. hf (transformers, tokenizers: the text_classification and
#   causal_lm tasks, users' transformers models):
#     docker build --build-arg EXTRAS=hf ...
#
# ENTRYPOINT is the CLI, CMD its default arguments:
#   docker run --rm --init IMAGE run configs/digits.yaml   ->  elastic-runner run configs/digits.yaml
#   docker run --rm IMAGE                                  ->  elastic-runner --help
# A Kubernetes `command:` replaces ENTRYPOINT (and drops CMD), so the PyTorchJob's
# command: ["elastic-runner", "run", "/etc/elastic-runner/job.yaml"] runs exactly that; `args:`
# alone would keep the ENTRYPOINT (args: ["run", "/etc/elastic-runner/job.yaml"]).

ARG PYTHON_IMAGE=python:3.11-slim

FROM ${PYTHON_IMAGE} AS builder
# Where torch comes from. The default is PyTorch's CPU index: on PyPI, torch for Linux x86_64 is
# the CUDA build (several GB of nvidia-* wheels), which constraints/cpu.txt alone would not avoid
# (it only pins torch==2.13.0). Empty: torch from PyPI like every other dependency.
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
# pip constraints file (relative to the build context); empty for none
ARG CONSTRAINTS=constraints/cpu.txt
# more pip requirements, space separated (e.g. "s3fs" or "gcsfs" for checkpoints on an object store)
ARG EXTRA_PACKAGES=
# the package's extras, comma separated (e.g. "hf"); empty for none
ARG EXTRAS=
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
WORKDIR /src
COPY pyproject.toml README.md ./
COPY constraints/ constraints/
COPY elastic_runner/ elastic_runner/
# 1. torch alone from TORCH_INDEX_URL (--index-url: only that index, as PyTorch documents it);
# 2. the package (a regular, non-editable install) and its other dependencies from PyPI; torch is
#    already installed and satisfies both the package's torch range and the constraint, so pip
#    keeps it (the range, torch>=2.4,<2.16, is compat.registry.SUPPORTED_TORCH).
# ${CONSTRAINTS:+-c "$CONSTRAINTS"} adds "-c FILE" only when CONSTRAINTS is not empty, and
# ${EXTRAS:+[$EXTRAS]} "[hf]" only when EXTRAS is not empty.
# hadolint ignore=SC2086
RUN set -eu; \
    if [ -n "$TORCH_INDEX_URL" ]; then \
        pip install --no-cache-dir ${CONSTRAINTS:+-c "$CONSTRAINTS"} \
            --index-url "$TORCH_INDEX_URL" "torch>=2.4,<2.16"; \
    fi; \
    pip install --no-cache-dir ${CONSTRAINTS:+-c "$CONSTRAINTS"} ".${EXTRAS:+[$EXTRAS]}" \
        $EXTRA_PACKAGES; \
    python -c "import torch, elastic_runner.agent.launch, elastic_runner.worker; print('torch', torch.__version__)"; \
    elastic-runner --help >/dev/null

FROM ${PYTHON_IMAGE}
# a named user for uid 10001: getpass.getuser() (torch's compile caches) and ~ need an entry in
# /etc/passwd; the pod's runAsUser: 10001 / fsGroup: 10001 match it
RUN groupadd --gid 10001 runner \
 && useradd --uid 10001 --gid 10001 --create-home --home-dir /home/runner \
        --shell /usr/sbin/nologin runner \
 && mkdir /workspace \
 && chown 10001:10001 /workspace
# only the virtual environment: no compiler, no pip cache, no sources
COPY --from=builder /opt/venv /opt/venv
# the example configs, for a smoke test: docker run --rm --init IMAGE run configs/digits.yaml
COPY --chown=10001:10001 configs/ /workspace/configs/
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONPATH=/workspace
# relative paths (runs/..., a task package such as mypkg/ next to the config) resolve here; the
# workers inherit this directory, and PYTHONPATH makes task packages in it importable
WORKDIR /workspace
USER 10001:10001
# the node's metrics/health endpoint (metrics.port in the job config; /metrics /healthz /readyz /health)
EXPOSE 9400
ENTRYPOINT ["elastic-runner"]
CMD ["--help"]
