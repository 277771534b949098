// Times the q4_0 decode expert kernels of cpu_ext/cuda/q4_0_experts.cu by themselves (no JAX):
// `steps` layers of one token's K experts, recorded in one CUDA graph, each layer's experts the
// next K of the bank (so that they come from HBM, not L2), as benchmarks/bench_expert_kernels.py
// runs XLA's: the shipped kernels (two launches a layer, and one: ft_q4_0_moe), their templates at
// other rows a warp and warps, gate_up asking L2 for the down rows ahead, kernels of integer dot
// products over inputs quantized to 8 bits (not yet timed on a GPU), and read floors (the same bytes read by the same grid,
// 16-byte loads, nothing computed). Each gate_up kernel alone, each down kernel alone, then pairs;
// µs a layer and GB/s of the q4_0 bytes read. First checks every kernel's layer 0 against a
// float64 reference on the host (h within bfloat16's rounding, y of the kernel's own h).
//
//   nvcc -O3 -arch=sm_90 -o /tmp/bench_q4 benchmarks/cuda/bench_q4_0_experts.cu && /tmp/bench_q4 [steps]
#include <cuda_runtime.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "../../cpu_ext/cuda/q4_0_experts.cu"

// Other rows a warp (the warps a block come from the launch).
template <int R>
__global__ void gate_up_r(const uint8_t* gate, const uint8_t* up, int64_t es, const __nv_bfloat16* x, const int32_t* ids, const float* w,
                          __nv_bfloat16* h, int F, int D, int K, const uint8_t* dn, int64_t dn_stride) {
  if (dn) {  // ask L2 for this block's share of the pair's down rows (one 128-byte line a thread), without waiting
    const int64_t bytes = static_cast<int64_t>(D) * row_bytes(F), share = (bytes + gridDim.x - 1) / gridDim.x;
    const uint8_t* b = dn + static_cast<int64_t>(ids[blockIdx.y]) * dn_stride;
    for (int64_t i = blockIdx.x * share + threadIdx.x * 128; i < min(static_cast<int64_t>(blockIdx.x + 1) * share, bytes); i += blockDim.x * 128)
      asm volatile("prefetch.global.L2::evict_last [%0];" ::"l"(b + i));
  }
  gate_up<R>(gate, up, es, x, ids, w, h, F, D, K);
}
__global__ void gate_up_shipped(const uint8_t* gate, const uint8_t* up, int64_t es, const __nv_bfloat16* x, const int32_t* ids, const float* w,
                                __nv_bfloat16* h, int F, int D, int K, const uint8_t*, int64_t) {
  gate_up<ft_q4_0::kGateUpR>(gate, up, es, x, ids, w, h, F, D, K);  // ft_q4_0_gate_up's body, in the benchmark's signature
}
template <int R>
__global__ void down_r(const uint8_t* dn, int64_t es, const __nv_bfloat16* h, const int32_t* ids, __nv_bfloat16* y, int F, int D, int K) {
  down<R>(dn, es, h, ids, y, F, D, K);
}

template <int R>
__global__ void moe_r(const uint8_t* gate, const uint8_t* up, int64_t es, const uint8_t* dn, int64_t dn_stride, const __nv_bfloat16* x,
                      const int32_t* ids, const float* w, __nv_bfloat16* h, __nv_bfloat16* y, int T, int F, int D, int K) {
  moe<R>(gate, up, es, dn, dn_stride, x, ids, w, h, y, T, F, D, K);
}


