// Decode's routed experts over q4_0 banks in two CUDA kernels, outside XLA's reduction emitter.
//
// A q4_0 block is 18 bytes: an f16 scale d, then 16 bytes whose byte j holds code q[j] in its low
// nibble and q[j + 16] in its high one; weight = d·(q − 8) (GGUF Q4_0). A row of I inputs is
// I/32 blocks. Each block of threads first copies its rows whole into shared memory (cp.async,
// 16 bytes a thread, consecutive threads consecutive bytes: every load a full line, all of them
// in flight at once), in stages whose rows are computed while the later stages' copies land; the
// lanes then read pairs of blocks (36 bytes, nine aligned 32-bit words: the first block's scale
// is the low half of word 0, its codes words 0-4 shifted by two bytes, the second's scale the high
// half of word 4, its codes words 5-8). A code becomes a float by its bits: the byte set into the
// mantissa of 2^23 (one byte permute), minus 2^23 + 8 (one add), exact.
//
//   ft_q4_0_gate_up: grid (F / kGateUpRows, pairs T·K); the pair's gate and up rows against x_t:
//     h[p, f] = round(w[p] · silu(gate_f · x_t) · (up_f · x_t)) to bfloat16, exactly 0 where
//     w[p] is 0 (as models/routed._gathered rounds it);
//   ft_q4_0_down: grid (D / kDownRows, tokens T); the token's K pairs' down rows against their h:
//     y[t, d] = Σ_k down_k,d · h[t·K + k] in float32, rounded to bfloat16.
//
// gate, up and down point at expert 0 of a bank whose experts are `expert_stride` bytes apart
// (slots may be wider than one layer's matrix: an expert's matrix is its row's first bytes). x
// and h are staged as float32, kPad floats of padding after every 64 so that the lanes' 16-byte
// reads of their block pairs fall in distinct banks. Rows of a multiple of 16 bytes (F and D
// multiples of 256) and strides of a multiple of 16 bytes only: the caller checks
// (freetoken_jax/runtime/cuda_experts.py).
//
// nvcc makes PTX of this file (`make ptx`: q4_0_experts.ptx beside it, checked in and embedded
// in the C++ module, which is built without CUDA and loads it through the driver).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

#include "q4_0_experts.h"

// A named namespace, not an anonymous one: nvcc names an anonymous namespace's symbols after the
// file's path, and the checked-in PTX must not depend on where the tree lies.
namespace ft_q4_0 {

constexpr int kWarp = 32;

__device__ __forceinline__ int padded(int i) { return i + (i >> 6) * kPad; }

// Byte i of v (a code 0..15) minus 8, as float32.
__device__ __forceinline__ float code(uint32_t v, int i) {
  return __int_as_float(__byte_perm(v, 0x4B000000u, 0x7440u | i)) - 8388616.0f;
}

__device__ __forceinline__ float half_bits(uint32_t h) { return __half2float(__ushort_as_half(static_cast<unsigned short>(h))); }

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = kWarp / 2; o; o >>= 1) v += __shfl_xor_sync(0xFFFFFFFFu, v, o);
  return v;
}

__device__ __forceinline__ float silu(float g) { return g / (1.f + __expf(-g)); }

__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
  const uint32_t s = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(gmem));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

// Waits for stage s of S (each stage's copies committed as one group, in order; S ≤ 3), then
// for every thread of the block.
template <int S>
__device__ __forceinline__ void wait_stage(int s) {
  static_assert(S >= 1 && S <= 3, "one to three copy stages");
  if (s == S - 1) {
    cp_async_wait<0>();
  } else if (s == S - 2) {
    cp_async_wait<1>();
  } else {
    cp_async_wait<(S > 2 ? 2 : 0)>();
  }
  __syncthreads();
}

struct Pair {
  uint32_t w[9];
};

