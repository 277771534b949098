// Decode's routed experts over q4_0 banks in two CUDA kernels, outside XLA's reduction emitter.
//
// A q4_0 block is 18 bytes: an f16 scale d, then 16 bytes whose byte j holds code q[j] in its low
// nibble and q[j + 16] in its high one; weight = d·(q − 8) (GGUF Q4_0). A row of I inputs is
// I/32 blocks. A warp takes R rows; its lanes take the rows' pairs of blocks (36 bytes, nine
// aligned 32-bit loads straight from global memory: the first block's scale is the low half of
// word 0, its codes words 0-4 shifted by two bytes, the second's scale the high half of word 4,
// its codes words 5-8) against the inputs staged in shared memory as float32. A code becomes a
// float by its bits: the byte set into the mantissa of 2^23 (one byte permute), minus 2^23 + 8
// (one add), exact.
//
//   ft_q4_0_gate_up: grid (F / kGateUpRows, pairs T·K); the pair's gate and up rows against x_t:
//     h[p, f] = round(w[p] · silu(gate_f · x_t) · (up_f · x_t)) to bfloat16, exactly 0 where
//     w[p] is 0 (as models/routed._gathered rounds it);
//   ft_q4_0_down: grid (D / kDownRows, tokens T); the token's K pairs' down rows against their h:
//     y[t, d] = Σ_k down_k,d · h[t·K + k] in float32, rounded to bfloat16;
//   ft_q4_0_moe: both in one kernel, one block an SM (grid: the SM count, so that every block is
//     resident at once): the blocks' warps take gate/up rows over all pairs, writing h (a scratch
//     buffer), then wait for each other at a grid-wide barrier and take down rows. Each block
//     first asks L2 for the down rows it will take, so that they load while gate and up compute;
//     a layer costs one launch, its ramp and its tail, not two. The barrier counts arrivals on a
//     64-bit counter of the module that only grows (a launch's blocks wait for the next multiple
//     of the grid): launches of it must not run concurrently (one stream, as XLA's step runs).
//
// gate, up and down point at expert 0 of a bank whose experts are `expert_stride` bytes apart
// (slots may be wider than one layer's matrix: an expert's matrix is its row's first bytes). x
// and h are staged with kPad floats of padding after every 64 so that the lanes' 16-byte reads of
// their block pairs fall in distinct banks. F and D multiples of 256 and strides of a multiple of
// 16 bytes only: the caller checks (freetoken_jax/runtime/cuda_experts.py).
//
// (Copying each block's rows whole into shared memory first, every load a full line, was no
// faster on an H100, and its down kernel 2.7 × slower; the gate/up kernel asking L2 for the down
// rows ahead made the pair slower: benchmarks/RESULTS.md.)
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

struct Pair {
  uint32_t w[9];
};

__device__ __forceinline__ Pair load_pair(const uint8_t* p) {
  const uint32_t* q = reinterpret_cast<const uint32_t*>(p);
  Pair r;
#pragma unroll
  for (int i = 0; i < 9; ++i) r.w[i] = __ldg(q + i);
  return r;
}

// Σ over a block's 32 codes (four words of byte pairs) against its 32 inputs.
__device__ __forceinline__ float block_dot(const uint32_t (&c)[4], const float* x) {
  float s0 = 0.f, s1 = 0.f;
#pragma unroll
  for (int w = 0; w < 4; ++w) {
    const uint32_t lo = c[w] & 0x0F0F0F0Fu, hi = (c[w] >> 4) & 0x0F0F0F0Fu;
    const float4 xl = *reinterpret_cast<const float4*>(x + 4 * w);
    const float4 xh = *reinterpret_cast<const float4*>(x + 16 + 4 * w);
    s0 = fmaf(code(lo, 0), xl.x, s0);
    s1 = fmaf(code(lo, 1), xl.y, s1);
    s0 = fmaf(code(lo, 2), xl.z, s0);
    s1 = fmaf(code(lo, 3), xl.w, s1);
    s0 = fmaf(code(hi, 0), xh.x, s0);
    s1 = fmaf(code(hi, 1), xh.y, s1);
    s0 = fmaf(code(hi, 2), xh.z, s0);
    s1 = fmaf(code(hi, 3), xh.w, s1);
  }
  return s0 + s1;
}

// A pair of blocks against its 64 inputs.
__device__ __forceinline__ float pair_dot(const Pair& p, const float* x) {
  const uint32_t a[4] = {__funnelshift_r(p.w[0], p.w[1], 16), __funnelshift_r(p.w[1], p.w[2], 16), __funnelshift_r(p.w[2], p.w[3], 16),
                         __funnelshift_r(p.w[3], p.w[4], 16)};
  const uint32_t b[4] = {p.w[5], p.w[6], p.w[7], p.w[8]};
  return half_bits(p.w[0] & 0xFFFFu) * block_dot(a, x) + half_bits(p.w[4] >> 16) * block_dot(b, x + 32);
}

