#!/bin/bash
# One GPU lease (H200 image: Python 3.12, jax 0.11.2): install, check that every strategy agrees
# on q4_0 experts, measure the CPU executor per format, then decode side by side at the shape of
# the llama.cpp comparison (24-layer Qwen3-30B-A3B, uniform routing, batch 1; q4_0 slots holding
# the fraction of experts that `-ncmoe 17` keeps on the GPU: 847 of 3072 experts, 2.248 GB).
# Usage (device `run`, carry .whl [.llamacpp]): bash benchmarks/h200_quant.sh [check|bw|decode|prefill|flash|copywait|experts|cpuprefill|batch|formats|mla|
# lcpp-build|lcpp-bg|lcpp-wait|lcpp|lcpp-gpu|lcpp-pp|ik-build|ik-bg|ik-wait|ik|ab|pab|cbuf|stepdisp|qsweep|capacity|gguf-q4|gguf-q4k]... (lcpp-build: llama.cpp's llama-bench, the Q4_0 GGUF of the comparison
# and, unless Q4_ONLY is set, Q4_K ones of the same shape, ≈ 4 min (seconds from a packed build, below); lcpp: its Q4_0 rows in the same lease; ik-build / ik:
# ik_llama.cpp's llama-bench (.llamacpp/ik-src.tar.gz, ../shared/bench/llamacpp/prepare_ik.sh) and its Q4_0 rows on the same
# GGUF (lcpp-build writes it); qsweep: hybrid at several q (one executable: q is traced); capacity: the qwen3-235b-a22b
# preset, as many layers as RAM holds; gguf-F: the GGUF file /tmp/F.gguf read raw, loaded and decoded by the engine
# from the file itself, and by llama.cpp on the same file). decode runs the strategies STRATS lists (all four by default).
# ik-bg (first, before the install): in its own process session, which outlives the call (the lease's later calls go on
# meanwhile; measure nothing on the CPU until it ends): ik_llama.cpp's build and the kit's Q4_0 GGUF (/tmp/q4.gguf, needs
# .llamacpp/gen_gguf.py and gguf-py), then ik_llama.cpp's decode rows on it (the `ik` rows less prefill) into /tmp/ik-rows.md
# on a CPU that nothing else of this script uses; `ik-wait` waits up to WAIT_S s for all of it and prints the rows.
# ik_llama.cpp's decode rows (run-time repacking, -rtr 1, needs -mmp 0; fused MoE: the kit's fastest setting), experts on the
# CPU (--n-cpu-moe 24) and at the share of -ncmoe 17; used by `ik-bg` and `ik`
ik_rows() { local I=/tmp/ik/build/bin/llama-bench
  $I -m /tmp/q4.gguf -ngl 99 --n-cpu-moe 24 -t 16 -mmp 0 -fmoe 1 -rtr 1 -p 0 -n 128 -r 3 -o md 2>&1 | grep "^|"
  $I -m /tmp/q4.gguf -ngl 99 --n-cpu-moe 17 -t 16 -mmp 0 -fmoe 1 -rtr 1 -p 0 -n 128 -r 3 -o md 2>&1 | grep "^|" | tail -1; }
export -f ik_rows
# A finished llama.cpp build's llama-bench and libraries come back under $OUT as NAME-bin.tar.xz.aa, .ab, ... (pieces of
# 15 MiB); copied into .llamacpp/ here, later leases unpack them instead of building (the same image and CPUs).
pack() { local b=/tmp/$1/build; [ -x $b/bin/llama-bench ] || return 0
  (cd $b && XZ_OPT="-6 -T0" tar cJf - bin $(find . -name "*.so*" -not -path "./bin/*")) | split -b 15M - "$OUT/$1-bin.tar.xz."; ls -la "$OUT"/$1-bin.*; }
unpack() { ls .llamacpp/$1-bin.tar.xz.* > /dev/null 2>&1 || return 1
  mkdir -p /tmp/$1/build && cat .llamacpp/$1-bin.tar.xz.* | tar xJf - -C /tmp/$1/build && ! ldd /tmp/$1/build/bin/llama-bench | grep -q "not found" &&
    echo "$1: llama-bench unpacked from .llamacpp/$1-bin.tar.xz.*"; }
