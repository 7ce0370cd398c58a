# zerolayer's image for those who can pull base images: a Rust builder, then the same layout as
# scripts/image (which builds it offline, from scratch): the binary at /usr/local/bin/zerolayer,
# the non-root user zerolayer (uid 10001), a writable /tmp, and /models for a mounted volume.
# The image holds no model.
#
#   docker build -t zerolayer:0.1.0 .
#   docker run -p 8080:8080 -v "$PWD/models:/models:ro" zerolayer:0.1.0
FROM rust:1-slim-bookworm AS build
RUN apt-get update && apt-get install -y --no-install-recommends cmake clang pkg-config && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY . .
RUN cargo build --release --locked -p zerolayer-coordinator --bin zerolayer \
 && strip target/release/zerolayer

FROM debian:bookworm-slim
RUN groupadd --gid 10001 zerolayer \
 && useradd --uid 10001 --gid 10001 --home-dir /tmp --shell /sbin/nologin zerolayer \
 && mkdir -p /models && chown 10001:10001 /models
COPY --from=build /src/target/release/zerolayer /usr/local/bin/zerolayer
ENV ZEROLAYER_MODEL__PATH=/models/SmolLM2-135M-Instruct.Q4_1.gguf
USER 10001:10001
WORKDIR /tmp
VOLUME /models
EXPOSE 8080/tcp 7080/udp
ENTRYPOINT ["/usr/local/bin/zerolayer"]
CMD ["up", "--host", "0.0.0.0"]
