#!/bin/bash
# gpt-oss on the GPU machine: every strategy agrees on the gpt-oss-120b preset's MXFP4 experts
# (biases, sinks, sliding windows, the clamped SwiGLU on the GPU and in the CPU executor), then
# decode side by side with llama.cpp on a GGUF of the same shape (12 of its 36 layers: 20.3 GB of
# MXFP4 experts; the 25% of experts that `-ncmoe 9` keeps on the GPU = 384 of 1536 slots of
# 13.22 MB = 5.077 GB).
# MODEL=20b: the whole gpt-oss-20b shape instead (24 layers of 32 experts, 10.2 GB of MXFP4; 25% on
# the GPU: `-ncmoe 18`, 192 slots = 2.538 GB).
# Usage (device `run`, carry .whl .llamacpp): [MODEL=20b] bash benchmarks/h200_gptoss.sh [check|lcpp-build|lcpp|decode]...
source benchmarks/h200_install.sh
if [ "${MODEL:-120b}" = 20b ]; then L=24; E=32; SLOTS=2.538; SHAPE="--preset gpt-oss-20b"
else L=12; E=128; SLOTS=5.077; SHAPE="--preset gpt-oss-120b --layers $L"; fi
SHAPE="$SHAPE --routing-skew 0 --prompt-len 16 --gen-len 64 --prompt-by-decode"
for what in "$@"; do
  case $what in
    check) python3 benchmarks/check_strategies.py --preset gpt-oss-120b --layers 2 2>&1 | tail -8 ;;
    lcpp-build) python3 benchmarks/gen_gguf_gpt_oss.py --out /tmp/gptoss.gguf --layers $L --experts $E --gguf-py .llamacpp/gguf-py > /tmp/gen.log 2>&1 &
      mkdir -p /tmp/lcpp && tar xzf .llamacpp/llama-src.tar.gz -C /tmp/lcpp
      (cd /tmp/lcpp && cmake -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DGGML_NATIVE=ON \
        -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF > /tmp/cmake.log 2>&1 &&
        timeout 480 cmake --build build --target llama-bench -j 16 > /tmp/build.log 2>&1; echo llama.cpp build_rc=$?)
      wait; tail -2 /tmp/gen.log; ls -la /tmp/gptoss.gguf ;;
    lcpp) /tmp/lcpp/build/bin/llama-bench -m /tmp/gptoss.gguf -ngl 99 -ncmoe $L,$((L * 3 / 4)) -t 16 -lm none -p 0 -n 64 -r 3 -o md 2>&1 | tail -6
      /tmp/lcpp/build/bin/llama-bench -m /tmp/gptoss.gguf -ngl 99 -t 16 -p 0 -n 64 -r 3 -o md 2>&1 | tail -3 ;;
    decode) $B decode $SHAPE --slots-gb $SLOTS --strategy hybrid cpu offload fused --compile-workers 3 --json "$OUT/gptoss_decode.json" 2>&1 | grep -v "it/s\]" | tail -14 ;;
  esac
done