// Σ over block pair p of R staged rows (`rows`, `stride` bytes apart) against x (the pair's 64
// inputs): each block's inputs loaded once for the R rows.
template <int R>
__device__ __forceinline__ void rows_pair(const uint8_t* rows, int stride, int p, const float* x, float (&acc)[R]) {
  Pair pr[R];
#pragma unroll
  for (int r = 0; r < R; ++r)
#pragma unroll
    for (int i = 0; i < 9; ++i) pr[r].w[i] = reinterpret_cast<const uint32_t*>(rows + r * stride + p * 36)[i];
  float sa[R], sb[R];
#pragma unroll
  for (int r = 0; r < R; ++r) sa[r] = sb[r] = 0.f;
#pragma unroll
  for (int w = 0; w < 4; ++w) {
    const float4 al = *reinterpret_cast<const float4*>(x + 4 * w), ah = *reinterpret_cast<const float4*>(x + 16 + 4 * w);
    const float4 bl = *reinterpret_cast<const float4*>(x + 32 + 4 * w), bh = *reinterpret_cast<const float4*>(x + 48 + 4 * w);
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const uint32_t a = __funnelshift_r(pr[r].w[w], pr[r].w[w + 1], 16), b = pr[r].w[5 + w];
      const uint32_t alo = a & 0x0F0F0F0Fu, ahi = (a >> 4) & 0x0F0F0F0Fu, blo = b & 0x0F0F0F0Fu, bhi = (b >> 4) & 0x0F0F0F0Fu;
      sa[r] = fmaf(code(alo, 0), al.x, sa[r]);
      sa[r] = fmaf(code(alo, 1), al.y, sa[r]);
      sa[r] = fmaf(code(alo, 2), al.z, sa[r]);
      sa[r] = fmaf(code(alo, 3), al.w, sa[r]);
      sa[r] = fmaf(code(ahi, 0), ah.x, sa[r]);
      sa[r] = fmaf(code(ahi, 1), ah.y, sa[r]);
      sa[r] = fmaf(code(ahi, 2), ah.z, sa[r]);
      sa[r] = fmaf(code(ahi, 3), ah.w, sa[r]);
      sb[r] = fmaf(code(blo, 0), bl.x, sb[r]);
      sb[r] = fmaf(code(blo, 1), bl.y, sb[r]);
      sb[r] = fmaf(code(blo, 2), bl.z, sb[r]);
      sb[r] = fmaf(code(blo, 3), bl.w, sb[r]);
      sb[r] = fmaf(code(bhi, 0), bh.x, sb[r]);
      sb[r] = fmaf(code(bhi, 1), bh.y, sb[r]);
      sb[r] = fmaf(code(bhi, 2), bh.z, sb[r]);
      sb[r] = fmaf(code(bhi, 3), bh.w, sb[r]);
    }
  }
#pragma unroll
  for (int r = 0; r < R; ++r) acc[r] += half_bits(pr[r].w[0] & 0xFFFFu) * sa[r] + half_bits(pr[r].w[4] >> 16) * sb[r];
}

// A block of RC rows of F (gate and up) for one pair, copied in S stages of RC/S rows; warps
// take R rows at a time, lanes the rows' block pairs.
template <int RC, int R, int S>
__device__ void gate_up(const uint8_t* gate, const uint8_t* up, int64_t expert_stride, const __nv_bfloat16* x, const int32_t* ids,
                        const float* w, __nv_bfloat16* h, int F, int D, int K) {
  extern __shared__ __align__(16) uint8_t smem[];
  const int pr = blockIdx.y, t = pr / K, row0 = blockIdx.x * RC;
  const int rb = static_cast<int>(row_bytes(D)), cpr = rb / 16;
  const int64_t base = static_cast<int64_t>(ids[pr]) * expert_stride;
  const int n = min(RC, F - row0);
  constexpr int RS = RC / S;
#pragma unroll
  for (int st = 0; st < S; ++st) {
    for (int c = threadIdx.x; c < 2 * RS * cpr; c += blockDim.x) {  // [row][gate, up][16 bytes]
      const int r = st * RS + c / (2 * cpr), which = (c / cpr) & 1, j = c % cpr;
      if (r < n) cp_async16(smem + st * 2 * RS * rb + c * 16, (which ? up : gate) + base + static_cast<int64_t>(row0 + r) * rb + j * 16);
    }
    cp_async_commit();
  }
  float* xs = reinterpret_cast<float*>(smem + 2 * RC * rb);
  for (int i = threadIdx.x; i < D; i += blockDim.x) xs[padded(i)] = __bfloat162float(x[static_cast<int64_t>(t) * D + i]);
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp, warps = blockDim.x / kWarp;
  const float wp = w[pr];
#pragma unroll
  for (int st = 0; st < S; ++st) {
    wait_stage<S>(st);
    for (int r0 = st * RS + warp * R; r0 < min(n, (st + 1) * RS); r0 += warps * R) {
      float acc[2 * R];
#pragma unroll
      for (int r = 0; r < 2 * R; ++r) acc[r] = 0.f;
      for (int p = lane; p < D / 64; p += kWarp) rows_pair<2 * R>(smem + r0 * 2 * rb, rb, p, xs + p * (64 + kPad), acc);
#pragma unroll
      for (int r = 0; r < R; ++r) {
        const float gs = warp_sum(acc[2 * r]), us = warp_sum(acc[2 * r + 1]);
        if (lane == r && r0 + r < n) h[static_cast<int64_t>(pr) * F + row0 + r0 + r] = __float2bfloat16(wp != 0.f ? silu(gs) * us * wp : 0.f);
      }
    }
  }
}

