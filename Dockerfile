# GPU image for real runs of cosyvoice-grpo: vLLM 0.28.0, torch 2.13.0 and transformers 5.10.4 -- the releases CI runs
# on the CPU (requirements/gpu.txt) -- verl 0.9.1, Ray Serve, funasr (requirements/common.txt, nodeps.txt) and upstream
# CosyVoice at the pinned commit (grpo/upstream.py).
#   docker build -t cosyvoice-grpo .                        CUDA 13.0: driver R580 or newer (PyPI's wheels)
#   docker build --build-arg CUDA=12 -t cosyvoice-grpo .    CUDA 12.9 builds of the same releases, for CUDA 12 drivers
#     (R525.60 or newer by CUDA's minor-version compatibility): torch from PyTorch's cu129 index, vLLM's cu129 wheel
#     from its GitHub release, everything else at gpu-lock.txt's versions (requirements/gpu-cu12.txt)
# No entrypoint: run stages inside, e.g.
#   docker run --gpus all --shm-size 32g -v $PWD/exp:/workspace/cosyvoice-grpo/exp IMAGE bash run.sh -1 5 profile=cosyvoice2
# Not built on the CPU-only development machines (no Docker engine there); CI lints it with hadolint.
ARG CUDA=13
FROM nvidia/cuda:13.0.1-cudnn-devel-ubuntu24.04 AS cuda13
FROM nvidia/cuda:12.9.1-cudnn-devel-ubuntu24.04 AS cuda12
# hadolint ignore=DL3006
FROM cuda${CUDA}
ARG CUDA

ENV DEBIAN_FRONTEND=noninteractive \
    PIP_NO_CACHE_DIR=1 \
    PYTHONUNBUFFERED=1 \
    VENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH

# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv python3-dev build-essential git \
       ffmpeg sox libsndfile1 espeak-ng ca-certificates \
    && rm -rf /var/lib/apt/lists/*

RUN python3 -m venv /opt/venv && pip install --upgrade pip==26.3

WORKDIR /workspace/cosyvoice-grpo
COPY requirements/ requirements/
# gpu-lock.txt: the whole set resolved for this image's Python and platform (scripts/gpu_lock.py; CI checks it).
# CUDA=12: the CUDA 12.9 builds of torch and vLLM (requirements/gpu-cu12.txt), the rest constrained to gpu-lock.txt
# less its CUDA 13 builds (`scripts/gpu_lock.py constraints 12`); pip resolves the CUDA 12 libraries at build time.
COPY scripts/gpu_lock.py scripts/gpu_lock.py
RUN python scripts/gpu_lock.py constraints "$CUDA" > /tmp/constraints.txt \
    && pip install -c /tmp/constraints.txt -r "requirements/$(python scripts/gpu_lock.py requirements "$CUDA")" \
       -r requirements/common.txt \
    && pip install --no-deps -r requirements/nodeps.txt \
    && site=$(python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])") \
    && rm -rf "$site/tests" "$site/recipe" "$site/scripts" "$site/tutorial"

COPY . .
# CosyVoice's code: upstream at the commit grpo/upstream.py pins, with its Matcha-TTS submodule, cloned into
# $COSYVOICE_CACHE and put on the venv's path (the same code path as `bash run.sh setup`; it checks every file).
# run.sh looks for a set-up venv at $VENV; this image's venv is complete. The environment check (every import the
# stages make, --no-deps ones included, and upstream's files) runs at build time: a missing import fails the build,
# not the first stage on a GPU node (no GPU is needed to import).
ENV COSYVOICE_CACHE=/opt/cosyvoice-upstream
RUN pip install --no-deps -e . && python -m grpo.upstream install && python -m grpo.envcheck \
    && touch /opt/venv/.setup-stamp
