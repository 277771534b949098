#include "moe_executor.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
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

#ifdef FREETOKEN_TRACE_PHASES  // benchmarks/probe_quant_dot.cc: where a job's time goes
TraceClock::time_point trace_marks[kTraceMarks];
std::atomic<int64_t> trace_activate_ns{0};
#define FT_MARK(i) (trace_marks[i] = TraceClock::now())
#else
#define FT_MARK(i) ((void)0)
#endif

// ---------------------------------------------------------------------------------------------
// Thread pool

namespace {

// FREETOKEN_POOL_SPIN_US: how long an idle worker spins for the next job before it sleeps on a
// condition variable (default 2000 µs; 0: it sleeps at once).
std::chrono::microseconds PoolSpin() {
  const char* env = std::getenv("FREETOKEN_POOL_SPIN_US");
  return std::chrono::microseconds(env && *env ? std::max(0LL, std::atoll(env)) : 2000LL);
}

}  // namespace

ThreadPool::ThreadPool(int threads, bool pin) : spin_(PoolSpin()) {
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
    stop_.store(true);
  }
  cv_.notify_all();
  for (auto& t : workers_) t.join();
}

int64_t ThreadPool::Take(uint32_t generation) {
  int64_t done = 0;
  uint64_t v = next_.load(std::memory_order_acquire);
  for (;;) {
    if (static_cast<uint32_t>(v >> 32) != generation) return done;
    const int64_t t = static_cast<int64_t>(v & 0xffffffffu);
    if (t >= n_.load(std::memory_order_acquire)) return done;  // (n of a later job only if v is stale: the swap fails)
    if (next_.compare_exchange_weak(v, v + 1, std::memory_order_acq_rel, std::memory_order_acquire)) {
      (*fn_.load(std::memory_order_acquire))(t);
      ++done;
      v = next_.load(std::memory_order_acquire);
    }
  }
}

void ThreadPool::Work(int) {
  uint32_t seen = 0;
  for (;;) {
    // A job's phases follow one another within microseconds, and a decode step's layers (one
    // job each) within about a millisecond: spin for up to `spin_` before sleeping, so that a
    // new job does not wait for sleeping threads to wake.
    const auto spin_from = std::chrono::steady_clock::now();
    for (int i = 1; published_.load(std::memory_order_acquire) == seen && !stop_.load(std::memory_order_relaxed); ++i) {
#ifdef FREETOKEN_X86
      _mm_pause();
#endif
      if ((i & 255) == 0 && std::chrono::steady_clock::now() - spin_from > spin_) {
        std::unique_lock<std::mutex> l(mu_);
        sleepers_.fetch_add(1);  // seq_cst with Run's publish and its read of sleepers_: a wake-up is never lost
        cv_.wait(l, [&] { return stop_.load() || published_.load() != seen; });
        sleepers_.fetch_sub(1);
        break;
      }
    }
    if (stop_.load()) return;
    seen = published_.load(std::memory_order_acquire);
    const int64_t done = Take(seen);
    if (done) {
      completed_.fetch_add(done);  // seq_cst with the caller's caller_sleeps_ (below)
      if (caller_sleeps_.load()) {
        std::lock_guard<std::mutex> l(mu_);
        done_cv_.notify_all();
      }
    }
  }
}

