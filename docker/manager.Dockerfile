# kv-manager serve: the manager and its Redis mirror, without torch or Triton.
#
#   docker build -f docker/manager.Dockerfile -t kv-manager:dev .
#
# The build stage compiles the install (the gRPC modules generated from proto/,
# the core's optional C block encoder and its C hash chain, which needs
# OpenSSL's headers) into a virtual environment; the final
# image holds that environment and no compiler.

FROM python:3.11-slim-bookworm AS build
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev libssl-dev \
    && rm -rf /var/lib/apt/lists/*
RUN python -m venv /opt/venv
WORKDIR /src
COPY . .
RUN /opt/venv/bin/pip install --no-cache-dir ".[redis]"

FROM python:3.11-slim-bookworm
COPY --from=build /opt/venv /opt/venv
COPY docker/grpc_health_check.py /usr/local/bin/grpc-health-check
RUN chmod 755 /usr/local/bin/grpc-health-check \
    && useradd --system --uid 10001 --create-home kv
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1
USER kv
# gRPC, Prometheus /metrics
EXPOSE 50051 9100
CMD ["kv-manager", "serve", "--host", "0.0.0.0", "--port", "50051"]