// A block of RC rows of D for one token, each row's K experts' rows, copied in S stages of RC/S
// rows; warps take R rows at a time, lanes (pair, block pair) tasks.
template <int RC, int R, int S>
__device__ void down(const uint8_t* dn, int64_t expert_stride, const __nv_bfloat16* h, const int32_t* ids, __nv_bfloat16* y, int F, int D,
                     int K) {
  extern __shared__ __align__(16) uint8_t smem[];
  const int t = blockIdx.y, row0 = blockIdx.x * RC, nh = K * F;
  const int rb = static_cast<int>(row_bytes(F)), cpr = rb / 16;
  const int n = min(RC, D - row0);
  constexpr int RS = RC / S;
#pragma unroll
  for (int st = 0; st < S; ++st) {
    for (int c = threadIdx.x; c < K * RS * cpr; c += blockDim.x) {  // [row][k][16 bytes]
      const int r = st * RS + c / (K * cpr), k = (c / cpr) % K, j = c % cpr;
      if (r < n)
        cp_async16(smem + st * K * RS * rb + c * 16,
                   dn + static_cast<int64_t>(ids[t * K + k]) * expert_stride + static_cast<int64_t>(row0 + r) * rb + j * 16);
    }
    cp_async_commit();
  }
  float* hs = reinterpret_cast<float*>(smem + K * RC * rb);
  for (int i = threadIdx.x; i < nh; i += blockDim.x) hs[padded(i)] = __bfloat162float(h[static_cast<int64_t>(t) * nh + i]);
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp, warps = blockDim.x / kWarp;
  const int pairs = F / 64;
#pragma unroll
  for (int st = 0; st < S; ++st) {
    wait_stage<S>(st);
    for (int r0 = st * RS + warp * R; r0 < min(n, (st + 1) * RS); r0 += warps * R) {
      float acc[R];
#pragma unroll
      for (int r = 0; r < R; ++r) acc[r] = 0.f;
      for (int i = lane; i < K * pairs; i += kWarp) {  // row r0 + r of expert k: rows of one expert are K rows apart
        const int k = i / pairs, p = i - k * pairs;
        rows_pair<R>(smem + (r0 * K + k) * rb, K * rb, p, hs + i * (64 + kPad), acc);
      }
#pragma unroll
      for (int r = 0; r < R; ++r) {
        const float s = warp_sum(acc[r]);
        if (lane == r && r0 + r < n) y[static_cast<int64_t>(t) * D + row0 + r0 + r] = __float2bfloat16(s);
      }
    }
  }
}

}  // namespace ft_q4_0

using namespace ft_q4_0;

extern "C" __global__ void ft_q4_0_gate_up(const uint8_t* gate, const uint8_t* up, int64_t expert_stride, const __nv_bfloat16* x,
                                           const int32_t* ids, const float* w, __nv_bfloat16* h, int F, int D, int K) {
  gate_up<kGateUpRows, kGateUpR, kGateUpStages>(gate, up, expert_stride, x, ids, w, h, F, D, K);
}

extern "C" __global__ void ft_q4_0_down(const uint8_t* dn, int64_t expert_stride, const __nv_bfloat16* h, const int32_t* ids,
                                        __nv_bfloat16* y, int F, int D, int K) {
  down<kDownRows, kDownR, kDownStages>(dn, expert_stride, h, ids, y, F, D, K);
}