void ThreadPool::Run(int64_t n, const std::function<void(int64_t)>& fn) {
  if (n <= 0) return;
  const uint32_t gen = ++generation_;
  fn_.store(&fn, std::memory_order_relaxed);
  n_.store(n, std::memory_order_relaxed);
  completed_.store(0, std::memory_order_relaxed);
  next_.store(static_cast<uint64_t>(gen) << 32, std::memory_order_release);
  published_.store(gen);  // seq_cst: see Work's sleepers_
  if (sleepers_.load()) {
    std::lock_guard<std::mutex> l(mu_);
    cv_.notify_all();
  }
  const int64_t mine = Take(gen);
  if (mine) completed_.fetch_add(mine);
  // The last tasks end within microseconds of each other, so the caller spins (a sleeping caller
  // would add a wake-up to every phase) and sleeps only when a worker is held up for long.
  auto finished = [&] { return completed_.load() == n; };
  const auto spin_from = std::chrono::steady_clock::now();
  for (int i = 1; !finished(); ++i) {
#ifdef FREETOKEN_X86
    _mm_pause();
#endif
    if ((i & 63) == 0 && std::chrono::steady_clock::now() - spin_from > std::chrono::microseconds(500)) break;
  }
  if (finished()) return;
  std::unique_lock<std::mutex> l(mu_);
  caller_sleeps_.store(true);
  done_cv_.wait(l, finished);
  caller_sleeps_.store(false);
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

// out[f] = act(sg g[f] + bg[f], su u[f] + bu[f]) for f < n (bg, bu may be null): SiLU eight lanes at
// a time where the CPU has AVX2 (e^x by Cephes' expf: range reduction by ln 2 and a degree-5
// polynomial, within 2 ulp of std::exp), every other activation and the rest by Activate.
#ifdef FREETOKEN_X86
__attribute__((target("avx2,fma"))) int64_t SiluAvx2(const float* g, const float* u, float sg, float su, const float* bg, const float* bu,
                                                   float* out, int64_t n) {
  const __m256 vsg = _mm256_set1_ps(sg), vsu = _mm256_set1_ps(su), one = _mm256_set1_ps(1.f);
  int64_t f = 0;
  for (; f + 8 <= n; f += 8) {
    __m256 a = _mm256_mul_ps(vsg, _mm256_loadu_ps(g + f)), b = _mm256_mul_ps(vsu, _mm256_loadu_ps(u + f));
    if (bg) a = _mm256_add_ps(a, _mm256_loadu_ps(bg + f));
    if (bu) b = _mm256_add_ps(b, _mm256_loadu_ps(bu + f));
    // e = exp(-a)
    __m256 x = _mm256_min_ps(_mm256_max_ps(_mm256_sub_ps(_mm256_setzero_ps(), a), _mm256_set1_ps(-87.3365f)), _mm256_set1_ps(88.7228f));
    const __m256 k = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
    x = _mm256_fnmadd_ps(k, _mm256_set1_ps(0.693359375f), x);
    x = _mm256_fnmadd_ps(k, _mm256_set1_ps(-2.12194440e-4f), x);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, x, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, x, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, x, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, x, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, x, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_add_ps(_mm256_fmadd_ps(p, _mm256_mul_ps(x, x), x), one);
    const __m256 e = _mm256_mul_ps(p, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(k), _mm256_set1_epi32(127)), 23)));
    _mm256_storeu_ps(out + f, _mm256_mul_ps(_mm256_div_ps(a, _mm256_add_ps(one, e)), b));
  }
  return f;
}
#endif

void ActivateRow(IsaTier tier, Act act, const float* g, const float* u, float sg, float su, const float* bg, const float* bu, float* out,
                 int64_t n) {
  int64_t f = 0;
#ifdef FREETOKEN_X86
  if (act == Act::kSilu && tier != IsaTier::kScalar) f = SiluAvx2(g, u, sg, su, bg, bu, out, n);
#else
  (void)tier;
#endif
  for (; f < n; ++f) out[f] = Activate(sg * g[f] + (bg ? bg[f] : 0.f), su * u[f] + (bu ? bu[f] : 0.f), act);
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
  VnniBits();  // a bad FREETOKEN_VNNI_BITS is refused here, before any job
  tier_ = IsaTier::kScalar;
  for (IsaTier t : SupportedTiers())
    if (static_cast<int>(t) <= static_cast<int>(max_tier)) tier_ = t;
}

// v's storage for n elements, grown where it is short (never shrunk, not cleared).
template <class T>
T* Grow(std::vector<T>& v, int64_t n) {
  if (v.size() < static_cast<size_t>(n)) v.resize(static_cast<size_t>(n));
  return v.data();
}

constexpr int64_t kMaxChunk = 128;  // rows a task of the many-items path reads of one matrix, at most

namespace {

// One task of a phase: rows [r0, r1) of stream s (one matrix, read for every item of a group).
struct RowRun {
  int64_t stream, r0, r1;
};

// Splits `streams` matrices of `rows` rows (`row_bytes` each), stream s read for weight[s] items,
// into runs for `threads` threads, largest first: each run takes about a third of the work that
// remains per thread, between 8 KB and 256 KB of rows (at least 4 rows), in multiples of 4 rows.
// Long runs keep the hardware prefetchers streaming (each run's start is a cold miss) and stay in
// the core's L2 while a group's items are dotted with them; the short ones at the end keep every
// thread busy to the phase's end.
std::vector<RowRun> GuidedRuns(const std::vector<int64_t>& weight, int64_t rows, int64_t row_bytes, int threads) {
  std::vector<RowRun> runs;
  const int64_t lo = std::max<int64_t>(4, 8192 / row_bytes / 4 * 4), hi = std::max<int64_t>(lo, 262144 / row_bytes / 4 * 4);
  int64_t left = 0;
  for (int64_t w : weight) left += w * rows;
  for (size_t s = 0; s < weight.size(); ++s)
    for (int64_t r = 0; r < rows;) {
      const int64_t want = std::min(hi, std::max(lo, left / (3 * int64_t{threads}) / weight[s] / 4 * 4));
      const int64_t n = rows - r - want < lo ? rows - r : want;  // no sliver left at a stream's end
      runs.push_back({static_cast<int64_t>(s), r, r + n});
      r += n, left -= n * weight[s];
    }
  return runs;
}

// Items grouped by expert (stable): order[begin[g] .. begin[g + 1]) are group g's items.
struct Groups {
  std::vector<int64_t> order, begin, size;
};
Groups ByExpert(const int32_t* expert_of, int64_t items) {
  Groups g;
  g.order.resize(static_cast<size_t>(items));
  for (int64_t i = 0; i < items; ++i) g.order[i] = i;
  std::stable_sort(g.order.begin(), g.order.end(), [&](int64_t a, int64_t b) { return expert_of[a] < expert_of[b]; });
  for (int64_t k = 0; k < items; ++k)
    if (k == 0 || expert_of[g.order[k]] != expert_of[g.order[k - 1]]) g.begin.push_back(k);
  g.begin.push_back(items);
  for (size_t k = 0; k + 1 < g.begin.size(); ++k) g.size.push_back(g.begin[k + 1] - g.begin[k]);
  return g;
}

}  // namespace

