#!/bin/bash
# One GPU lease (H200 image): where a host-bank decode step's time goes, and prefill's expert
# compute. Shape: 24-layer Qwen3-30B-A3B, q4_0 experts, the slots of -ncmoe 17 (2.2482 GB), batch 1.
# Usage (device `run`, carry .whl): bash benchmarks/h200_step.sh [check|sync|grouped|pgrouped|pprofile|pprev|ppgle|pflags|overlap|stacks|ekernels|attn|aprofile|aload|words|xflags|ncu|kernels|cuda|cudafused|cudarows|timeline]...
#   check:   the handoff and strategy tests on the GPU with the signalling kernels
#            (FREETOKEN_HANDOFF_SYNC=kernel);
#   sync:    profile_step's cpu and hybrid steps (wall, the calling thread's time on a core, handoff
#            windows) with the handoff signalled by stream memory operations (the default), by
#            kernels, by host functions, and outside the CUDA graphs (ffi_nograph);
#   grouped: q4_0 offload prefill of 2048 and 8192 tokens in one chunk, experts dense and grouped;
#   pgrouped: the same under uniform synthetic routing (--routing-skew 0: a preset's random router
#            sends a chunk's tokens to a few experts, and grouped falls back to dense), each layer
#            loaded by whole-bank copies (the default on a GPU) and by the Pallas fetch;
#   pprofile: one q4_0 prefill chunk of PTOK (2048) tokens through the two layer buffers, PVARS
#            (dense grouped), uniform synthetic routing, under the kernel profiler (profile_step
#            --prefill-tokens), with the kernels that ran while no layer copy was in flight;
#   pflags:  the grouped 2048-token chunk of pprofile with XLA's default command buffers and with
#            conditionals and while loops recorded into them too (the attention's block loop and
#            grouped's capacity switch, whose predicates read on the host are the likely source of
#            the per-layer device-to-host copies and idle gaps in the profile);
#   overlap: whether a layer's load from pinned host memory runs beside compute in one jitted
#            program, on one stream or under compute_on("gpu_stream:1") (benchmarks/stream_overlap.py);
#   stacks:  where the thread that launches cpu, hybrid and offload steps spends its time: its native
#            stack sampled over 300 steps (profile_step --stacks);
#   ekernels: decode's q4_0 experts through the Pallas kernels of pallas_kernels/gathered_experts.py
#            beside XLA's fusion (benchmarks/bench_expert_kernels.py), then fused and hybrid decode
#            with each (--expert-impl kernel / auto);
#   attn:    decode with the attention kernel of pallas_kernels/decode_attention.py (with the norms,
#            rotation and page writes too, and without) and with XLA's (FREETOKEN_DECODE_ATTENTION=
#            fused / kernel / xla, or those ATTN lists; fused and hybrid at one q, Q or 0.45, the same machine);
#   aprofile: the fused step's kernels under the profiler with each;
#   aload:   fused q4_0 decode at 16 and 4096 positions, and the step's attention kernel in the profile, for
#            each BLOCK of ALOAD (64 128): the entries the attention kernel's loop reads a pass
#            (decode_attention.BLOCK, set in this copy of the tree);
#   words:   one layer's q4_0 experts as XLA reads them (words, the pairs' sum folded), the engine's
#            matvec beside the variants of benchmarks/bench_expert_kernels.py, each kernel's device
#            time; then fused decode rows and the step's profile alternating this tree's
#            formats.py and PREV's (.llamacpp/formats_prev.py: WORDS, head prev head prev);
#   xflags:  the engine's experts microbenchmark (`xla words`) and a fused decode row with XLA's defaults,
#            then under each XLA flag of XFLAGS (the block-level (Triton) rewriter of fusions; loops unrolled up to 8);
#   ncu:     the engine's expert reductions (`bench_expert_kernels.py --only "xla words" --exact`, 2 layers a call;
#            NCU_ONLY names another variant) under Nsight Compute (`ncu --clock-control none`): NCU_N (4) launches
#            of its reduce kernels after NCU_SKIP (20: past the reference's and the first calls'), with their speed
#            of light, occupancy, launch shape, warp stalls and memory sections (what bounds them: $OUT/ncu.txt whole);
#   kernels: decode's gathered-expert matvec per format (benchmarks/bench_matvec.py), then the fused and
#            hybrid q4_0 steps under the kernel profiler, their optimized HLO kept as $OUT/*.hlo.txt.gz
#            (the profile names kernels; the HLO says what each one computes);
#   pprev:   the 8192-token q4_0 prefill chunk with this tree's PFILE and with a previous copy of it, PREV, in turn;
#   cuda:    decode's q4_0 experts through the CUDA kernels of cpu_ext/cuda/q4_0_experts.cu by themselves
#            (benchmarks/cuda/bench_q4_0_experts.cu: every variant, checked against float64) and their tests on the GPU;
#   cudafused: fused decode rows (fused_row) under each FREETOKEN_DECODE_EXPERTS of CUDA (default xla cuda);
#   cudarows: fused and hybrid decode rows with XLA's reductions and with the kernels in turn
#            (FREETOKEN_DECODE_EXPERTS: CUDA, default xla cuda xla cuda);
#   timeline: the fused, cpu and hybrid q4_0 steps under the kernel profiler with TL (120) events of
#            each step's middle listed in time order (what runs between two handoff windows), their
#            optimized HLO kept as $OUT/*.hlo.txt.gz.
source benchmarks/h200_install.sh
P="python3 benchmarks/profile_step.py --preset qwen3-30b-a3b --layers 24 --expert-format q4_0 --slots-gb 2.2482 --out $OUT --no-profile --warm 8"
# The constants a case sets are set in this copy of the tree: keep FILE saves it once, restore puts every saved file back.
keep() { [ -f "/tmp/kept/$1" ] || { mkdir -p "/tmp/kept/$(dirname "$1")" && cp "$1" "/tmp/kept/$1"; }; }
restore() { (cd /tmp/kept 2> /dev/null && find . -type f) | while read -r f; do cp "/tmp/kept/$f" "$f"; done; rm -rf /tmp/kept; }
# set_const FILE NAME VALUE: the module-level `NAME = ...` line of FILE set to VALUE (printed, with how many lines matched)
set_const() { keep "$1"; sed -i "s/^$2 = [A-Za-z0-9_.]*/$2 = $3/" "$1"; echo "== $1: $2 = $3 ($(grep -c "^$2 = $3\b" "$1") line)"; }
# fused_row TAG PATTERN [bench args]: a fused q4_0 decode row (prompt 16 by decode unless args say), then, with PATTERN,
# the step's profile's lines that match it
fused_row() { local tag=$1 pat=$2; shift 2
  timeout 150 $B decode --preset qwen3-30b-a3b --layers 24 --routing-skew 0 --gen-len 64 --expert-format q4_0 --strategy fused \
    --compile-workers 2 ${*:---prompt-len 16 --prompt-by-decode} --json "$OUT/$tag.json" > "$OUT/$tag.log" 2>&1
  echo "-- $tag rc=$?"; grep -v "it/s\]" "$OUT/$tag.log" | tail -1
  [ -z "$pat" ] || timeout 90 ${P/--no-profile/} --top 8 --timeline 12 2>&1 | grep -E "ms/step|$pat" | head -8; }
