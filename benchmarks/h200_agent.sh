#!/bin/bash
# One GPU lease: decode with a JSON-schema constraint against without (benchmarks/bench_structured.py).
# Usage (device `run`, carry .whl): bash benchmarks/h200_agent.sh [fused|hybrid]...
source benchmarks/h200_install.sh
for what in "$@"; do
  case $what in
    fused) python3 benchmarks/bench_structured.py --preset qwen3-30b-a3b --batch 1 8 --gen-len 64 --json "$OUT/structured_fused.json" 2>&1 | grep -v "it/s\]" | tail -9 ;;
    # the llama.cpp comparison's shape: 24 layers, q4_0 experts, 847 slots (the share -ncmoe 17 keeps on the GPU)
    hybrid) python3 benchmarks/bench_structured.py --preset qwen3-30b-a3b --layers 24 --strategy hybrid --expert-format q4_0 --expert-slots 847 \
              --batch 1 --gen-len 64 --json "$OUT/structured_hybrid.json" 2>&1 | grep -v "it/s\]" | tail -6 ;;
  esac
done
