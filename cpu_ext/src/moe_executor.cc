#include "moe_executor.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <iterator>
#include <stdexcept>

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

namespace {


inline float Activate(float g, float u, Act act) {
  switch (act) {
    case Act::kSilu:
      return g / (1.f + std::exp(-g)) * u;
    case Act::kGelu:
      return 0.5f * g * (1.f + std::erf(g * 0.70710678118654752f)) * u;
    case Act::kGeluTanh:
      return 0.5f * g * (1.f + std::tanh(0.7978845608028654f * (g + 0.044715f * g * g * g))) * u;
    case Act::kSwigluOai: {
      g = std::min(g, 7.f);
      u = std::min(std::max(u, -7.f), 7.f);
      return (u + 1.f) * g / (1.f + std::exp(-1.702f * g));
    }
  }
  return g * u;
}

}  // namespace

Act ParseAct(const std::string& name) {
  std::string known;
  for (size_t i = 0; i < std::size(kActNames); ++i) {
    if (name == kActNames[i]) return static_cast<Act>(i);
    known += (i ? ", " : "") + std::string(kActNames[i]);
  }
  throw std::invalid_argument("unknown activation '" + name + "'; use one of " + known);
}

float MatrixScale(const void* bank, BankType type, int64_t e, int64_t rows, int64_t n) {
  if (type != BankType::kNvfp4) return 1.f;
  float g;
  std::memcpy(&g, BankRow(bank, type, e, rows, n, rows), 4);  // the trailer follows the last row
  return g;
}

// ---------------------------------------------------------------------------------------------

MoeExecutor::MoeExecutor(int threads, IsaTier max_tier, bool pin) : pool_(threads, pin) {
  tier_ = IsaTier::kScalar;
  for (IsaTier t : SupportedTiers())
    if (static_cast<int>(t) <= static_cast<int>(max_tier)) tier_ = t;
  if (tier_ == IsaTier::kAmxBf16) tier_ = IsaTier::kAvx512Bf16;  // no AMX kernel: the bf16 dot is the top tier
}

constexpr int64_t kMaxChunk = 128;  // rows a task reads of one matrix, at most