void MoeExecutor::Scratch::Trim() {
  const size_t bytes = xprep.capacity() + hprep.capacity() + 4 * (scale.capacity() + gu.capacity() + hidden.capacity() + partial.capacity());
  if (bytes > kKeepBytes) *this = Scratch();
}

void MoeExecutor::Run(const float* x, int64_t tokens, const int32_t* token_of, const int32_t* expert_of, const float* weight_of, int64_t items,
                      const Banks& b, Act act, float* out) {
  if (items == 0) return;
  std::lock_guard<std::mutex> lock(run_mu_);
  struct TrimAtEnd {
    Scratch& s;
    ~TrimAtEnd() { s.Trim(); }
  } trim{scratch_};
  FT_MARK(0);
  const int64_t H = b.hidden, F = b.ffn;
  const BankType ty = b.type, dty = b.down_type;
  const int threads = pool_.size();
  // Vectors prepared once for kernels that read them (bf16 copies, int8 blocks: quant_dot.h).
  const int64_t px = PrepBytes(tier_, ty, H), ph = PrepBytes(tier_, dty, F);
  uint8_t *xprep = Grow(scratch_.xprep, tokens * px), *hprep = Grow(scratch_.hprep, items * ph);
  auto prepare_x = [&](int64_t t) { Prepare(tier_, ty, x + t * H, H, xprep + t * px); };
  if (px && tokens >= 8) pool_.Run(tokens, prepare_x);  // a prompt's chunk: on every thread
  else if (px)
    for (int64_t t = 0; t < tokens; ++t) prepare_x(t);  // decode rows: not worth waking the pool
  // Per-item matrix scales (nvfp4; 1 otherwise).
  float* scale = Grow(scratch_.scale, 3 * items);
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
  const int64_t hrow = RowBytes(ty, H), frow = RowBytes(dty, F);
  // Phase 1: gate and up rows for every item, gu[i][m][f]; each task one run of one matrix of
  // one expert, dotted with every item routed to it (the rows read from memory once).
  const Groups groups = ByExpert(expert_of, items);
  const int64_t G = static_cast<int64_t>(groups.size.size());
  float *gu = Grow(scratch_.gu, items * 2 * F), *hidden = Grow(scratch_.hidden, items * F);
  std::vector<int64_t> weight1(2 * G);
  for (int64_t g = 0; g < 2 * G; ++g) weight1[g] = groups.size[g / 2];
  const std::vector<RowRun> runs1 = GuidedRuns(weight1, F, hrow, threads);
  // hidden[i, f] = act(gate . x_t + bg, up . x_t + bu), and its prepared copy for the down rows:
  // computed for a group's items by the thread that finishes the group's last run (no phase of
  // its own: one wait for every thread less per job).
  auto activate = [&](int64_t i) {
#ifdef FREETOKEN_TRACE_PHASES
    const auto from = TraceClock::now();
#endif
    const int64_t e = expert_of[i];
    const float *g = gu + 2 * i * F, *u = g + F;
    const float* bg = b.gate_bias ? b.gate_bias + e * F : nullptr;
    const float* bu = b.up_bias ? b.up_bias + e * F : nullptr;
    ActivateRow(tier_, act, g, u, scale[3 * i], scale[3 * i + 1], bg, bu, hidden + i * F, F);
    if (ph) Prepare(tier_, dty, hidden + i * F, F, hprep + i * ph);
#ifdef FREETOKEN_TRACE_PHASES
    trace_activate_ns += std::chrono::duration_cast<std::chrono::nanoseconds>(TraceClock::now() - from).count();
#endif
  };
  std::vector<std::atomic<int64_t>> left1(static_cast<size_t>(G));  // runs of each group not yet done
  for (auto& n : left1) n.store(0, std::memory_order_relaxed);
  for (const RowRun& run : runs1) left1[run.stream / 2].fetch_add(1, std::memory_order_relaxed);
  FT_MARK(1);
  pool_.Run(static_cast<int64_t>(runs1.size()), [&](int64_t task) {
    const RowRun& run = runs1[task];
    const int64_t g = run.stream / 2, m = run.stream % 2;
    const uint8_t* rows = BankRow(m ? b.up : b.gate, ty, expert_of[groups.order[groups.begin[g]]], F, H, run.r0);
    for (int64_t k = groups.begin[g]; k < groups.begin[g + 1]; ++k) {
      const int64_t i = groups.order[k], t = token_of[i];
      dots(ty, rows, hrow, run.r1 - run.r0, x + t * H, px ? xprep + t * px : nullptr, H, gu + (2 * i + m) * F + run.r0);
    }
    // acq_rel: the last run's thread sees every other run's rows of the group
    if (left1[g].fetch_sub(1, std::memory_order_acq_rel) == 1)
      for (int64_t k = groups.begin[g]; k < groups.begin[g + 1]; ++k) activate(groups.order[k]);
  });
  auto down_rows = [&](int64_t i, int64_t h0, int64_t h1, float* d) {
    dots(dty, BankRow(b.down, dty, expert_of[i], H, F, h0), frow, h1 - h0, hidden + i * F, ph ? hprep + i * ph : nullptr, F, d);
  };
  auto add_down = [&](int64_t i, int64_t h0, int64_t h1, const float* d) {  // out[t, h0:h1] += w_i * (d + bd)
    const int64_t e = expert_of[i], t = token_of[i];
    const float w = weight_of[i] * scale[3 * i + 2], wb = weight_of[i];
    const float* bd = b.down_bias ? b.down_bias + e * H : nullptr;
    for (int64_t h = h0; h < h1; ++h) out[t * H + h] += w * d[h - h0] + (bd ? wb * bd[h] : 0.f);
  };
  // Phase 2: out[t, h] += w_i * (down_e[h] . hidden_i), the items of one expert one after
  // another (its rows read from memory once). Few items (decode): each task one run of one
  // expert's down rows into its items' partial sums, added up per output block afterwards in item
  // order; many items: each task a block of output rows over every item (no partials held).
  // (the sums of a few items' partials are added up on the calling thread: a phase of the pool
  // costs every thread a wait, more than adding a few rows of H)
  constexpr int64_t kPartialItems = 64, kAddRows = 256, kCallerAdds = 8;
  FT_MARK(2);
  if (items <= kPartialItems) {
    float* partial = Grow(scratch_.partial, items * H);
    const std::vector<RowRun> runs2 = GuidedRuns(groups.size, H, frow, threads);
    pool_.Run(static_cast<int64_t>(runs2.size()), [&](int64_t task) {
      const RowRun& run = runs2[task];
      for (int64_t k = groups.begin[run.stream]; k < groups.begin[run.stream + 1]; ++k) {
        const int64_t i = groups.order[k];
        down_rows(i, run.r0, run.r1, partial + i * H + run.r0);
      }
    });
    FT_MARK(3);
    auto add_block = [&](int64_t task) {
      const int64_t h0 = task * kAddRows, h1 = std::min(H, h0 + kAddRows);
      for (int64_t i = 0; i < items; ++i) add_down(i, h0, h1, partial + i * H + h0);
    };
    const int64_t blocks = (H + kAddRows - 1) / kAddRows;
    if (items <= kCallerAdds)
      for (int64_t task = 0; task < blocks; ++task) add_block(task);
    else
      pool_.Run(blocks, add_block);
    FT_MARK(4);
    return;
  }
  int64_t hchunk = std::min<int64_t>(kMaxChunk, std::max<int64_t>(16, (32768 / frow + 3) / 4 * 4));
  while (hchunk > 16 && (H + hchunk - 1) / hchunk < 2 * threads) hchunk = std::max<int64_t>(16, hchunk / 2 / 4 * 4);
  const int64_t nh = (H + hchunk - 1) / hchunk;
  pool_.Run(nh, [&](int64_t task) {
    const int64_t h0 = task * hchunk, h1 = std::min(H, h0 + hchunk);
    float d[kMaxChunk];
    for (int64_t i : groups.order) {
      down_rows(i, h0, h1, d);
      add_down(i, h0, h1, d);
    }
  });
}

}  // namespace freetoken
