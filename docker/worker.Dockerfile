# gpu-worker, and `kv-manager demo`: the project with its worker and demo extras.
#
#   docker build -f docker/worker.Dockerfile -t kv-manager-worker:cpu .
#   docker build -f docker/worker.Dockerfile --build-arg TORCH_VARIANT=cu130 -t kv-manager-worker:cu130 .
#
# TORCH_VARIANT names the PyTorch wheel index torch comes from: `cpu` (the
# default: the CPU build, at the version constraints/cpu.txt pins) or a CUDA
# one (cu126, cu130; docker-compose.gpu.yml sets it), with torch and Triton at
# the versions constraints/cuda.txt pins. Every pip install of the image takes
# the variant's constraints, so the project's own install cannot move them.
# The CUDA wheels bring their CUDA libraries and Triton its ptxas; the host
# needs the NVIDIA driver (docker/README.md gives the minimum) and the NVIDIA
# Container Toolkit.

FROM python:3.11-slim-bookworm

ARG TORCH_VARIANT=cpu

# gcc (with OpenSSL's headers) builds the core's C block encoder and hash chain
# at install time, and Triton's kernel launchers at run time on a GPU.
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev libssl-dev \
    && rm -rf /var/lib/apt/lists/*
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1

WORKDIR /app
# torch first, in its own layer: source changes do not download it again.
COPY constraints/ constraints/
RUN if [ "$TORCH_VARIANT" = cpu ]; then cp constraints/cpu.txt /opt/venv/constraints.txt; \
    else cp constraints/cuda.txt /opt/venv/constraints.txt; fi \
    && pip install --no-cache-dir -c /opt/venv/constraints.txt \
        --index-url "https://download.pytorch.org/whl/$TORCH_VARIANT" torch

# Installed in place (editable), as in a checkout.
COPY . .
RUN pip install --no-cache-dir -c /opt/venv/constraints.txt -e ".[worker,demo]"

COPY docker/grpc_health_check.py /usr/local/bin/grpc-health-check
RUN chmod 755 /usr/local/bin/grpc-health-check \
    && useradd --system --uid 10001 --create-home kv
USER kv
# gRPC, Prometheus /metrics
EXPOSE 50061 9101
# The services pass the whole command line (see docker-compose.yml).
CMD ["gpu-worker", "--help"]
