#include "moe_executor.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>

#if defined(__linux__)
#include <pthread.h>
#include <sched.h>
#endif

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define FREETOKEN_X86 1
#endif

namespace freetoken {

// ---------------------------------------------------------------------------------------------
// Thread pool

ThreadPool::ThreadPool(int threads, bool pin) {
  threads = std::max(1, threads);
  for (int i = 1; i < threads; ++i) {
    workers_.emplace_back([this, i] { Work(i); });
#if defined(__linux__)
    if (pin) {
      cpu_set_t set;
      CPU_ZERO(&set);
      CPU_SET(i % std::max(1u, std::thread::hardware_concurrency()), &set);
      pthread_setaffinity_np(workers_.back().native_handle(), sizeof(set), &set);
    }
#endif
  }
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> l(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  for (auto& t : workers_) t.join();
}

void ThreadPool::Work(int) {
  uint64_t seen = 0;
  for (;;) {
    const std::function<void(int64_t)>* fn;
    int64_t n;
    // A job's phases follow one another within microseconds, and a decode step's layers (one
    // job each) within about a millisecond: spin for up to 2 ms before sleeping, so that a new
    // job does not wait for sleeping threads to wake.
    const auto spin_from = std::chrono::steady_clock::now();
    for (int i = 1; published_.load(std::memory_order_acquire) == seen; ++i) {
#ifdef FREETOKEN_X86
      _mm_pause();
#endif
      if ((i & 255) == 0 && std::chrono::steady_clock::now() - spin_from > std::chrono::milliseconds(2)) break;
    }
    {
      std::unique_lock<std::mutex> l(mu_);
      // Only a job still running is joined: one that finished while this worker slept is gone
      // (its function with it), and joining it would take the next job's tasks with its own.
      cv_.wait(l, [&] { return stop_ || (running_ && generation_ != seen); });
      if (stop_) return;
      seen = generation_;
      fn = fn_;
      n = n_;
      ++active_;  // Run cannot return while this worker may still call fn
    }
    int64_t done = 0;
    for (int64_t t; (t = next_.fetch_add(1)) < n; ++done) (*fn)(t);
    {
      std::lock_guard<std::mutex> l(mu_);
      completed_ += done;
      if (--active_ == 0 && completed_ == n_) done_cv_.notify_all();
    }
  }
}

void ThreadPool::Run(int64_t n, const std::function<void(int64_t)>& fn) {
  if (n <= 0) return;
  {
    std::lock_guard<std::mutex> l(mu_);
    fn_ = &fn;
    n_ = n;
    next_.store(0);
    completed_ = 0;
    running_ = true;
    ++generation_;
    published_.store(generation_, std::memory_order_release);
  }
  cv_.notify_all();
  int64_t done = 0;
  for (int64_t t; (t = next_.fetch_add(1)) < n; ++done) fn(t);
  // Done when every task has run and no worker is inside fn: a worker that wakes late (busy
  // cores) finds no task left and is not waited for.
  std::unique_lock<std::mutex> l(mu_);
  completed_ += done;
  done_cv_.wait(l, [&] { return completed_ == n && active_ == 0; });
  running_ = false;
}

// ---------------------------------------------------------------------------------------------
// Dot products of one bank row with a float32 vector, per ISA tier

namespace {

inline float Bf16ToF32(uint16_t v) {
  uint32_t u = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline uint16_t F32ToBf16(float f) {  // round to nearest even
  uint32_t u;
  std::memcpy(&u, &f, 4);
  u += 0x7fff + ((u >> 16) & 1);
  return static_cast<uint16_t>(u >> 16);
}

float DotScalar(const void* row, BankType type, const float* x, const uint16_t*, int64_t n) {
  float acc = 0.f;
  if (type == BankType::kF32) {
    const float* w = static_cast<const float*>(row);
    for (int64_t i = 0; i < n; ++i) acc += w[i] * x[i];
  } else {
    const uint16_t* w = static_cast<const uint16_t*>(row);
    for (int64_t i = 0; i < n; ++i) acc += Bf16ToF32(w[i]) * x[i];
  }
  return acc;
}

#ifdef FREETOKEN_X86
__attribute__((target("avx2,fma"))) float DotAvx2(const void* row, BankType type, const float* x, const uint16_t*, int64_t n) {
  __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
  int64_t i = 0;
  if (type == BankType::kF32) {
    const float* w = static_cast<const float*>(row);
    for (; i + 16 <= n; i += 16) {
      acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(w + i), _mm256_loadu_ps(x + i), acc0);
      acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(w + i + 8), _mm256_loadu_ps(x + i + 8), acc1);
    }
  } else {
    const uint16_t* w = static_cast<const uint16_t*>(row);
    for (; i + 16 <= n; i += 16) {
      __m256i a = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + i)));
      __m256i b = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + i + 8)));
      acc0 = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_slli_epi32(a, 16)), _mm256_loadu_ps(x + i), acc0);
      acc1 = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_slli_epi32(b, 16)), _mm256_loadu_ps(x + i + 8), acc1);
    }
  }
  __m256 s = _mm256_add_ps(acc0, acc1);
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
  h = _mm_add_ps(h, _mm_movehl_ps(h, h));
  h = _mm_add_ss(h, _mm_movehdup_ps(h));
  float acc = _mm_cvtss_f32(h);
  if (i < n) {
    const int64_t off = i;
    acc += type == BankType::kF32 ? DotScalar(static_cast<const float*>(row) + off, type, x + off, nullptr, n - off)
                                  : DotScalar(static_cast<const uint16_t*>(row) + off, type, x + off, nullptr, n - off);
  }
  return acc;
}

