#!/bin/bash
# One GPU lease (H200 image: Python 3.12, jax 0.11.2): install, check that every strategy agrees
# on q4_0 experts, measure the CPU executor per format, then decode side by side at the shape of
# the llama.cpp comparison (24-layer Qwen3-30B-A3B, uniform routing, batch 1; q4_0 slots holding
# the fraction of experts that `-ncmoe 17` keeps on the GPU: 847 of 3072 experts, 2.248 GB).
# Usage (device `run`, carry .whl): bash benchmarks/h200_quant.sh [decode|prefill|formats]...
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit 1
python3 -m pip install -q --no-deps --no-build-isolation -e . > "$OUT/install.log" 2>&1 || { tail -30 "$OUT/install.log"; exit 1; }
B="python3 -m freetoken_jax.bench"
SHAPE="--preset qwen3-30b-a3b --layers 24 --routing-skew 0 --prompt-len 16 --gen-len 64 --prompt-by-decode"
for what in "$@"; do
  case $what in
    check) python3 benchmarks/check_strategies.py --preset qwen3-30b-a3b --layers 2 --expert-format q4_0 2>&1 | tail -8 ;;
    bw) $B bw --json "$OUT/bw.json" 2>&1 | tail -40 ;;
    decode) $B decode $SHAPE --expert-format q4_0 --vram-gb 2.2482 --strategy hybrid cpu offload fused --compile-workers 3 --json "$OUT/q4_decode.json" 2>&1 | grep -v "it/s\]" | tail -25 ;;
    prefill) $B prefill --preset qwen3-30b-a3b --layers 24 --expert-format q4_0 --vram-gb 2.2482 --prompt-len 2048 --chunk 2048 --strategy offload --json "$OUT/q4_prefill.json" 2>&1 | tail -8 ;;
    formats) for f in q8_0 fp8 mxfp4 nvfp4; do
        s=$(python3 -c "print(round(847 * 3 * 768 * 2048 * {'q8_0': 34/32, 'fp8': 132/128, 'mxfp4': 17/32, 'nvfp4': 36/64}['$f'] / 1e9 + 5e-5, 4))")
        $B decode $SHAPE --expert-format $f --vram-gb $s --strategy hybrid offload --compile-workers 2 --json "$OUT/${f}_decode.json" 2>&1 | grep -v "it/s\]" | tail -4
      done ;;
  esac
done