// R consecutive gate and up rows (`rb` bytes apart, from g and u) against staged x, summed over
// the warp: its lanes take the rows' block pairs.
template <int R>
__device__ __forceinline__ void gate_up_rows(const uint8_t* g, const uint8_t* u, int64_t rb, int D, const float* xs, float (&gs)[R],
                                             float (&us)[R]) {
  const int lane = threadIdx.x % kWarp;
#pragma unroll
  for (int r = 0; r < R; ++r) gs[r] = us[r] = 0.f;
  for (int p = lane; p < D / 64; p += kWarp) {
    Pair pg[R], pu[R];
#pragma unroll
    for (int r = 0; r < R; ++r) {
      pg[r] = load_pair(g + r * rb + p * 36);
      pu[r] = load_pair(u + r * rb + p * 36);
    }
#pragma unroll
    for (int r = 0; r < R; ++r) {
      gs[r] += pair_dot(pg[r], xs + p * (64 + kPad));
      us[r] += pair_dot(pu[r], xs + p * (64 + kPad));
    }
  }
#pragma unroll
  for (int r = 0; r < R; ++r) gs[r] = warp_sum(gs[r]), us[r] = warp_sum(us[r]);
}

// A warp's R rows of F (gate and up) for one pair, its lanes the rows' block pairs.
template <int R>
__device__ void gate_up(const uint8_t* gate, const uint8_t* up, int64_t expert_stride, const __nv_bfloat16* x, const int32_t* ids,
                        const float* w, __nv_bfloat16* h, int F, int D, int K) {
  extern __shared__ __align__(16) float xs[];
  const int pr = blockIdx.y, t = pr / K;
  for (int i = threadIdx.x; i < D; i += blockDim.x) xs[padded(i)] = __bfloat162float(x[static_cast<int64_t>(t) * D + i]);
  __syncthreads();
  const int64_t rb = row_bytes(D);
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  const int row0 = (blockIdx.x * (blockDim.x / kWarp) + warp) * R;  // F is a multiple of a block's rows: the caller checks
  const int64_t at = static_cast<int64_t>(ids[pr]) * expert_stride + row0 * rb;
  float gs[R], us[R];
  gate_up_rows<R>(gate + at, up + at, rb, D, xs, gs, us);
  const float wp = w[pr];
#pragma unroll
  for (int r = 0; r < R; ++r)
    if (lane == r) h[static_cast<int64_t>(pr) * F + row0 + r] = __float2bfloat16(wp != 0.f ? silu(gs[r]) * us[r] * wp : 0.f);
}

// A warp's R rows of D for one token, its lanes (pair, block pair) tasks over the K pairs' rows.
template <int R>
__device__ void down(const uint8_t* dn, int64_t expert_stride, const __nv_bfloat16* h, const int32_t* ids, __nv_bfloat16* y, int F, int D,
                     int K) {
  extern __shared__ __align__(16) float hs[];
  const int t = blockIdx.y, n = K * F;
  for (int i = threadIdx.x; i < n; i += blockDim.x) hs[padded(i)] = __bfloat162float(h[static_cast<int64_t>(t) * n + i]);
  __syncthreads();
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  const int row0 = (blockIdx.x * (blockDim.x / kWarp) + warp) * R;
  const int64_t rb = row_bytes(F);
  const int pairs = F / 64, tasks = K * pairs;
  float acc[R];
#pragma unroll
  for (int r = 0; r < R; ++r) acc[r] = 0.f;
  for (int i = lane; i < tasks; i += kWarp) {
    const int k = i / pairs, p = i - k * pairs;
    const int64_t base = static_cast<int64_t>(ids[t * K + k]) * expert_stride + p * 36;
    Pair pd[R];
#pragma unroll
    for (int r = 0; r < R; ++r) pd[r] = load_pair(dn + base + min(row0 + r, D - 1) * rb);
#pragma unroll
    for (int r = 0; r < R; ++r) acc[r] += pair_dot(pd[r], hs + i * (64 + kPad));
  }
#pragma unroll
  for (int r = 0; r < R; ++r) {
    const float s = warp_sum(acc[r]);
    if (lane == r && row0 + r < D) y[static_cast<int64_t>(t) * D + row0 + r] = __float2bfloat16(s);
  }
}

__device__ unsigned long long moe_arrivals;  // ft_q4_0_moe's barrier: arrivals since the module loaded

// Every block of the grid reaches this point (all resident: one block an SM) before any goes on;
// what the blocks wrote before it is visible to all after it.
__device__ __forceinline__ void grid_barrier() {
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    const unsigned long long g = gridDim.x, ticket = atomicAdd(&moe_arrivals, 1ull), target = (ticket / g + 1) * g;
    while (*reinterpret_cast<volatile unsigned long long*>(&moe_arrivals) < target) __nanosleep(64);
    __threadfence();
  }
  __syncthreads();
}

