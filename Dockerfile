# GPU image for real runs of cosyvoice-grpo: vLLM 0.28.0, torch 2.13.0 and transformers 5.10.4 -- the releases CI runs
# on the CPU (requirements/gpu.txt) -- verl 0.9.1, Ray Serve, funasr (requirements/common.txt, nodeps.txt) and upstream
# CosyVoice at the pinned commit (grpo/upstream/pin.py).
#   docker build -t cosyvoice-grpo .          CUDA 13.0 (PyPI's wheels): driver R580 or newer, or on a data-centre GPU
#     an older driver through CUDA's forward-compatibility libraries, which this base image carries in
#     /usr/local/cuda/compat (NVIDIA Container Toolkit 1.17.5+ puts them on the loader path when the driver is older).
#     There is no CUDA 12 flavour: vLLM publishes 0.28.0 for CUDA 12.9 and 13.0 only, and torch 2.13.0 has no
#     CUDA 12.9 build for that wheel to run on (docs/gpu.md names the sources).
# No entrypoint: run stages inside, e.g.
#   docker run --gpus all --shm-size 32g -v $PWD/exp:/workspace/cosyvoice-grpo/exp IMAGE bash run.sh -1 5 profile=cosyvoice2
# Not built on the CPU-only development machines (no Docker engine there); CI lints it with hadolint.
FROM nvidia/cuda:13.0.1-cudnn-devel-ubuntu24.04

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
# TorchCodec goes, as on the CPU (scripts/setup_env.sh): soundfile is the one audio decoder (grpo/upstream/shims.py), and the
# environment check below decodes a real wav through upstream's load_wav.
RUN pip install -c requirements/gpu-lock.txt -r requirements/gpu.txt -r requirements/common.txt \
    && pip install --no-deps -r requirements/nodeps.txt \
    && pip uninstall -y torchcodec \
    && site=$(python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])") \
    && rm -rf "$site/tests" "$site/recipe" "$site/scripts" "$site/tutorial"

COPY . .
# CosyVoice's code: upstream at the commit grpo/upstream/pin.py pins, with its Matcha-TTS submodule, cloned into
# $COSYVOICE_CACHE and put on the venv's path (the same code path as `bash run.sh setup`; it checks every file).
# run.sh looks for a set-up venv at $VENV; this image's venv is complete. The environment check (every import the
# stages make, --no-deps ones included, and upstream's files) runs at build time: a missing import fails the build,
# not the first stage on a GPU node (no GPU is needed to import).
ENV COSYVOICE_CACHE=/opt/cosyvoice-upstream
RUN pip install --no-deps -e . && python -m grpo.upstream install && python -m grpo.node.envcheck \
    && touch /opt/venv/.setup-stamp