void MoeExecutor::Run(const float* x, int64_t tokens, const int32_t* token_of, const int32_t* expert_of, const float* weight_of, int64_t items,
                      const Banks& b, Act act, float* out) {
  if (items == 0) return;
  std::lock_guard<std::mutex> lock(run_mu_);
  const int64_t H = b.hidden, F = b.ffn;
  const BankType ty = b.type, dty = b.down_type;
  // Vectors prepared once for kernels that read them (bf16 copies, int8 blocks: quant_dot.h).
  const int64_t px = PrepBytes(tier_, ty, H), ph = PrepBytes(tier_, dty, F);
  std::vector<uint8_t> xprep(static_cast<size_t>(tokens * px)), hprep(static_cast<size_t>(items * ph));
  if (px)
    for (int64_t t = 0; t < tokens; ++t) Prepare(tier_, ty, x + t * H, H, xprep.data() + t * px);
  std::vector<float> hidden(static_cast<size_t>(items) * F);
  // Per-item matrix scales (nvfp4; 1 otherwise).
  std::vector<float> scale(3 * items);
  for (int64_t i = 0; i < items; ++i) {
    scale[3 * i] = MatrixScale(b.gate, ty, expert_of[i], F, H);
    scale[3 * i + 1] = MatrixScale(b.up, ty, expert_of[i], F, H);
    scale[3 * i + 2] = MatrixScale(b.down, dty, expert_of[i], H, F);
  }
  // Rows r0..r0+rows of one matrix of type t against a prepared vector, several at a time where
  // the kernel can.
  const DotRowsFn rows_gu = DotRowsFor(tier_, ty), rows_d = DotRowsFor(tier_, dty);
  const DotFn dot_gu = DotFor(tier_, ty), dot_d = DotFor(tier_, dty);
  auto dots = [&](BankType t, const uint8_t* row, int64_t stride, int64_t rows, const float* v, const uint8_t* prep, int64_t n, float* out) {
    const DotRowsFn dot_rows = t == ty ? rows_gu : rows_d;
    if (dot_rows) return dot_rows(row, stride, rows, v, prep, n, out);
    const DotFn dot = t == ty ? dot_gu : dot_d;
    for (int64_t r = 0; r < rows; ++r) out[r] = dot(row + r * stride, v, prep, n);
  };
  // A task reads a run of rows of one matrix: at least 16, and about 32 KB of them, so that each
  // stream is long enough for the prefetchers (quantized rows are short); fewer rows where that
  // would leave threads without a task.
  const int threads = pool_.size();
  auto rows_per_task = [&](int64_t row_bytes, int64_t rows, int64_t parallel) {
    int64_t c = std::min<int64_t>(kMaxChunk, std::max<int64_t>(16, (32768 / row_bytes + 3) / 4 * 4));
    while (c > 16 && parallel * ((rows + c - 1) / c) < 2 * threads) c = std::max<int64_t>(16, c / 2 / 4 * 4);
    return c;
  };
  // Phase 1: hidden[i, f] = act(gate_e[f] . x_t + bg, up_e[f] . x_t + bu), in chunks of rows.
  const int64_t hrow = RowBytes(ty, H), frow = RowBytes(dty, F);
  const int64_t fchunk = rows_per_task(hrow, F, items), nf = (F + fchunk - 1) / fchunk;
  pool_.Run(items * nf, [&](int64_t task) {
    const int64_t i = task / nf, f0 = (task % nf) * fchunk, f1 = std::min(F, f0 + fchunk);
    const int64_t e = expert_of[i], t = token_of[i];
    const float* xt = x + t * H;
    const uint8_t* xpt = px ? xprep.data() + t * px : nullptr;
    float g[kMaxChunk], u[kMaxChunk];
    dots(ty, BankRow(b.gate, ty, e, F, H, f0), hrow, f1 - f0, xt, xpt, H, g);
    dots(ty, BankRow(b.up, ty, e, F, H, f0), hrow, f1 - f0, xt, xpt, H, u);
    const float* bg = b.gate_bias ? b.gate_bias + e * F : nullptr;
    const float* bu = b.up_bias ? b.up_bias + e * F : nullptr;
    for (int64_t f = f0; f < f1; ++f)
      hidden[i * F + f] = Activate(scale[3 * i] * g[f - f0] + (bg ? bg[f] : 0.f), scale[3 * i + 1] * u[f - f0] + (bu ? bu[f] : 0.f), act);
  });
  if (ph) pool_.Run(items, [&](int64_t i) { Prepare(tier_, dty, hidden.data() + i * F, F, hprep.data() + i * ph); });
  // Phase 2: out[t, h] += w_i * (down_e[h] . hidden_i); each task owns a block of output rows.
  const int64_t hchunk = rows_per_task(frow, H, 1), nh = (H + hchunk - 1) / hchunk;
  pool_.Run(nh, [&](int64_t task) {
    const int64_t h0 = task * hchunk, h1 = std::min(H, h0 + hchunk);
    float d[kMaxChunk];
    for (int64_t i = 0; i < items; ++i) {
      const int64_t e = expert_of[i], t = token_of[i];
      const float w = weight_of[i] * scale[3 * i + 2];
      dots(dty, BankRow(b.down, dty, e, H, F, h0), frow, h1 - h0, hidden.data() + i * F, ph ? hprep.data() + i * ph : nullptr, F, d);
      if (b.down_bias) {
        const float *bd = b.down_bias + e * H, wb = weight_of[i];
        for (int64_t h = h0; h < h1; ++h) out[t * H + h] += w * d[h - h0] + wb * bd[h];
      } else {
        for (int64_t h = h0; h < h1; ++h) out[t * H + h] += w * d[h - h0];
      }
    }
  });
}

}  // namespace freetoken