for what in "$@"; do
  case $what in
    # (test_bad_calls_raise checks the CPU backend's handlers: a CUDA job's errors are printed, not raised)
    check) FREETOKEN_HANDOFF_SYNC=kernel python3 -m pytest -q tests/runtime/test_handoff.py tests/runtime/test_hybrid.py \
             tests/runtime/test_cpu_strategy.py --deselect tests/runtime/test_handoff.py::test_bad_calls_raise 2>&1 | tail -4 ;;
    cuda) nvcc -O3 -arch=sm_90 -o /tmp/bench_q4 benchmarks/cuda/bench_q4_0_experts.cu 2>&1 | grep -v -i warn
      timeout 150 /tmp/bench_q4 64 > "$OUT/bench_q4.log" 2>&1; echo "bench rc=$?"; grep -v "^check" "$OUT/bench_q4.log"; grep -c " ok$" "$OUT/bench_q4.log"
      timeout 200 python3 -m pytest -q tests/kernels/test_cuda_experts.py 2>&1 | tail -3 ;;
    cudafused) for how in ${CUDA:-xla cuda}; do FREETOKEN_DECODE_EXPERTS=$how fused_row fused_$how ""; done ;;
    cudarows) for how in ${CUDA:-xla cuda xla cuda}; do
        FREETOKEN_DECODE_EXPERTS=$how timeout 200 $B decode --preset qwen3-30b-a3b --layers 24 --routing-skew 0 --prompt-len 16 --gen-len 64 \
          --prompt-by-decode --expert-format q4_0 --slots-gb 2.2482 --strategy fused hybrid --compile-workers 2 --json "$OUT/dec_$how.json" \
          > "$OUT/dec_$how.log" 2>&1
        echo "== FREETOKEN_DECODE_EXPERTS=$how rc=$?"; grep -v "it/s\]" "$OUT/dec_$how.log" | tail -3
      done ;;
    pprofile) timeout 300 ${P/--no-profile/} --prefill-tokens ${PTOK:-2048} --variants ${PVARS:-dense grouped} --top 16 2>&1 | grep -v "it/s\]" | cut -c1-200 ;;
    # ppgle: one q4_0 prefill chunk of PTOK (8192) tokens under each prefill_load of LOADS (copy copy2), each compiled as
    #        the engine does and again with a profile of its own runs (XLA's profile-guided latency estimator: profile_step --pgle)
    ppgle) for load in ${LOADS:-copy copy2}; do echo "== prefill_load $load"
        timeout 280 $P --prefill-tokens ${PTOK:-8192} --prefill-load $load --variants grouped --pgle 2>&1 | grep -E "PGLE|^== " | cut -c1-160
      done ;;
    pflags) for f in "" "--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,CONDITIONAL,WHILE"; do
        echo "== XLA_FLAGS=$f"
        XLA_FLAGS="$f" timeout 200 ${P/--no-profile/} --prefill-tokens 2048 --variants grouped --top 6 2>&1 | grep -v "it/s\]" | cut -c1-200 | tail -12
      done ;;
    overlap) timeout 240 python3 benchmarks/stream_overlap.py --layers 4 --reps 40 2>&1 | tail -14
      echo "== without xla_gpu_experimental_stream_annotation"
      timeout 120 python3 benchmarks/stream_overlap.py --layers 4 --reps 10 --no-annotate --variants load compute stream1 inplace1 2>&1 | tail -6 ;;
    # ekernels: the q4_0 decode kernels beside XLA's fusion (one layer in a loop), then decode with
    # each (fused and hybrid, the same machine)
    ekernels) timeout 150 python3 benchmarks/bench_expert_kernels.py 2>&1 | grep -v Warning | tail -16
      for impl in kernel auto; do
        timeout 170 $B decode --preset qwen3-30b-a3b --layers 24 --routing-skew 0 --prompt-len 16 --gen-len 64 --prompt-by-decode \
          --expert-format q4_0 --slots-gb 2.2482 --strategy fused hybrid --compile-workers 2 --expert-impl $impl \
          --json "$OUT/dec_$impl.json" > "$OUT/dec_$impl.log" 2>&1
        echo "== --expert-impl $impl rc=$?"; grep -v "it/s\]" "$OUT/dec_$impl.log" | tail -3
      done ;;
    attn) for impl in ${ATTN:-fused kernel xla}; do
        FREETOKEN_DECODE_ATTENTION=$impl timeout 170 $B decode --preset qwen3-30b-a3b --layers 24 --routing-skew 0 --prompt-len 16 --gen-len 64 \
          --prompt-by-decode --expert-format q4_0 --slots-gb 2.2482 --strategy hybrid fused --q ${Q:-0.45} --compile-workers 2 \
          --json "$OUT/dec_attn_$impl.json" > "$OUT/dec_attn_$impl.log" 2>&1
        echo "== FREETOKEN_DECODE_ATTENTION=$impl rc=$?"; grep -v "it/s\]" "$OUT/dec_attn_$impl.log" | tail -3
      done ;;
    aprofile) for impl in ${ATTN:-fused kernel xla}; do
        echo "== profile, FREETOKEN_DECODE_ATTENTION=$impl"
        FREETOKEN_DECODE_ATTENTION=$impl timeout 90 ${P/--no-profile/} --top 14 2>&1 | grep -v "it/s\]" | cut -c1-140 | tail -18
      done ;;
    aload) for blk in ${ALOAD:-64 128}; do
        set_const pallas_kernels/decode_attention.py BLOCK $blk
        fused_row aload_${blk}_16 decode_attention; fused_row aload_${blk}_4096 "" --prompt-len 4096
      done; restore ;;
    words) timeout -k 10 300 python3 benchmarks/bench_expert_kernels.py --steps 24 --only "xla words" 2>&1 | grep -v -i warn | tail -12
      for how in ${WORDS:-head prev head prev}; do restore; [ $how = prev ] && keep freetoken_jax/quant/formats.py && cp ${PREV:-.llamacpp/formats_prev.py} freetoken_jax/quant/formats.py
        echo "== formats.py of $how"; fused_row words_$how "input_reduce|loop_"
      done; restore ;;
    xflags) for f in "" ${XFLAGS:---xla_gpu_experimental_enable_fusion_block_level_rewriter=true --xla_gpu_experimental_max_unroll_factor=8}; do
        echo "== XLA_FLAGS=$f"; n=$((${n:-0} + 1))
        XLA_FLAGS="$f" timeout 120 python3 benchmarks/bench_expert_kernels.py --steps 24 --only "xla words" --exact 2>&1 | grep -v -i warn | tail -2
        XLA_FLAGS="$f" fused_row xflags_$n ""
      done ;;
    ncu) ncu=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2> /dev/null | tail -1); echo "-- ncu: ${ncu:-not found}"
      BENCH_NO_PROFILER=1 timeout -k 10 ${NCU_S:-400} $ncu --clock-control none -k regex:input_reduce_fusion --launch-skip ${NCU_SKIP:-20} \
        --launch-count ${NCU_N:-4} --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
        --section MemoryWorkloadAnalysis python3 benchmarks/bench_expert_kernels.py --steps 2 --only "${NCU_ONLY:-xla words}" --exact > "$OUT/ncu.txt" 2>&1
      echo "-- ncu rc=$?"; grep -E "input_reduce_fusion|Duration|Throughput|Occupancy|Registers Per|Block Size|Grid Size|Waves Per SM|Stall|Hit Rate|Mem Busy|Max Bandwidth|Issued|Eligible|One or More" \
        "$OUT/ncu.txt" | cut -c1-150 | head -120 ;;
    kernels) timeout 120 python3 benchmarks/bench_matvec.py 2>&1 | tail -9
      timeout 90 ${P/--no-profile/} --top 40 > "$OUT/prof_fused.log" 2>&1; grep -v "it/s\]" "$OUT/prof_fused.log" | cut -c1-160 | tail -46
      timeout 120 ${P/--no-profile/} --strategies hybrid --top 40 > "$OUT/prof_hybrid.log" 2>&1; grep -v "it/s\]" "$OUT/prof_hybrid.log" | cut -c1-160 | tail -46
      gzip -f "$OUT"/*.hlo.txt ;;
    timeline) for s in fused cpu hybrid; do
        st=$([ $s = fused ] || echo "--strategies $s")
        timeout 150 ${P/--no-profile/} $st --top 25 --timeline ${TL:-120} > "$OUT/timeline_$s.log" 2>&1
        echo "== $s rc=$?"; grep -v "it/s\]" "$OUT/timeline_$s.log" | grep -E "==|handoff|returns" | cut -c1-200
      done
      gzip -f "$OUT"/*.hlo.txt ;;
    stacks) $P --strategies ${STACKS:-cpu hybrid offload} --stacks 300 2>&1 | grep -v "it/s\]" | cut -c1-220 ;;
    sync) for s in default kernel host_function; do
        echo "== FREETOKEN_HANDOFF_SYNC=$s"
        FREETOKEN_HANDOFF_SYNC=$s timeout 150 $P --strategies cpu hybrid 2>&1 | grep -E "thread|handoffs|returns|=="
      done
      echo "== ffi_nograph"; timeout 150 $P --strategies cpu hybrid --handoff ffi_nograph 2>&1 | grep -E "thread|handoffs|returns|==" ;;
    pgrouped) for impl in dense grouped; do
        timeout 280 $B prefill --preset qwen3-30b-a3b --layers 24 --expert-format q4_0 --slots-gb 2.2482 --prompt-len 2048 8192 --chunk 2048 8192 \
          --routing-skew 0 --strategy offload offload-fetch --expert-impl $impl --json "$OUT/prefill_skew0_$impl.json" 2>&1 | grep -v "it/s\]" | tail -5
      done ;;
    # pprev: the 8192-token q4_0 prefill chunk (PSKEW: routing skews, 0 1) with this tree's PFILE
    #        (freetoken_jax/models/routed.py) and with PREV's (.llamacpp/routed_prev.py) in turn (PWAYS: head prev head)
    pprev) n=0; for how in ${PWAYS:-head prev head}; do n=$((n + 1)); restore; [ $how = prev ] && keep ${PFILE:-freetoken_jax/models/routed.py} &&
          cp ${PREV:-.llamacpp/routed_prev.py} ${PFILE:-freetoken_jax/models/routed.py}
        echo "== ${PFILE:-freetoken_jax/models/routed.py} of $how"
        timeout ${PAB_S:-300} $B prefill --preset qwen3-30b-a3b --layers 24 --expert-format q4_0 --slots-gb 2.2482 --prompt-len 8192 --chunk 8192 \
          --routing-skew ${PSKEW:-0 1} --strategy offload --json "$OUT/pprev_${n}_$how.json" 2>&1 | grep -v "it/s\]" | tail -3
      done; restore ;;
    grouped) for impl in dense grouped; do
        $B prefill --preset qwen3-30b-a3b --layers 24 --expert-format q4_0 --slots-gb 2.2482 --prompt-len 2048 8192 --chunk 2048 8192 \
          --strategy offload --expert-impl $impl --json "$OUT/prefill_$impl.json" 2>&1 | grep -v "it/s\]" | tail -6
      done ;;
  esac
done 2>&1 | tee -a "$OUT/h200_step.txt"  # (kept whole: a call cut off at its limit loses the tail it pipes)
rm -f "$OUT"/*.hlo.txt