// Integer dot products: the inputs (x, or a token's h) quantized per 32 to int8 with a float scale
// (and the codes' sum), as llama.cpp's q8_1 and the engine's CPU executor take them; a block of
// 32 q4_0 weights is then 8 __dp4a over its bytes' nibbles: Σ w·x = d_w·d_x·(Σ q·q_x − 8·Σ q_x).
// Not exact: x's rounding to 8 bits (the checks allow it, and print the error).
constexpr int kQ8Stride = 17;  // int32 words a pair of blocks takes in shared memory (16 and a pad)
struct Q8 {
  int32_t* q;      // [pairs][kQ8Stride] words of 4 codes
  float2* ds;      // [blocks]: scale, scale × the codes' sum
};
__device__ __forceinline__ Q8 q8_of(void* smem, int n) {
  return Q8{reinterpret_cast<int32_t*>(smem), reinterpret_cast<float2*>(reinterpret_cast<int32_t*>(smem) + n / 64 * kQ8Stride)};
}
// Quantizes v[0..n) into the block's shared memory, a warp a block of 32 at a time.
__device__ void q8_stage(const __nv_bfloat16* v, int n, Q8 o) {
  const int lane = threadIdx.x % 32;
  for (int b = threadIdx.x / 32; b < n / 32; b += blockDim.x / 32) {
    const float x = __bfloat162float(v[b * 32 + lane]);
    float m = fabsf(x);
#pragma unroll
    for (int s = 16; s; s >>= 1) m = fmaxf(m, __shfl_xor_sync(0xFFFFFFFFu, m, s));
    const float d = m / 127.f;
    const int q = d > 0.f ? __float2int_rn(x / d) : 0;
    int sum = q;
#pragma unroll
    for (int s = 16; s; s >>= 1) sum += __shfl_xor_sync(0xFFFFFFFFu, sum, s);
    reinterpret_cast<int8_t*>(o.q + (b / 2) * kQ8Stride)[(b % 2) * 32 + lane] = static_cast<int8_t>(q);
    if (lane == 0) o.ds[b] = make_float2(d, d * sum);
  }
}
// A block's 32 weights (four words of nibble pairs) against its quantized inputs (8 words) as int.
__device__ __forceinline__ int block_idot(const uint32_t (&c)[4], const int32_t* q) {
  int s = 0;
#pragma unroll
  for (int w = 0; w < 4; ++w) {
    s = __dp4a(static_cast<int>(c[w] & 0x0F0F0F0Fu), q[w], s);
    s = __dp4a(static_cast<int>((c[w] >> 4) & 0x0F0F0F0Fu), q[4 + w], s);
  }
  return s;
}
// A pair of blocks (block index 2p, 2p + 1 of the inputs) against the quantized inputs.
__device__ __forceinline__ float pair_idot(const Pair& p, const Q8& x, int pair) {
  const uint32_t a[4] = {__funnelshift_r(p.w[0], p.w[1], 16), __funnelshift_r(p.w[1], p.w[2], 16), __funnelshift_r(p.w[2], p.w[3], 16),
                         __funnelshift_r(p.w[3], p.w[4], 16)};
  const uint32_t b[4] = {p.w[5], p.w[6], p.w[7], p.w[8]};
  const int32_t* q = x.q + pair * kQ8Stride;
  const float2 da = x.ds[2 * pair], db = x.ds[2 * pair + 1];
  return half_bits(p.w[0] & 0xFFFFu) * (da.x * block_idot(a, q) - 8.f * da.y) +
         half_bits(p.w[4] >> 16) * (db.x * block_idot(b, q + 8) - 8.f * db.y);
}
template <int R>
__global__ void gate_up_q8(const uint8_t* gate, const uint8_t* up, int64_t es, const __nv_bfloat16* x, const int32_t* ids, const float* w,
                           __nv_bfloat16* h, int F, int D, int K, const uint8_t*, int64_t) {
  extern __shared__ __align__(16) int32_t smem_q8[];
  const int pr = blockIdx.y, t = pr / K, lane = threadIdx.x % 32;
  const Q8 xq = q8_of(smem_q8, D);
  q8_stage(x + static_cast<int64_t>(t) * D, D, xq);
  __syncthreads();
  const int64_t rb = row_bytes(D);
  const int row0 = (blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32) * R;
  const int64_t at = static_cast<int64_t>(ids[pr]) * es + row0 * rb;
  float gs[R], us[R];
#pragma unroll
  for (int r = 0; r < R; ++r) gs[r] = us[r] = 0.f;
  for (int p = lane; p < D / 64; p += 32) {
    Pair pg[R], pu[R];
#pragma unroll
    for (int r = 0; r < R; ++r) pg[r] = load_pair(gate + at + r * rb + p * 36), pu[r] = load_pair(up + at + r * rb + p * 36);
#pragma unroll
    for (int r = 0; r < R; ++r) gs[r] += pair_idot(pg[r], xq, p), us[r] += pair_idot(pu[r], xq, p);
  }
  const float wp = w[pr];
#pragma unroll
  for (int r = 0; r < R; ++r) {
    const float g = warp_sum(gs[r]), u = warp_sum(us[r]);
    if (lane == r) h[static_cast<int64_t>(pr) * F + row0 + r] = __float2bfloat16(wp != 0.f ? silu(g) * u * wp : 0.f);
  }
}
__global__ void down_q8(const uint8_t* dn, int64_t es, const __nv_bfloat16* h, const int32_t* ids, __nv_bfloat16* y, int F, int D, int K) {
  extern __shared__ __align__(16) int32_t smem_q8[];
  const int t = blockIdx.y, lane = threadIdx.x % 32, n = K * F, pairs = F / 64;
  const Q8 hq = q8_of(smem_q8, n);
  q8_stage(h + static_cast<int64_t>(t) * n, n, hq);
  __syncthreads();
  const int row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
  const int64_t rb = row_bytes(F);
  float acc = 0.f;
  for (int i = lane; i < K * pairs; i += 32) {
    const int k = i / pairs, p = i - k * pairs;
    acc += pair_idot(load_pair(dn + static_cast<int64_t>(ids[t * K + k]) * es + row * rb + p * 36), hq, i);
  }
  acc = warp_sum(acc);
  if (lane == 0) y[static_cast<int64_t>(t) * D + row] = __float2bfloat16(acc);
}