# llama.cpp's llama-bench from .llamacpp/llama-src.tar.gz (≈ 4 min on 16 cores) beside the comparison's GGUFs (lcpp_gguf:
# the kit's Q4_0 at /tmp/q4.gguf and, unless Q4_ONLY is set, Q4_K and Q4_K_M files of the same shape)
lcpp_gguf() { (cd .llamacpp && python3 gen_gguf.py --out /tmp/q4.gguf --layers 24 --experts q4_0 > /tmp/gen.log 2>&1
  [ -z "$Q4_ONLY" ] || exit 0
  python3 ../benchmarks/gen_gguf.py --out /tmp/q4k.gguf --layers 24 --experts q4_k > /tmp/genk.log 2>&1
  python3 ../benchmarks/gen_gguf.py --out /tmp/q4km.gguf --layers 24 --experts q4_k_m >> /tmp/genk.log 2>&1); tail -1 /tmp/gen.log; }
lcpp_build() { lcpp_gguf &
  mkdir -p /tmp/lcpp && tar xzf .llamacpp/llama-src.tar.gz -C /tmp/lcpp
  (cd /tmp/lcpp && cmake -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DGGML_NATIVE=ON \
    -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF > /tmp/cmake.log 2>&1 &&
    timeout 480 cmake --build build --target llama-bench -j 16 > /tmp/build.log 2>&1; echo llama.cpp build_rc=$?); wait; }
export -f lcpp_gguf lcpp_build pack unpack
# lcpp-bg (first, before the install): lcpp_build (or a packed build unpacked) at the lowest CPU priority in its own process session, which outlives
# the call (measure nothing on the CPU until it ends: at that priority the CPU executor's probe still measured 24-27 GB/s
# during the build against 61-66 without it), the Q4_0 GGUF alone unless Q4_ONLY is set empty; `lcpp-wait` waits
# up to WAIT_S s for it and packs a fresh build
if [ "$1" = lcpp-bg ]; then
  (Q4_ONLY=${Q4_ONLY-1} setsid nohup nice -n 19 bash -c 'if unpack lcpp; then lcpp_gguf; else lcpp_build; fi; echo lcpp_done' > /tmp/lcpp-bg.log 2>&1 < /dev/null &)
  echo "llama.cpp build and GGUFs started in the background (/tmp/lcpp-bg.log)"; shift