__attribute__((target("avx512f"))) float DotAvx512(const void* row, BankType type, const float* x, const uint16_t*, int64_t n) {
  __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
  int64_t i = 0;
  if (type == BankType::kF32) {
    const float* w = static_cast<const float*>(row);
    for (; i + 32 <= n; i += 32) {
      acc0 = _mm512_fmadd_ps(_mm512_loadu_ps(w + i), _mm512_loadu_ps(x + i), acc0);
      acc1 = _mm512_fmadd_ps(_mm512_loadu_ps(w + i + 16), _mm512_loadu_ps(x + i + 16), acc1);
    }
  } else {
    const uint16_t* w = static_cast<const uint16_t*>(row);
    for (; i + 32 <= n; i += 32) {
      __m512i a = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + i)));
      __m512i b = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + i + 16)));
      acc0 = _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_slli_epi32(a, 16)), _mm512_loadu_ps(x + i), acc0);
      acc1 = _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_slli_epi32(b, 16)), _mm512_loadu_ps(x + i + 16), acc1);
    }
  }
  float acc = _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1));
  if (i < n) {
    acc += type == BankType::kF32 ? DotScalar(static_cast<const float*>(row) + i, type, x + i, nullptr, n - i)
                                  : DotScalar(static_cast<const uint16_t*>(row) + i, type, x + i, nullptr, n - i);
  }
  return acc;
}

// bf16 x bf16 dot products with float32 accumulation (vdpbf16ps); the vector is rounded to bf16.
__attribute__((target("avx512f,avx512bf16"))) float DotAvx512Bf16(const void* row, BankType type, const float* x, const uint16_t* xb,
                                                                   int64_t n) {
  if (type == BankType::kF32) return DotAvx512(row, type, x, xb, n);
  const uint16_t* w = static_cast<const uint16_t*>(row);
  __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 64 <= n; i += 64) {
    __m512i a0 = _mm512_loadu_si512(w + i), b0 = _mm512_loadu_si512(xb + i);
    __m512i a1 = _mm512_loadu_si512(w + i + 32), b1 = _mm512_loadu_si512(xb + i + 32);
    acc0 = _mm512_dpbf16_ps(acc0, (__m512bh)a0, (__m512bh)b0);
    acc1 = _mm512_dpbf16_ps(acc1, (__m512bh)a1, (__m512bh)b1);
  }
  float acc = _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1));
  for (; i < n; ++i) acc += Bf16ToF32(w[i]) * Bf16ToF32(xb[i]);
  return acc;
}
#endif

using DotFn = float (*)(const void*, BankType, const float*, const uint16_t*, int64_t);

DotFn DotFor(IsaTier tier) {
#ifdef FREETOKEN_X86
  switch (tier) {
    case IsaTier::kAmxBf16:
    case IsaTier::kAvx512Bf16:
      return DotAvx512Bf16;
    case IsaTier::kAvx512F:
      return DotAvx512;
    case IsaTier::kAvx2Fma:
      return DotAvx2;
    default:
      break;
  }
#endif
  (void)tier;
  return DotScalar;
}

