#!/bin/bash
# Strategy `auto` on the GPU machine beside `bench decode`'s rows of the same lease, and the whole
# gpt-oss-120b shape (36 layers, 61 GB of MXFP4 experts in pinned host memory) at 16 GB of slots.
# chunks: offload prefill of 8192 tokens at four chunk sizes; engine: the chunk the engine picks, at work.
# Usage (device `run`, carry .whl): bash benchmarks/h200_auto.sh [bw|auto|rows|auto-q4|rows-q4|oss120|chunks|engine]...
source benchmarks/h200_install.sh
QWEN="--preset qwen3-30b-a3b --layers 24"
for what in "$@"; do
  case $what in
    bw) $B bw 2>&1 | grep -v "it/s\]" | tail -12; cp ~/.cache/freetoken_jax/benchbw.json "$OUT/" 2>/dev/null ;;
    auto) python3 benchmarks/auto_choice.py $QWEN --slots-gb 8 2>&1 | grep -v "it/s\]" | tail -4 ;;
    # auto-q4 / rows-q4: the same with q4_0 experts in the slots of the llama.cpp comparison (-ncmoe 17's share)
    auto-q4) python3 benchmarks/auto_choice.py $QWEN --expert-format q4_0 --slots-gb 2.2482 --vram-gb 6 2>&1 | grep -v "it/s\]" | tail -4 ;;
    rows-q4) $B decode $QWEN --expert-format q4_0 --slots-gb 2.2482 --strategy hybrid offload cpu --routing-skew 0 --prompt-len 16 \
            --gen-len 64 --prompt-by-decode --compile-workers 3 --json "$OUT/qwen_rows_q4.json" 2>&1 | grep -v "it/s\]" | tail -8 ;;
    rows) $B decode $QWEN --slots-gb 8 --strategy hybrid offload cpu --routing-skew 0 --prompt-len 16 --gen-len 64 --prompt-by-decode \
            --compile-workers 3 --json "$OUT/qwen_rows.json" 2>&1 | grep -v "it/s\]" | tail -8 ;;
    oss120) $B decode --preset gpt-oss-120b --slots-gb 16 --strategy hybrid cpu offload --routing-skew 0 --prompt-len 16 --gen-len 64 \
            --prompt-by-decode --compile-workers 3 --json "$OUT/oss120.json" 2>&1 | grep -v "it/s\]" | tail -10 ;;
    chunks) $B prefill $QWEN --slots-gb 8 --prompt-len 8192 --chunk 512 1024 2048 4096 --strategy offload --json "$OUT/chunks.json" 2>&1 \
            | grep -v "it/s\]" | tail -8 ;;
    engine) python3 benchmarks/auto_choice.py $QWEN --strategy offload --slots-gb 8 --vram-gb 120 --prompt-len 8000 --max-context 8192 \
              --gen-len 16 2>&1 | grep -v "it/s\]" | tail -3 ;;
  esac
done