template <int R>
__device__ void moe(const uint8_t* gate, const uint8_t* up, int64_t expert_stride, const uint8_t* dn, int64_t dn_stride,
                    const __nv_bfloat16* x, const int32_t* ids, const float* w, __nv_bfloat16* h, __nv_bfloat16* y, int T, int F, int D,
                    int K) {
  extern __shared__ __align__(16) float xs[];
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp, warps = blockDim.x / kWarp;
  const int rows_d = (D + gridDim.x - 1) / gridDim.x, d0 = blockIdx.x * rows_d, nd = max(0, min(rows_d, D - d0));
  const int64_t rbf = row_bytes(F), rbd = row_bytes(D);
  // the down rows this block takes after the barrier, asked of L2 now: (token, pair) spans of nd rows
  for (int i = threadIdx.x; i < T * K * ((nd * rbf + 127) / 128); i += blockDim.x) {
    const int per = static_cast<int>((nd * rbf + 127) / 128), tk = i / per, line = i - tk * per;
    asm volatile("prefetch.global.L2::evict_last [%0];" ::"l"(dn + static_cast<int64_t>(ids[tk]) * dn_stride + d0 * rbf + line * 128));
  }
  const int64_t xstride = padded_floats(D);
  for (int i = threadIdx.x; i < T * D; i += blockDim.x) xs[(i / D) * xstride + padded(i % D)] = __bfloat162float(x[i]);
  __syncthreads();
  // gate and up: R rows of one pair a warp's pass, over every pair's F rows
  const int passes = T * K * (F / R);
  for (int q = blockIdx.x * warps + warp; q < passes; q += gridDim.x * warps) {
    const int pr = q / (F / R), f0 = (q - pr * (F / R)) * R;
    const float wp = w[pr];
    if (wp == 0.f) {  // an unrouted pair: its h is exactly 0, its rows unread
      if (lane < R) h[static_cast<int64_t>(pr) * F + f0 + lane] = __float2bfloat16(0.f);
      continue;
    }
    const int64_t at = static_cast<int64_t>(ids[pr]) * expert_stride + f0 * rbd;
    float gs[R], us[R];
    gate_up_rows<R>(gate + at, up + at, rbd, D, xs + (pr / K) * xstride, gs, us);
#pragma unroll
    for (int r = 0; r < R; ++r)
      if (lane == r) h[static_cast<int64_t>(pr) * F + f0 + r] = __float2bfloat16(silu(gs[r]) * us[r] * wp);
  }
  grid_barrier();
  // down: the block's nd rows of D for each token, a warp a row, lanes (pair, block pair) tasks
  const int pairs = F / 64, tasks = K * pairs;
  for (int t = 0; t < T; ++t) {
    __syncthreads();  // the previous token's h (or x) is no longer read
    for (int i = threadIdx.x; i < K * F; i += blockDim.x) xs[padded(i)] = __bfloat162float(__ldcg(h + static_cast<int64_t>(t) * K * F + i));
    __syncthreads();
    for (int r = warp; r < nd; r += warps) {
      float acc = 0.f;
      for (int i = lane; i < tasks; i += kWarp) {
        const int k = i / pairs, p = i - k * pairs;
        acc += pair_dot(load_pair(dn + static_cast<int64_t>(ids[t * K + k]) * dn_stride + (d0 + r) * rbf + p * 36), xs + i * (64 + kPad));
      }
      acc = warp_sum(acc);
      if (lane == 0) y[static_cast<int64_t>(t) * D + d0 + r] = __float2bfloat16(acc);
    }
  }
}

}  // namespace ft_q4_0

using namespace ft_q4_0;

extern "C" __global__ void ft_q4_0_gate_up(const uint8_t* gate, const uint8_t* up, int64_t expert_stride, const __nv_bfloat16* x,
                                           const int32_t* ids, const float* w, __nv_bfloat16* h, int F, int D, int K) {
  gate_up<kGateUpR>(gate, up, expert_stride, x, ids, w, h, F, D, K);
}

extern "C" __global__ void ft_q4_0_down(const uint8_t* dn, int64_t expert_stride, const __nv_bfloat16* h, const int32_t* ids,
                                        __nv_bfloat16* y, int F, int D, int K) {
  down<kDownR>(dn, expert_stride, h, ids, y, F, D, K);
}

extern "C" __global__ void ft_q4_0_moe(const uint8_t* gate, const uint8_t* up, int64_t expert_stride, const uint8_t* dn, int64_t dn_stride,
                                       const __nv_bfloat16* x, const int32_t* ids, const float* w, __nv_bfloat16* h, __nv_bfloat16* y, int T,
                                       int F, int D, int K) {
  moe<kMoeR>(gate, up, expert_stride, dn, dn_stride, x, ids, w, h, y, T, F, D, K);
}