inline float Activate(float g, Act act) {
  switch (act) {
    case Act::kSilu:
      return g / (1.f + std::exp(-g));
    case Act::kGelu:
      return 0.5f * g * (1.f + std::erf(g * 0.70710678118654752f));
    case Act::kGeluTanh:
      return 0.5f * g * (1.f + std::tanh(0.7978845608028654f * (g + 0.044715f * g * g * g)));
  }
  return g;
}

inline const void* Row(const void* bank, BankType type, int64_t index, int64_t len) {
  const size_t elem = type == BankType::kF32 ? 4 : 2;
  return static_cast<const char*>(bank) + static_cast<size_t>(index) * static_cast<size_t>(len) * elem;
}

}  // namespace

// ---------------------------------------------------------------------------------------------

MoeExecutor::MoeExecutor(int threads, IsaTier max_tier, bool pin) : pool_(threads, pin) {
  tier_ = IsaTier::kScalar;
  for (IsaTier t : SupportedTiers())
    if (static_cast<int>(t) <= static_cast<int>(max_tier)) tier_ = t;
  if (tier_ == IsaTier::kAmxBf16) tier_ = IsaTier::kAvx512Bf16;  // no AMX kernel: the bf16 dot is the top tier
}

void MoeExecutor::Run(const float* x, int64_t tokens, const int32_t* token_of, const int32_t* expert_of, const float* weight_of, int64_t items,
                      const Banks& b, Act act, float* out) {
  if (items == 0) return;
  std::lock_guard<std::mutex> lock(run_mu_);
  const int64_t H = b.hidden, F = b.ffn;
  const DotFn dot = DotFor(tier_);
  const bool bf16_dot = tier_ == IsaTier::kAvx512Bf16 && b.type == BankType::kBF16;
  // Activations rounded to bf16 once, for the bf16 dot-product tier.
  std::vector<uint16_t> xb(bf16_dot ? tokens * H : 0);
  for (size_t i = 0; i < xb.size(); ++i) xb[i] = F32ToBf16(x[i]);
  std::vector<float> hidden(static_cast<size_t>(items) * F);
  std::vector<uint16_t> hidden_b(bf16_dot ? hidden.size() : 0);
  // Phase 1: hidden[i, f] = act(gate_e[f] . x_t) * (up_e[f] . x_t), in chunks of rows.
  const int64_t fchunk = 16, nf = (F + fchunk - 1) / fchunk;
  pool_.Run(items * nf, [&](int64_t task) {
    const int64_t i = task / nf, f0 = (task % nf) * fchunk, f1 = std::min(F, f0 + fchunk);
    const int64_t e = expert_of[i], t = token_of[i];
    const float* xt = x + t * H;
    const uint16_t* xbt = bf16_dot ? xb.data() + t * H : nullptr;
    for (int64_t f = f0; f < f1; ++f) {
      float g = dot(Row(b.gate, b.type, e * F + f, H), b.type, xt, xbt, H);
      float u = dot(Row(b.up, b.type, e * F + f, H), b.type, xt, xbt, H);
      float h = Activate(g, act) * u;
      hidden[i * F + f] = h;
      if (bf16_dot) hidden_b[i * F + f] = F32ToBf16(h);
    }
  });
  // Phase 2: out[t, h] += w_i * (down_e[h] . hidden_i); each task owns a block of output rows.
  const int64_t hchunk = 16, nh = (H + hchunk - 1) / hchunk;
  pool_.Run(nh, [&](int64_t task) {
    const int64_t h0 = task * hchunk, h1 = std::min(H, h0 + hchunk);
    for (int64_t i = 0; i < items; ++i) {
      const int64_t e = expert_of[i], t = token_of[i];
      const float w = weight_of[i];
      const float* hi = hidden.data() + i * F;
      const uint16_t* hbi = bf16_dot ? hidden_b.data() + i * F : nullptr;
      for (int64_t h = h0; h < h1; ++h) out[t * H + h] += w * dot(Row(b.down, b.type, e * H + h, F), b.type, hi, hbi, F);
    }
  });
}

}  // namespace freetoken
