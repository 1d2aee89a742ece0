# infinity on a CUDA machine. Build:  docker build -t infinity .
# Run with an NVMe drive mounted as the swap path (O_DIRECT needs a real filesystem, not overlayfs):
#   docker run --gpus all --ipc=host --ulimit memlock=-1 -v /mnt/nvme0:/nvme infinity \
#       infinity train --nvme-path /nvme
# Pinned host buffers use cudaHostRegister, which needs the memlock limit lifted (as above).
FROM pytorch/pytorch:2.5.1-cuda12.4-cudnn9-runtime
RUN apt-get update && apt-get install -y --no-install-recommends g++ cmake ninja-build \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /opt/infinity
COPY . .
# The base image's torch satisfies the dependency, so pip keeps it (no second torch download).
RUN pip install --no-cache-dir ".[test]" && python -c "import infinity; print(infinity.native_info())"
VOLUME ["/nvme"]
CMD ["infinity", "--help"]