fi
if [ "$1" = ik-bg ]; then
  (BUILD_S=${BUILD_S:-1500} setsid nohup bash -c '
    Q4_ONLY=1 lcpp_gguf &
    bash .llamacpp/device_build_ik.sh; wait
    [ -x /tmp/ik/build/bin/llama-bench ] && [ -f /tmp/q4.gguf ] && ik_rows > /tmp/ik-rows.md
    echo ik_done' > /tmp/ik-bg.log 2>&1 < /dev/null &)
  echo "ik_llama.cpp build, GGUF and rows started in the background (/tmp/ik-bg.log)"; shift
fi
source benchmarks/h200_install.sh
SHAPE="--preset qwen3-30b-a3b --layers 24 --routing-skew 0 --prompt-len 16 --gen-len 64 --prompt-by-decode"
for what in "$@"; do
  case $what in
    check) python3 benchmarks/check_strategies.py --preset qwen3-30b-a3b --layers 2 --expert-format q4_0 2>&1 | tail -8 ;;
    bw) $B bw --json "$OUT/bw.json" 2>&1 | tail -40 ;;
    decode) $B decode $SHAPE --expert-format q4_0 --slots-gb 2.2482 --strategy ${STRATS:-hybrid cpu offload fused} --compile-workers 3 --json "$OUT/q4_decode.json" 2>&1 | grep -v "it/s\]" | tail -25 ;;
    # prefill: uniform routing as the kit's GGUF routes (the rows set beside llama.cpp), and Zipf 1 as a trained router skews
    prefill) $B prefill --preset qwen3-30b-a3b --layers 24 --expert-format q4_0 --slots-gb 2.2482 --prompt-len 2048 8192 --chunk 2048 8192 \
               --routing-skew 0 1 --strategy offload --json "$OUT/q4_prefill.json" 2>&1 | grep -v "it/s\]" | tail -10 ;;
    # mla: DeepSeek decode in the latent space through XLA (auto) and through the decode attention kernel
    # (FREETOKEN_DECODE_ATTENTION=kernel), the GPU tests of both first, then fused rows at 4096 positions, alternating
    mla) python3 -m pytest -q -p no:cacheprovider tests/models/test_attention_blocks.py tests/kernels/test_decode_attention.py \
           -k "latent or mla or rope16" 2>&1 | tail -2
      for how in auto kernel auto kernel; do echo "== FREETOKEN_DECODE_ATTENTION=$how"
        FREETOKEN_DECODE_ATTENTION=$how $B decode --preset deepseek-v2-lite --layers 12 --routing-skew 0 --prompt-len 4096 --gen-len 32 \
          --strategy fused 2>&1 | grep -v "it/s\]" | tail -1; done ;;
    # flash: a prefill chunk's causal attention through cuDNN (FREETOKEN_PREFILL_ATTENTION), tested on this GPU, then offload
    # prefill rows with the blocked attention, with it, and with the prefix before a chunk through cuDNN too
    # (FREETOKEN_PREFILL_CACHED=flash); FMT: the expert format (q4_0 unless set), PROMPTS the prompt lengths (2048 8192)
    flash) python3 -m pytest -q -p no:cacheprovider tests/kernels/test_chunk_attention.py tests/models/test_attention_blocks.py 2>&1 | tail -2
      for how in blocked:blocks auto:blocks auto:flash; do echo "== FREETOKEN_PREFILL_ATTENTION=${how%%:*} FREETOKEN_PREFILL_CACHED=${how#*:}"
        FREETOKEN_PREFILL_ATTENTION=${how%%:*} FREETOKEN_PREFILL_CACHED=${how#*:} $B prefill --preset qwen3-30b-a3b --layers 24 \
          --expert-format ${FMT:-q4_0} --slots-gb 2.2482 --prompt-len ${PROMPTS:-2048 8192} --chunk 2048 8192 --routing-skew 0 \
          --strategy offload --json "$OUT/flash_${how/:/_}.json" 2>&1 | grep -v "it/s\]" | tail -7; done ;;
    # copywait: offload prefill with the compute first waiting for the next layer's copied bank at this layer's output or
    # at the next layer's experts (FREETOKEN_PREFILL_COPY_WAIT), q4_0 (slots of -ncmoe 17) then bf16 (8 GB of slots); then
    # an 8192-token q4_0 chunk's profile under each: how long copies and compute run under each other
    copywait) for fmt in q4_0:2.2482 bf16:8; do for w in output experts; do echo "== ${fmt%%:*} FREETOKEN_PREFILL_COPY_WAIT=$w"
        FREETOKEN_PREFILL_COPY_WAIT=$w $B prefill --preset qwen3-30b-a3b --layers 24 --expert-format ${fmt%%:*} --slots-gb ${fmt#*:} \
          --prompt-len 8192 --chunk 2048 8192 --routing-skew 0 --strategy offload --json "$OUT/copywait_${fmt%%:*}_$w.json" 2>&1 |
          grep -v "it/s\]" | tail -3; done; done
      for w in output experts; do echo "== profile, q4_0 8192-token chunk, FREETOKEN_PREFILL_COPY_WAIT=$w"
        FREETOKEN_PREFILL_COPY_WAIT=$w python3 benchmarks/profile_step.py --preset qwen3-30b-a3b --layers 24 --expert-format q4_0 \
          --slots-gb 2.2482 --prefill-tokens 8192 --variants grouped --top 4 2>&1 | grep -E "^== |copies "; done ;;
    # experts: a prefill chunk's routed experts by grouped / tiles (Triton over whole tiles) / ragged (Mosaic GPU): the GPU
    # tests (with the sort-free sampler's and cpu's prefill on the device), one layer's experts at 8192 tokens (uniform and Zipf 1 routing; two of tiles' block settings), then offload
    # prefill of the q4_0 shape (slots of -ncmoe 17) under each FREETOKEN_PREFILL_EXPERTS of HOWS at each routing skew of SKEWS
    experts) python3 -m pytest -q -p no:cacheprovider tests/kernels/test_grouped_experts.py tests/models/test_expert_impls.py \
        tests/runtime/test_sampling.py tests/runtime/test_cpu_strategy.py 2>&1 | tail -2
      python3 benchmarks/bench_prefill_experts.py --tokens 8192 --format ${FMT:-q4_0} --configs 32,4,4:64,4,4 64,8,3:128,8,3 2>&1 |
        tee "$OUT/prefill_experts.txt"
      for skew in ${SKEWS:-0}; do for how in ${HOWS:-grouped tiles ragged}; do echo "== FREETOKEN_PREFILL_EXPERTS=$how skew $skew"
        FREETOKEN_PREFILL_EXPERTS=$how $B prefill --preset qwen3-30b-a3b --layers 24 --expert-format ${FMT:-q4_0} --slots-gb 2.2482 \
          --prompt-len 8192 --chunk 2048 8192 --routing-skew $skew --strategy offload --json "$OUT/experts_${how}_$skew.json" 2>&1 |
          grep -v "it/s\]" | tail -3; done; done ;;
    # batch: fused q4_0 decode at batch 8 and 32 (32 × top-8 > 128 experts: many pairs), the experts by auto (gather up to
    # 4 pairs an expert), grouped (the bank dequantized each step) and tiles
    batch) for impl in auto grouped tiles; do echo "== --expert-impl $impl"
        $B decode $SHAPE --expert-format q4_0 --strategy fused --batch 8 32 --expert-impl $impl --json "$OUT/batch_$impl.json" 2>&1 |
          grep -v "it/s\]" | tail -3; done ;;
    # cpuprefill: strategy cpu's prefill, every chunk on the CPU (cpu-fetch) against long chunks on the device (cpu), beside
    # offload's, q4_0 (FMT) at 512, 2048 and 8192 tokens in one chunk
    cpuprefill) $B prefill --preset qwen3-30b-a3b --layers 24 --expert-format ${FMT:-q4_0} --slots-gb 2.2482 --prompt-len 512 2048 8192 \
        --chunk 8192 --routing-skew 0 --strategy cpu-fetch cpu offload --json "$OUT/cpuprefill.json" 2>&1 | grep -v "it/s\]" | tail -11 ;;
    check-k) python3 benchmarks/check_strategies.py --preset qwen3-30b-a3b --layers 2 --expert-format q4_k 2>&1 | tail -8 ;;
    check-km) python3 benchmarks/check_strategies.py --preset qwen3-30b-a3b --layers 3 --expert-format q4_k --down-format q6_k 2>&1 | tail -4 ;;
    lcpp-build) if unpack lcpp; then lcpp_gguf; else lcpp_build; pack lcpp; fi; ls -la /tmp/q4*.gguf ;;
    lcpp-wait) for _ in $(seq ${WAIT_S:-480}); do grep -q lcpp_done /tmp/lcpp-bg.log 2> /dev/null && break; sleep 1; done
      cat /tmp/lcpp-bg.log; ls .llamacpp/lcpp-bin.tar.xz.* > /dev/null 2>&1 || pack lcpp; ls -la /tmp/q4*.gguf ;;
    gguf-*) f=/tmp/${what#gguf-}.gguf
      # slots for 847 of 3072 experts (the share -ncmoe 17 keeps on the GPU): q4_0 and q4_k 2 654 208 bytes an expert,
      # q4_k_m's slots 3 059 712 (down rows as wide as its Q6_K layers')
      vram=$([ "${what#gguf-}" = q4km ] && echo 2.5916 || echo 2.2482)
      sync; (echo 3 > /proc/sys/vm/drop_caches) 2>/dev/null && state="dropped from the page cache first" || state="as the page cache holds it"
      python3 -c "import sys, time; t = time.perf_counter(); f = open(sys.argv[1], 'rb'); n = 0
while b := f.read(1 << 26): n += len(b)
dt = time.perf_counter() - t; print(f'{sys.argv[1]}: {n / 1e9:.2f} GB read in {dt:.1f} s ({n / dt / 1e9:.2f} GB/s), $state')" $f
      $B decode --model $f --routing-skew 0 --prompt-len 16 --gen-len 64 --prompt-by-decode --slots-gb $vram --strategy hybrid cpu offload \
        --compile-workers 3 --json "$OUT/$(basename $f .gguf)_decode.json" > "$OUT/$(basename $f .gguf).log" 2>&1
      echo "rc=$?"; grep -v "it/s\]" "$OUT/$(basename $f .gguf).log" | tail -12
      /tmp/lcpp/build/bin/llama-bench -m $f -ngl 99 -ncmoe 24,17 -t 16 -lm none -p 0 -n 128 -r 3 -o md 2>&1 | grep "^|" ;;
    # ≈ 11-14 min on 16 cores: two or three calls back to back (ninja resumes). Not packed: its libraries come to
    # 196 MB as xz, over the 64 MiB a call returns or carries, so every lease that runs `ik` builds it.
    ik-build) BUILD_S=${BUILD_S:-540} bash .llamacpp/device_build_ik.sh ;;
    ik-wait) for _ in $(seq ${WAIT_S:-480}); do grep -q ik_done /tmp/ik-bg.log 2> /dev/null && break; sleep 1; done
      cat /tmp/ik-bg.log; tail -2 /tmp/ik-build.log 2> /dev/null; cat /tmp/ik-rows.md 2> /dev/null ;;
    ik) ik_rows
      /tmp/ik/build/bin/llama-bench -m /tmp/q4.gguf -ngl 99 --n-cpu-moe 24 -t 16 -mmp 0 -fmoe 1 -p 2048 -b 2048 -ub 2048 -n 0 -r 2 -o md 2>&1 |
        grep "^|" | tail -1 ;;
    # ab: decode once per setting of AB, each in its own process with its strategies in the order given (a row that
    # follows another strategy's row runs slower): AB="FREETOKEN_CPU_THREADS=16:cpu FREETOKEN_VICTIM_TOPK=kernel:hybrid,offload"
    # (NAME=VALUE[+NAME=VALUE...]:STRATEGY[,STRATEGY...][:BENCH_ARG[+BENCH_ARG...]]; "-" for no variable), e.g. the
    # routed-expert implementations: AB="-:fused,hybrid:--expert-impl+auto -:fused,hybrid:--expert-impl+kernel"
    ab) n=0; for s in $AB; do IFS=: read -r var strats args <<< "$s"; n=$((n + 1)); tag=${n}_$(echo "$s" | tr -c 'A-Za-z0-9_\n' _)
          var=${var/#-/}; env ${var//+/ } timeout 240 $B decode $SHAPE --expert-format q4_0 --slots-gb 2.2482 --strategy ${strats//,/ } --compile-workers 2 \
            ${args//+/ } --json "$OUT/ab_$tag.json" > "$OUT/ab_$tag.log" 2>&1
          echo "== $var: ${strats//,/ } ${args//+/ } rc=$?"; grep -v "it/s\]" "$OUT/ab_$tag.log" | tail -8
        done ;;
    # pab: prefill of 8192 tokens in one chunk (FMT, q4_0 unless set; SLOTS GB of slots, those of -ncmoe 17 unless set) by
    # the strategies PSTRATS (offload: the engine's choice of load; offload-copy, offload-copy2: as named), one process per
    # setting of PAB (as ab's: VAR=VALUE pairs joined by +, "-" for none), e.g. PAB="- XLA_FLAGS=--xla_gpu_enable_latency_hiding_scheduler=true",
    # under the routing skews PSKEW (0; "0 1": uniform and Zipf 1), each process killed at PAB_S (300) s (its build and the
    # chunk's compile alone take over 100 s)
    pab) n=0; for var in $PAB; do n=$((n + 1)); var=${var/#-/}; echo "== ${var:-defaults}"
          env ${var//+/ } timeout ${PAB_S:-300} $B prefill --preset qwen3-30b-a3b --layers 24 --expert-format ${FMT:-q4_0} --slots-gb ${SLOTS:-2.2482} \
            --prompt-len 8192 --chunk 8192 --routing-skew ${PSKEW:-0} --strategy ${PSTRATS:-offload} --json "$OUT/pab_${FMT:-q4_0}_$n.json" 2>&1 |
            grep -v "it/s\]" | tail -$((1 + $(echo ${PSTRATS:-offload} | wc -w) * $(echo ${PSKEW:-0} | wc -w)))
        done ;;
    # cbuf: the fused row with XLA's command buffer log: how often the step's CUDA graph is recorded again, and why (CB_ENV:
    #       VAR=VALUE settings for the row, e.g. CB_ENV=FREETOKEN_DECODE_OUTPUTS=fresh or CB_ENV=FREETOKEN_WEIGHTS=stacked)
    cbuf) env $CB_ENV TF_CPP_MIN_LOG_LEVEL=0 TF_CPP_VMODULE=command_buffer_thunk=3 timeout 200 $B decode $SHAPE --expert-format q4_0 --strategy fused \
            --compile-workers 2 --json "$OUT/cbuf.json" > "$OUT/cbuf.log" 2>&1; echo "rc=$?"; grep -v "it/s\]" "$OUT/cbuf.log" | grep -E "^ *(strategy|fused) "
        echo "graph updates $(grep -c 'Updated command buffer' "$OUT/cbuf.log"), executions $(grep -c 'Execute command buffer' "$OUT/cbuf.log")"
        grep "updated_allocs" "$OUT/cbuf.log" | tail -2 | cut -c1-260; gzip -f "$OUT/cbuf.log" ;;
    # stepdisp: a decode step's host cost under each layout of the KV cache and the weights (a model of tiny widths, 48 layers)
    stepdisp) timeout 300 python3 benchmarks/step_dispatch.py --layers 48 --reps 40 --steps 50 --variants layers:layers stacked:layers \
        stacked:stacked layers:layers stacked:layers stacked:stacked 2>&1 | tail -8 ;;
    qsweep) $B decode $SHAPE --expert-format q4_0 --slots-gb 2.2482 --strategy hybrid --q 0.3 0.35 0.4 0.45 0.5 --json "$OUT/q4_qsweep.json" 2>&1 | grep -v "it/s\]" | tail -7 ;;
    # lcpp-pp: llama.cpp's prefill rows of the 8192-token comparison alone
    lcpp-pp) /tmp/lcpp/build/bin/llama-bench -m /tmp/q4.gguf -ngl 99 -ncmoe 24 -t 16 -lm none -p 8192 -b 8192 -ub 2048,8192 -n 0 -r 2 \
        -o md 2>&1 | grep "^|" ;;
    # lcpp-gpu: llama.cpp's decode all on the GPU (the fused row's comparison) alone
    lcpp-gpu) /tmp/lcpp/build/bin/llama-bench -m /tmp/q4.gguf -ngl 99 -t 16 -p 0 -n 128 -r 3 -o md 2>&1 | grep "^|" ;;
    lcpp) L=/tmp/lcpp/build/bin/llama-bench
      $L -m /tmp/q4.gguf -ngl 99 -ncmoe 24,17 -t 16 -lm none -p 0 -n 128 -r 3 -o md 2>&1 | grep "^|"
      $L -m /tmp/q4.gguf -ngl 99 -ncmoe 24 -t 16 -lm none -p 2048,8192 -b 8192 -ub 2048,8192 -n 0 -r 2 -o md 2>&1 | grep "^|" ;;
    capacity) cap=$(python3 -c "import freetoken_jax, os; print(os.environ['XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB'])")  # GiB
      n=$(python3 -c "print(min(94, int(($cap - 4) / (128 * 3 * 4096 * 1536 * 18 / 32 / 2**30))))")
      echo "pinned cap $cap GiB of $(awk '/MemTotal/ {print int($2 / 1048576)}' /proc/meminfo) GiB RAM: $n of 94 layers"
      $B decode --preset qwen3-235b-a22b --layers $n --routing-skew 0 --prompt-len 16 --gen-len 32 --prompt-by-decode \
        --expert-format q4_0 --slots-gb 64 --strategy hybrid offload --compile-workers 2 --json "$OUT/capacity.json" > "$OUT/capacity.log" 2>&1
      echo "rc=$?"; grep -v "it/s\]" "$OUT/capacity.log" | tail -12 ;;
    formats) for f in q8_0 fp8 mxfp4 nvfp4; do
        s=$(python3 -c "print(round(847 * 3 * 768 * 2048 * {'q8_0': 34/32, 'fp8': 132/128, 'mxfp4': 17/32, 'nvfp4': 36/64}['$f'] / 1e9 + 5e-5, 4))")
        $B decode $SHAPE --expert-format $f --slots-gb $s --strategy hybrid offload --compile-workers 2 --json "$OUT/${f}_decode.json" 2>&1 | grep -v "it/s\]" | tail -4
      done ;;
  esac
done