// The read floors: a warp a row (of gate and up, or of the K pairs' down rows), 16-byte loads,
// consecutive lanes consecutive bytes; nothing computed but a xor (written only where it is
// 0x5A5A5A5A, so that the loads stay).
__device__ __forceinline__ uint32_t read_row(const uint8_t* row, int64_t bytes) {
  uint32_t a = 0;
  for (int64_t i = (threadIdx.x % 32) * 16; i < bytes; i += 32 * 16) {
    const uint4 v = __ldg(reinterpret_cast<const uint4*>(row + i));
    a ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  return a;
}
__global__ void read_gate_up(const uint8_t* gate, const uint8_t* up, int64_t es, const __nv_bfloat16*, const int32_t* ids, const float*,
                             __nv_bfloat16* h, int F, int D, int, const uint8_t*, int64_t) {
  const int row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
  const int64_t rb = row_bytes(D), at = static_cast<int64_t>(ids[blockIdx.y]) * es + row * rb;
  if ((read_row(gate + at, rb) ^ read_row(up + at, rb)) == 0x5A5A5A5Au) h[blockIdx.y * F + row] = __float2bfloat16(1.f);
}
__global__ void read_down(const uint8_t* dn, int64_t es, const __nv_bfloat16*, const int32_t* ids, __nv_bfloat16* y, int F, int D, int K) {
  const int row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
  const int64_t rb = row_bytes(F);
  uint32_t a = 0;
  for (int k = 0; k < K; ++k) a ^= read_row(dn + static_cast<int64_t>(ids[blockIdx.y * K + k]) * es + row * rb, rb);
  if (a == 0x5A5A5A5Au) y[blockIdx.y * D + row] = __float2bfloat16(1.f);
}

#define CK(x)                                                                          \
  do {                                                                                 \
    cudaError_t e = (x);                                                               \
    if (e != cudaSuccess) {                                                            \
      std::printf("%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e));   \
      std::exit(1);                                                                    \
    }                                                                                  \
  } while (0)

__device__ uint32_t mix(uint64_t i) {
  i ^= i >> 33;
  i *= 0xff51afd7ed558ccdull;
  i ^= i >> 33;
  i *= 0xc4ceb9fe1a85ec53ull;
  i ^= i >> 33;
  return static_cast<uint32_t>(i);
}

// Random codes, and every block's scale a finite f16 of magnitude 0.002-0.01, either sign.
__global__ void fill(uint8_t* b, int64_t blocks, uint64_t seed) {
  for (int64_t k = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; k < blocks; k += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    uint8_t* p = b + k * 18;
    const uint32_t r = mix(seed * 0x9E3779B97F4A7C15ull + k);
    const float d = (0.002f + 0.008f * (r & 0xFFFF) / 65535.f) * ((r >> 16) & 1 ? -1.f : 1.f);
    const __half hd = __float2half(d);
    const unsigned short s = __half_as_ushort(hd);
    p[0] = s & 0xFF;
    p[1] = s >> 8;
    for (int j = 0; j < 16; ++j) p[2 + j] = mix(seed * 31 + k * 16 + j) & 0xFF;
  }
}

static double f16(const uint8_t* p) {
  const unsigned short s = p[0] | (p[1] << 8);
  const int e = (s >> 10) & 31, m = s & 1023;
  const double v = e ? std::ldexp(1.0 + m / 1024.0, e - 15) : std::ldexp(m / 1024.0, -14);
  return s >> 15 ? -v : v;
}

static double bf(const __nv_bfloat16& v) {
  unsigned short s;
  std::memcpy(&s, &v, 2);
  uint32_t u = static_cast<uint32_t>(s) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// Row o of a q4_0 [O, I] matrix at `m` times x, in float64.
static double row_dot(const uint8_t* m, int o, int I, const double* x) {
  const uint8_t* r = m + static_cast<int64_t>(o) * (I / 32) * 18;
  double s = 0;
  for (int b = 0; b < I / 32; ++b) {
    const double d = f16(r + b * 18);
    for (int j = 0; j < 16; ++j) {
      const int q = r[b * 18 + 2 + j];
      s += d * ((q & 15) - 8) * x[b * 32 + j] + d * ((q >> 4) - 8) * x[b * 32 + j + 16];
    }
  }
  return s;
}

using GateUp = void (*)(const uint8_t*, const uint8_t*, int64_t, const __nv_bfloat16*, const int32_t*, const float*, __nv_bfloat16*, int,
                        int, int, const uint8_t*, int64_t);
using Moe = void (*)(const uint8_t*, const uint8_t*, int64_t, const uint8_t*, int64_t, const __nv_bfloat16*, const int32_t*, const float*,
                     __nv_bfloat16*, __nv_bfloat16*, int, int, int, int);
using Down = void (*)(const uint8_t*, int64_t, const __nv_bfloat16*, const int32_t*, __nv_bfloat16*, int, int, int);

struct Kernel {
  const char* name;
  void* fn;
  int rows_per_block;  // rows of F (gate_up) or D (down) a block
  int warps;
  bool check = true;  // computes h or y (the read floors do not)
  bool pf = false;    // gate_up: asks L2 for the down rows
  bool moe = false;   // the one-kernel layer (gate, up and down; no down kernel after it)
  bool q8 = false;    // int8 inputs: checked within their rounding (less shared memory than the float32 inputs given)
};

int main(int argc, char** argv) {
  const int E = 128, K = 8, F = 768, D = 2048, steps = argc > 1 ? std::atoi(argv[1]) : 64;
  const int64_t gu_bytes = static_cast<int64_t>(F) * (D / 32) * 18, dn_bytes = static_cast<int64_t>(D) * (F / 32) * 18;
  uint8_t *gate, *up, *dn;
  CK(cudaMalloc(&gate, E * gu_bytes));
  CK(cudaMalloc(&up, E * gu_bytes));
  CK(cudaMalloc(&dn, E * dn_bytes));
  fill<<<1024, 256>>>(gate, E * gu_bytes / 18, 1);
  fill<<<1024, 256>>>(up, E * gu_bytes / 18, 2);
  fill<<<1024, 256>>>(dn, E * dn_bytes / 18, 3);
  std::vector<__nv_bfloat16> xh(D);
  std::vector<double> xd(D);
  for (int i = 0; i < D; ++i) {
    xh[i] = __float2bfloat16(std::sin(0.37 * i) + 0.25 * std::cos(1.3 * i));
    xd[i] = bf(xh[i]);
  }
  std::vector<int32_t> ids(steps * K);
  std::vector<float> w(steps * K);
  for (int s = 0; s < steps; ++s)
    for (int k = 0; k < K; ++k) {
      ids[s * K + k] = (s * K + k) % E;
      w[s * K + k] = k == 5 ? 0.f : 0.05f + 0.02f * k;  // one unrouted pair
    }
  __nv_bfloat16 *x, *h, *y;
  int32_t* idd;
  float* wd;
  CK(cudaMalloc(&x, D * 2));
  CK(cudaMalloc(&h, K * F * 2));
  CK(cudaMalloc(&y, D * 2));
  CK(cudaMalloc(&idd, ids.size() * 4));
  CK(cudaMalloc(&wd, w.size() * 4));
  CK(cudaMemcpy(x, xh.data(), D * 2, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(idd, ids.data(), ids.size() * 4, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(wd, w.data(), w.size() * 4, cudaMemcpyHostToDevice));
  const Kernel gus[] = {
      {"gate_up shipped", (void*)gate_up_shipped, ft_q4_0::kGateUpRows, ft_q4_0::kGateUpWarps},
      {"gate_up R1 W8 + down to L2", (void*)gate_up_r<1>, 8, 8, true, true},
      {"gate_up R1 W8", (void*)gate_up_r<1>, 8, 8},
      {"gate_up R2 W8", (void*)gate_up_r<2>, 16, 8},
      {"gate_up R1 W4", (void*)gate_up_r<1>, 4, 4},
      {"gate_up read floor W8", (void*)read_gate_up, 8, 8, false},
      {"gate_up q8 dp4a R4 W4", (void*)gate_up_q8<4>, 16, 4, true, false, false, true},
      {"gate_up q8 dp4a R1 W8", (void*)gate_up_q8<1>, 8, 8, true, false, false, true},
      {"moe shipped: one kernel a layer", (void*)ft_q4_0_moe, 0, ft_q4_0::kMoeWarps, true, false, true},
      {"moe R2 W8", (void*)moe_r<2>, 0, 8, true, false, true},
      {"moe R1 W16", (void*)moe_r<1>, 0, 16, true, false, true},
      {"moe R2 W16", (void*)moe_r<2>, 0, 16, true, false, true},
  };
  const Kernel dns[] = {
      {"down shipped", (void*)ft_q4_0_down, ft_q4_0::kDownRows, ft_q4_0::kDownWarps},
      {"down R2 W4", (void*)down_r<2>, 8, 4},
      {"down R1 W8", (void*)down_r<1>, 8, 8},
      {"down R1 W4", (void*)down_r<1>, 4, 4},
      {"down read floor W8", (void*)read_down, 8, 8, false},
      {"down q8 dp4a W16", (void*)down_q8, 16, 16, true, false, false, true},
      {"down q8 dp4a W8", (void*)down_q8, 8, 8, true, false, false, true},
  };
  auto smem_of = [&](bool gu) -> size_t { return gu ? ft_q4_0::gate_up_smem(D) : ft_q4_0::down_smem(F, K); };
  int sms = 0;
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));

  for (const Kernel& k : gus)
    CK(cudaFuncSetAttribute(k.fn, cudaFuncAttributeMaxDynamicSharedMemorySize, k.moe ? ft_q4_0::moe_smem(1, F, D, K) : smem_of(true)));
  for (const Kernel& k : dns) CK(cudaFuncSetAttribute(k.fn, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_of(false)));
  auto launch = [&](const Kernel* gk, const Kernel* dk, cudaStream_t st, int s) {
    if (gk && gk->moe) {
      reinterpret_cast<Moe>(gk->fn)<<<sms, gk->warps * 32, ft_q4_0::moe_smem(1, F, D, K), st>>>(gate, up, gu_bytes, dn, dn_bytes, x, idd + s * K,
                                                                                               wd + s * K, h, y, 1, F, D, K);
      return;
    }
    if (gk) {
      const dim3 grid((F + gk->rows_per_block - 1) / gk->rows_per_block, K);
      reinterpret_cast<GateUp>(gk->fn)<<<grid, gk->warps * 32, smem_of(true), st>>>(gate, up, gu_bytes, x, idd + s * K, wd + s * K, h, F, D, K,
                                                                                  gk->pf ? dn : nullptr, dn_bytes);
    }
    if (dk) {
      const dim3 grid((D + dk->rows_per_block - 1) / dk->rows_per_block, 1);
      reinterpret_cast<Down>(dk->fn)<<<grid, dk->warps * 32, smem_of(false), st>>>(dn, dn_bytes, h, idd + s * K, y, F, D, K);
    }
  };


  // Correctness: layer 0 against float64 on the host, every kernel (gate_up ones with the first
  // down, down ones after the first gate_up).
  std::vector<uint8_t> g0(K * gu_bytes), u0(K * gu_bytes), d0(K * dn_bytes);
  for (int k = 0; k < K; ++k) {
    CK(cudaMemcpy(g0.data() + k * gu_bytes, gate + ids[k] * gu_bytes, gu_bytes, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(u0.data() + k * gu_bytes, up + ids[k] * gu_bytes, gu_bytes, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(d0.data() + k * dn_bytes, dn + ids[k] * dn_bytes, dn_bytes, cudaMemcpyDeviceToHost));
  }
  std::vector<double> href(K * F);
  double hmax = 0;
  for (int k = 0; k < K; ++k)
    for (int f = 0; f < F; ++f) {
      const double g = row_dot(g0.data() + k * gu_bytes, f, D, xd.data()), u = row_dot(u0.data() + k * gu_bytes, f, D, xd.data());
      href[k * F + f] = w[k] * g / (1 + std::exp(-g)) * u;
      hmax = std::fmax(hmax, std::fabs(href[k * F + f]));
    }
  bool ok = true;
  const int nchecks = sizeof(gus) / sizeof(gus[0]) + sizeof(dns) / sizeof(dns[0]);
  for (int c = 0; c < nchecks; ++c) {
    const int ng = sizeof(gus) / sizeof(gus[0]);
    const Kernel* gk = c < ng ? &gus[c] : &gus[0];
    const Kernel* dk = c < ng ? &dns[0] : &dns[c - ng];
    if (!gk->check || !dk->check) continue;
    CK(cudaMemset(h, 0xFF, K * F * 2));
    CK(cudaMemset(y, 0xFF, D * 2));
    launch(gk, dk, 0, 0);
    CK(cudaDeviceSynchronize());
    std::vector<__nv_bfloat16> hk(K * F), yk(D);
    CK(cudaMemcpy(hk.data(), h, K * F * 2, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(yk.data(), y, D * 2, cudaMemcpyDeviceToHost));
    double herr = 0, yerr = 0, ymax = 0;
    std::vector<double> hkd(K * F);
    for (int i = 0; i < K * F; ++i) {
      hkd[i] = bf(hk[i]);
      const double e = std::fabs(hkd[i] - href[i]) - std::fabs(href[i]) / 256;  // beyond bfloat16's rounding
      herr = std::fmax(herr, std::isfinite(hkd[i]) ? e / hmax : 1e9);
      if (w[i / F] == 0 && hkd[i] != 0) herr = 1e9;
    }
    std::vector<double> yref(D, 0.0);
    for (int o = 0; o < D; ++o) {
      for (int k = 0; k < K; ++k) yref[o] += row_dot(d0.data() + k * dn_bytes, o, F, hkd.data() + k * F);
      ymax = std::fmax(ymax, std::fabs(yref[o]));
    }
    for (int o = 0; o < D; ++o) {
      const double e = (std::fabs(bf(yk[o]) - yref[o]) - std::fabs(yref[o]) / 256) / ymax;
      yerr = std::fmax(yerr, std::isfinite(bf(yk[o])) ? e : 1e9);
    }
    const double tol = gk->q8 || dk->q8 ? 2e-2 : 1e-5;  // int8 inputs: their rounding, of the largest |h| or |y|
    const bool good = herr < tol && yerr < tol;
    ok = ok && good;
    std::printf("check %s, %s: h err %.2e, y err %.2e (of max |h| %.3g, |y| %.3g) %s\n", gk->name, dk->name, herr, yerr, hmax, ymax,
                good ? "ok" : "FAIL");
  }

  // Timing: `steps` layers in one graph, 20 replays after 3.
  cudaStream_t st;
  CK(cudaStreamCreate(&st));
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  auto timed = [&](const Kernel* gk, const Kernel* dk) {
    cudaGraph_t g;
    cudaGraphExec_t ge;
    CK(cudaStreamBeginCapture(st, cudaStreamCaptureModeGlobal));
    for (int s = 0; s < steps; ++s) launch(gk, dk, st, s);
    CK(cudaStreamEndCapture(st, &g));
    CK(cudaGraphInstantiate(&ge, g, 0));
    for (int i = 0; i < 3; ++i) CK(cudaGraphLaunch(ge, st));
    CK(cudaEventRecord(e0, st));
    for (int i = 0; i < 20; ++i) CK(cudaGraphLaunch(ge, st));
    CK(cudaEventRecord(e1, st));
    CK(cudaEventSynchronize(e1));
    float ms;
    CK(cudaEventElapsedTime(&ms, e0, e1));
    CK(cudaGraphExecDestroy(ge));
    CK(cudaGraphDestroy(g));
    const double us = ms * 1e3 / (20.0 * steps);
    const double b = K * ((gk ? 2.0 * gu_bytes : 0) + (dk || (gk && gk->moe) ? 1.0 * dn_bytes : 0));
    std::printf("%-40s %10.2f %10.0f\n", (std::string(gk ? gk->name : "") + (gk && dk ? ", " : "") + (dk ? dk->name : "")).c_str(), us, b / us / 1e3);
    return us;
  };
  std::printf("\n%-40s %10s %10s\n", "kernels", "us/layer", "GB/s");
  const Kernel *bg = nullptr, *bd = nullptr;
  double tg = 1e9, td = 1e9;
  for (const Kernel& k : gus) {
    const double t = timed(&k, nullptr);
    if (t < tg && k.check && !k.moe) tg = t, bg = &k;
  }
  for (const Kernel& k : dns) {
    const double t = timed(nullptr, &k);
    if (t < td && k.check) td = t, bd = &k;
  }
  for (int rep = 0; rep < 2; ++rep) {
    timed(&gus[0], &dns[0]);  // the shipped pair, as the engine launches it
    timed(&gus[1], &dns[2]);  // down reading what gate_up asked L2 for
    timed(&gus[2], &dns[2]);  // the same without
    timed(&gus[5], &dns[4]);  // the read floors
    timed(&gus[8], nullptr);  // one kernel a layer
    timed(&gus[6], &dns[5]);  // integer dot products
  }
  for (const Kernel& k : gus)
    if (k.moe) timed(&k, nullptr);
  timed(bg, bd);
  {  // the bound: a device-to-device copy of 1 GiB, bytes read and written
    const size_t n = size_t(1) << 30;
    uint8_t *a, *b;
    CK(cudaMalloc(&a, n));
    CK(cudaMalloc(&b, n));
    CK(cudaMemcpyAsync(b, a, n, cudaMemcpyDeviceToDevice, st));
    CK(cudaEventRecord(e0, st));
    for (int i = 0; i < 10; ++i) CK(cudaMemcpyAsync(b, a, n, cudaMemcpyDeviceToDevice, st));
    CK(cudaEventRecord(e1, st));
    CK(cudaEventSynchronize(e1));
    float ms;
    CK(cudaEventElapsedTime(&ms, e0, e1));
    std::printf("%-28s %10s %10.0f %10s\n", "device copy (read+written)", "", 2.0 * 10 * n / (ms * 1e-3) / 1e9, "bound");
  }
  std::printf("%s\n", ok ? "all checks ok" : "SOME CHECKS FAILED");
  return ok ? 0 : 1;
}
