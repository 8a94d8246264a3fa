#!/usr/bin/env bash
# dtrain vs PyTorch on this CPU, same model, batch, input, optimizer and threads, run
# side by side (alternating, best of ROUNDS). Prints both throughputs and the ratio.
#   scripts/bench/compare_cpu.sh [resnet20|gpt|llama|unet|RECIPE] [THREADS]
#     resnet20 (default): configs/bench/resnet20_fmnist_cpu.toml (ResNet-20, batch 128, 28x28)
#     gpt:  configs/gpt_fortunes.toml's model (4 layers, 128 wide, block 128, bytes), batch 32, fp32
#     llama: configs/llama_fortunes.toml's model on synthetic data (4 layers, 128 wide, 4 heads over
#           2 key/value heads, SwiGLU 352, block 128, bytes, untied head), batch 16, fp32; twin
#           scripts/bench/llama_torch.py (on PyTorch < 2.0, e.g. Debian's 1.13, its attention is a
#           masked softmax with the key/value heads repeated)
#     unet: U-Net depth 3, 16 base channels, 64x64, batch 8, fp32
#     RECIPE: a ResNet-20 recipe of your own (the twin runs ResNet-20, batch 128, 28x28)
# Environment: ROUNDS (3), PYTHON (with PyTorch; default .venv/bin/python), DTRAIN (default
# ./build/dtrain).
set -euo pipefail
cd "$(dirname "$0")/../.."
WHAT=${1:-resnet20}
THREADS=${2:-$(nproc)}
ROUNDS=${ROUNDS:-3}
PY=${PYTHON:-.venv/bin/python}
DTRAIN=${DTRAIN:-./build/dtrain}
case $WHAT in
  gpt)
    UNIT=tokens
    DT=(configs/bench/gpt2_124m.toml --set run.device=cpu --set precision.dtype=fp32 --set 'model.preset=""'
        --set model.n_layer=4 --set model.n_head=4 --set model.n_embd=128 --set model.block_size=128
        --set model.vocab_size=256 --set train.batch_size=32)
    TW=(scripts/bench/gpt_torch.py --n-layer 4 --n-head 4 --n-embd 128 --block 128 --vocab 256 --batch 32) ;;
  llama)
    UNIT=tokens
    DT=(configs/llama_fortunes.toml --set run.device=cpu --set precision.dtype=fp32 --set 'data.kind="synthetic"'
        --set train.batch_size=16)
    TW=(scripts/bench/llama_torch.py --n-layer 4 --n-head 4 --n-kv-head 2 --n-embd 128 --intermediate 352
        --block 128 --vocab 256 --untied --rms-eps 1e-6 --rope-theta 10000 --rope-scaling none --batch 16
        --lr 4e-3 --beta1 0.9 --beta2 0.99 --weight-decay 0.1 --clip 1.0) ;;
  unet)
    UNIT=images
    DT=(configs/bench/unet_bf16.toml --set run.device=cpu --set precision.dtype=fp32 --set run.cudnn_benchmark=false
        --set model.depth=3 --set model.base_channels=16 --set data.synthetic_height=64
        --set data.synthetic_width=64 --set train.batch_size=8)
    TW=(scripts/bench/unet_torch.py --depth 3 --base 16 --size 64 --batch 8) ;;
  *)
    UNIT=images
    RECIPE=$WHAT; [ "$WHAT" = resnet20 ] && RECIPE=configs/bench/resnet20_fmnist_cpu.toml
    DT=("$RECIPE")
    TW=(scripts/bench/resnet_torch.py --depth 20 --stem cifar --batch 128 --size 28 --channels 1) ;;
esac
best_d=0; best_t=0
for r in $(seq "$ROUNDS"); do
  d=$("$DTRAIN" bench "${DT[@]}" --set run.threads="$THREADS" --warmup 5 --steps 30 | sed -n "s/^throughput: \([0-9.]*\) $UNIT.*/\1/p")
  t=$($PY "${TW[@]}" --threads "$THREADS" --warmup 5 --steps 30 | sed -n "s/^torch: \([0-9.]*\) $UNIT.*/\1/p")
  echo "round $r: dtrain $d $UNIT/s | torch $t $UNIT/s"
  best_d=$(python3 -c "print(max($best_d, $d))"); best_t=$(python3 -c "print(max($best_t, $t))")
done
python3 -c "print(f'best: dtrain {$best_d:.1f} $UNIT/s | PyTorch {$best_t:.1f} $UNIT/s | ratio {$best_d/$best_t:.2f}x')"
