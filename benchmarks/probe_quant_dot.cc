// Where the CPU executor's q4_0 rows spend their time: the VNNI row kernel in cache and from DRAM,
// on one core and on all, against a STREAM-like read, and the executor itself at batch 1.
//
//   g++ -O3 -std=c++17 -pthread -Icpu_ext/src benchmarks/probe_quant_dot.cc cpu_ext/src/cpu_features.cc \
//       cpu_ext/src/moe_executor.cc -o /tmp/probe -ldl && /tmp/probe [threads [executor|jobs]]
//
// "jobs" (built with -DFREETOKEN_TRACE_PHASES): a decode job's fixed cost taken apart —
// the pool's round trip for no-op tasks, then one token's k q4_0 experts a call with the time to
// phase 1, phase 1, phase 2, the caller's sums, and the activations (summed over items), with the
// banks in 4 KB pages, transparent huge pages and CUDA's pinned memory.
//
// Kernel variants (the shipped one first) are defined here beside it; each is checked against the
// shipped kernel's sums before it is timed.
#include <dlfcn.h>
#include <sys/mman.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <random>
#include <thread>
#include <vector>

#include "moe_executor.h"
#include "quant_dot.cc"  // the kernels' internals, for the variants below

using namespace freetoken;
using Clock = std::chrono::steady_clock;

namespace freetoken {
namespace {

// The shipped kernel prefetching `ahead` groups of R rows ahead instead of one (0: no prefetch).
template <int R, int ahead>
VNNI_TARGET void RowsFar(const uint8_t* r, int64_t stride, const VnniPrep& p, int64_t nb, float* out) {
  __m256 acc[R];
  for (int i = 0; i < R; ++i) acc[i] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p.q + 32 * b));
    const __m256i c = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p.c + 8 * b));
    __m256 s[R];
    Q4_0Vnni::Scales<R>(r, stride, b, p.d[b], s);
    if constexpr (ahead > 0) PrefetchAhead<R * 18>(r + ahead * R * stride + b * R * 18);
    for (int i = 0; i < R; ++i)
      acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_dpbusd_epi32(c, Q4_0Vnni::Codes(r + i * stride, b), q)), s[i], acc[i]);
  }
  for (int i = 0; i < R; ++i) out[i] = Hsum(acc[i]);
}

// Two blocks per 512-bit dpbusd, R rows; the scales of both blocks of every row in one conversion.
template <int R>
VNNI_TARGET void Rows512(const uint8_t* r, int64_t stride, const VnniPrep& p, int64_t nb, float* out) {
  static_assert(R == 4, "scales gathered for four rows");
  __m512 acc[R];
  for (int i = 0; i < R; ++i) acc[i] = _mm512_setzero_ps();
  const __m512i shift = _mm512_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4, 0, 0, 0, 0, 4, 4, 4, 4);
  const __m512i m15 = _mm512_set1_epi8(15);
  int64_t b = 0;
  for (; b + 2 <= nb; b += 2) {
    const __m512i q = _mm512_loadu_si512(p.q + 32 * b);
    const __m512i c = _mm512_loadu_si512(p.c + 8 * b);
    uint64_t lo = 0, hi = 0;
    for (int i = 0; i < 2; ++i) {
      uint16_t a0, a1, b0, b1;
      std::memcpy(&a0, r + i * stride + b * 18, 2);
      std::memcpy(&a1, r + i * stride + b * 18 + 18, 2);
      std::memcpy(&b0, r + (i + 2) * stride + b * 18, 2);
      std::memcpy(&b1, r + (i + 2) * stride + b * 18 + 18, 2);
      lo |= (static_cast<uint64_t>(a0) | static_cast<uint64_t>(a1) << 16) << (32 * i);
      hi |= (static_cast<uint64_t>(b0) | static_cast<uint64_t>(b1) << 16) << (32 * i);
    }
    const __m256 dd = _mm256_setr_ps(p.d[b], p.d[b + 1], p.d[b], p.d[b + 1], p.d[b], p.d[b + 1], p.d[b], p.d[b + 1]);
    const __m512 sc = _mm512_castps256_ps512(_mm256_mul_ps(_mm256_cvtph_ps(_mm_set_epi64x(static_cast<int64_t>(hi), static_cast<int64_t>(lo))), dd));
    PrefetchAhead<R * 36>(r + R * stride + b * R * 18);
    for (int i = 0; i < R; ++i) {
      const uint8_t* blk = r + i * stride + b * 18;
      const __m512i raw = _mm512_mask_broadcast_i32x4(_mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 2))), 0xFF00,
                                                      _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 20)));
      const __m512i codes = _mm512_and_si512(_mm512_srlv_epi32(raw, shift), m15);
      const __m512i idx = _mm512_setr_epi32(2 * i, 2 * i, 2 * i, 2 * i, 2 * i, 2 * i, 2 * i, 2 * i, 2 * i + 1, 2 * i + 1, 2 * i + 1, 2 * i + 1,
                                            2 * i + 1, 2 * i + 1, 2 * i + 1, 2 * i + 1);
      acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_dpbusd_epi32(c, codes, q)), _mm512_permutexvar_ps(idx, sc), acc[i]);
    }
  }
  float tail[R] = {};
  if (b < nb) VnniRows<Q4_0Vnni, R>(r + b * 18, stride, VnniPrep{p.q + 32 * b, p.c + 8 * b, p.d + b, p.s + b}, nb - b, tail);
  for (int i = 0; i < R; ++i) out[i] = _mm512_reduce_add_ps(acc[i]) + tail[i];
}


using RowsFn = void (*)(const uint8_t*, int64_t, const VnniPrep&, int64_t, float*);

void RowsWith(RowsFn four, RowsFn one, const uint8_t* r, int64_t stride, int64_t rows, const VnniPrep& p, int64_t nb, float* out) {
  int64_t i = 0;
  for (; i + 4 <= rows; i += 4) four(r + i * stride, stride, p, nb, out + i);
  for (; i < rows; ++i) one(r + i * stride, stride, p, nb, out + i);
}

struct Variant {
  const char* name;
  RowsFn four, one;
};

const Variant kVariants[] = {
    {"shipped", VnniRows<Q4_0Vnni, 4>, VnniRows<Q4_0Vnni, 1>},
    {"no_prefetch", RowsFar<4, 0>, RowsFar<1, 0>},
    {"one_row", VnniRows<Q4_0Vnni, 1>, VnniRows<Q4_0Vnni, 1>},
    {"prefetch_x2", RowsFar<4, 2>, VnniRows<Q4_0Vnni, 1>},
    {"prefetch_x4", RowsFar<4, 4>, VnniRows<Q4_0Vnni, 1>},
    {"zmm_2blk", Rows512<4>, VnniRows<Q4_0Vnni, 1>},
};

}  // namespace
}  // namespace freetoken

static double Seconds(Clock::time_point a) { return std::chrono::duration<double>(Clock::now() - a).count(); }

// Random q4_0 rows with sane f16 scales (no subnormals, no NaN).
static void FillQ4(uint8_t* buf, size_t size, int64_t row_bytes, uint32_t seed) {
  std::mt19937 g(seed);
  for (size_t i = 0; i < size; ++i) buf[i] = static_cast<uint8_t>(g());
  for (size_t o = 0; o + row_bytes <= size; o += row_bytes)
    for (int64_t b = 0; b < row_bytes / 18; ++b) {
      const uint16_t h = 0x2000 + (g() & 0x3ff);  // ≈ 0.0078 .. 0.0156
      std::memcpy(&buf[o + b * 18], &h, 2);
    }
}
static void FillQ4(std::vector<uint8_t>& buf, int64_t row_bytes, uint32_t seed) { FillQ4(buf.data(), buf.size(), row_bytes, seed); }

#ifdef FREETOKEN_TRACE_PHASES
int Jobs(int threads) {
  const std::vector<int> counts = {threads, std::max(1, threads * 3 / 4), std::max(1, threads / 2)};
  for (int nt : counts) {
    ThreadPool pool(nt, false);
    for (int64_t n : {int64_t{1}, int64_t{nt}, int64_t{4 * nt}}) {
      std::atomic<int64_t> sink{0};
      for (int w = 0; w < 100; ++w) pool.Run(n, [&](int64_t t) { sink += t; });
      const auto t0 = Clock::now();
      const int reps = 2000;
      for (int r = 0; r < reps; ++r) pool.Run(n, [&](int64_t t) { sink += t; });
      std::printf("pool %2d threads, %3lld no-op tasks: %.2f us a Run\n", nt, (long long)n, Seconds(t0) / reps * 1e6);
    }
  }
  // The banks in three kinds of host memory: 4 KB pages (madvise NOHUGEPAGE), transparent huge
  // pages (madvise HUGEPAGE), and CUDA's pinned memory (cuMemHostAlloc, as XLA's pinned_host
  // banks are allocated) where libcuda loads; each kind's AnonHugePages share from smaps.
  const int64_t H = 2048, F = 768, E = 512;
  const BankType type = BankType::kQ4_0;
  const size_t gu_bytes = E * MatrixBytes(type, F, H), d_bytes = E * MatrixBytes(type, H, F), total = 2 * gu_bytes + d_bytes;
  std::printf("transparent_hugepage: ");
  if (FILE* f = std::fopen("/sys/kernel/mm/transparent_hugepage/enabled", "r")) {
    char line[256] = {0};
    if (std::fgets(line, sizeof line, f)) std::printf("%s", line);
    std::fclose(f);
  }
  std::printf("executor tier %s\n", TierName(SupportedTiers().back()));
  for (const char* kind : {"4k", "thp", "cuda"}) {
    uint8_t* base = nullptr;
    if (std::string(kind) == "cuda") {
      void* lib = dlopen("libcuda.so.1", RTLD_NOW);
      if (!lib) { std::printf("cuda: libcuda.so.1 not loaded\n"); continue; }
      auto init = reinterpret_cast<int (*)(unsigned)>(dlsym(lib, "cuInit"));
      auto dev_get = reinterpret_cast<int (*)(int*, int)>(dlsym(lib, "cuDeviceGet"));
      auto retain = reinterpret_cast<int (*)(void**, int)>(dlsym(lib, "cuDevicePrimaryCtxRetain"));
      auto set_ctx = reinterpret_cast<int (*)(void*)>(dlsym(lib, "cuCtxSetCurrent"));
      auto host_alloc = reinterpret_cast<int (*)(void**, size_t, unsigned)>(dlsym(lib, "cuMemHostAlloc"));
      int dev = 0;
      void* ctx = nullptr;
      void* p = nullptr;
      if (!init || init(0) || dev_get(&dev, 0) || retain(&ctx, dev) || set_ctx(ctx) || host_alloc(&p, total, 0)) {
        std::printf("cuda: cuMemHostAlloc failed\n");
        continue;
      }
      base = static_cast<uint8_t*>(p);
    } else {
      void* p = mmap(nullptr, total, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
      if (p == MAP_FAILED) { std::printf("%s: mmap failed\n", kind); continue; }
      madvise(p, total, std::string(kind) == "thp" ? MADV_HUGEPAGE : MADV_NOHUGEPAGE);
      base = static_cast<uint8_t*>(p);
    }
    uint8_t *gate = base, *up = base + gu_bytes, *down = base + 2 * gu_bytes;
    FillQ4(gate, gu_bytes, RowBytes(type, H), 1), FillQ4(up, gu_bytes, RowBytes(type, H), 2), FillQ4(down, d_bytes, RowBytes(type, F), 3);
    long huge_kb = 0;  // AnonHugePages of the mapping that holds the banks
    if (FILE* f = std::fopen("/proc/self/smaps", "r")) {
      char line[512];
      bool in = false;
      while (std::fgets(line, sizeof line, f)) {
        unsigned long lo, hi;
        if (std::sscanf(line, "%lx-%lx", &lo, &hi) == 2)  // a mapping's first line (no field line parses so)
          in = reinterpret_cast<uintptr_t>(base) >= lo && reinterpret_cast<uintptr_t>(base) < hi;
        long kb;
        if (in && std::sscanf(line, "AnonHugePages: %ld kB", &kb) == 1) huge_kb += kb;
      }
      std::fclose(f);
    }
    std::printf("\n%s pages: banks %.2f GB, %.0f%% in huge pages\n", kind, total / 1e9, 100.0 * huge_kb * 1024 / total);
    Banks b{gate, up, down, type, E, H, F, type};
    std::vector<float> x(H, 0.01f), out(H);
    std::printf("%7s %3s %8s %8s %8s %8s %8s %8s\n", "threads", "k", "us/call", "setup", "phase1", "phase2", "sums", "activ");
    for (int nt : {threads, std::max(1, threads - 3)}) {
      MoeExecutor exe(nt, SupportedTiers().back(), false);
      for (int k : {1, 3, 8}) {
        std::vector<int32_t> tok(k, 0), ex(k);
        std::vector<float> w(k, 1.f / k);
        double m[5] = {0, 0, 0, 0, 0};
        const int calls = 300, warm = 30;
        for (int c = 0; c < calls + warm; ++c) {
          for (int j = 0; j < k; ++j) ex[j] = static_cast<int32_t>((c * k + j) % E);
          if (c == warm) trace_activate_ns = 0;
          const auto t0 = TraceClock::now();
          exe.Run(x.data(), 1, tok.data(), ex.data(), w.data(), k, b, Act::kSilu, out.data());
          const auto t1 = TraceClock::now();
          if (c < warm) continue;
          auto us = [](auto a, auto b) { return std::chrono::duration<double, std::micro>(b - a).count(); };
          m[0] += us(t0, t1), m[1] += us(t0, trace_marks[1]), m[2] += us(trace_marks[1], trace_marks[2]);
          m[3] += us(trace_marks[2], trace_marks[3]), m[4] += us(trace_marks[3], trace_marks[4]);
        }
        std::printf("%7d %3d %8.1f %8.1f %8.1f %8.1f %8.1f %8.1f\n", nt, k, m[0] / calls, m[1] / calls, m[2] / calls, m[3] / calls,
                    m[4] / calls, trace_activate_ns.load() / 1e3 / calls);
      }
    }
    if (std::string(kind) != "cuda") munmap(base, total);  // (the pinned one stays: the process ends soon)
  }
  return 0;
}
#endif

int main(int argc, char** argv) {
  const int threads = argc > 1 ? std::atoi(argv[1]) : static_cast<int>(std::thread::hardware_concurrency());
#ifdef FREETOKEN_TRACE_PHASES
  if (argc > 2 && std::string(argv[2]) == "jobs") return Jobs(threads);  // on the CPU's best tier
#endif
  const IsaTier tier = IsaTier::kAvx512Bf16;
  bool ok = false;
  for (auto t : SupportedTiers()) ok |= t == tier;
  if (!ok) {
    std::printf("this CPU lacks avx512_bf16/VNNI\n");
    return 1;
  }
  const bool kernels = argc <= 2 || std::string(argv[2]) != "executor";  // "executor": the executor lines alone
  std::printf("threads %d\n", threads);
  for (int64_t n : kernels ? std::vector<int64_t>{2048, 768} : std::vector<int64_t>{})  {
    const int64_t nb = n / 32, rb = nb * 18, chunk = std::max<int64_t>(16, (32768 / rb + 3) / 4 * 4);
    std::vector<float> x(n);
    std::mt19937 g(1);
    std::normal_distribution<float> nd;
    for (auto& v : x) v = nd(g);
    std::vector<uint8_t> prep(PrepBytes(tier, BankType::kQ4_0, n));
    Prepare(tier, BankType::kQ4_0, x.data(), n, prep.data());
    const VnniPrep p = VnniView(prep.data(), nb);
    const int64_t big_rows = (int64_t{1} << 30) / rb;  // ≈ 1 GB
    std::vector<uint8_t> big(static_cast<size_t>(big_rows * rb));
    FillQ4(big, rb, 7);
    std::printf("\nrows of n=%lld (%lld B), tasks of %lld rows\n", (long long)n, (long long)rb, (long long)chunk);
    // Check each variant against the shipped sums on the first 64 rows.
    std::vector<float> ref(64), got(64);
    RowsWith(kVariants[0].four, kVariants[0].one, big.data(), rb, 64, p, nb, ref.data());
    for (const Variant& v : kVariants) {
      RowsWith(v.four, v.one, big.data(), rb, 61, p, nb, got.data());
      double err = 0;
      for (int i = 0; i < 61; ++i) err = std::max(err, std::fabs(double(got[i]) - ref[i]) / (1e-3 + std::fabs(ref[i])));
      std::printf("%-12s check max rel err %.2e%s\n", v.name, err, err > 1e-4 ? "  MISMATCH" : "");
    }
    std::printf("%-12s %10s %10s %10s %10s %10s\n", "variant", "L1/L2 1t", "DRAM 1t", "DRAM Nt", "tasks Nt", "tasks128");
    const int64_t nchunks = big_rows / chunk;
    std::vector<int64_t> order(nchunks);
    for (int64_t i = 0; i < nchunks; ++i) order[i] = i;
    std::shuffle(order.begin(), order.end(), std::mt19937(3));
    for (const Variant& v : kVariants) {
      float out[128];
      // In cache: one task's rows again and again.
      auto t0 = Clock::now();
      const int reps = 20000;
      for (int k = 0; k < reps; ++k) RowsWith(v.four, v.one, big.data(), rb, chunk, p, nb, out);
      const double cache = double(reps) * chunk * rb / Seconds(t0) / 1e9;
      // One thread through 256 MB, rows in order.
      const int64_t rows1 = std::min<int64_t>(big_rows, (int64_t{256} << 20) / rb) / chunk * chunk;
      t0 = Clock::now();
      for (int64_t r = 0; r < rows1; r += chunk) RowsWith(v.four, v.one, big.data() + r * rb, rb, chunk, p, nb, out);
      const double dram1 = double(rows1) * rb / Seconds(t0) / 1e9;
      auto parallel = [&](auto body) {
        std::vector<std::thread> ts;
        std::atomic<int64_t> next{0};
        const auto start = Clock::now();
        for (int t = 0; t < threads; ++t) ts.emplace_back([&, t] { body(t, next); });
        for (auto& th : ts) th.join();
        return Seconds(start);
      };
      // Every thread its own contiguous share.
      double s = parallel([&](int t, std::atomic<int64_t>&) {
        float o[128];
        const int64_t lo = nchunks * t / threads, hi = nchunks * (t + 1) / threads;
        for (int64_t c = lo; c < hi; ++c) RowsWith(v.four, v.one, big.data() + c * chunk * rb, rb, chunk, p, nb, o);
      });
      const double dramn = double(nchunks) * chunk * rb / s / 1e9;
      // Tasks of `chunk` rows in a shuffled order from one counter (the executor's pattern).
      s = parallel([&](int, std::atomic<int64_t>& next) {
        float o[128];
        for (int64_t k; (k = next.fetch_add(1)) < nchunks;) RowsWith(v.four, v.one, big.data() + order[k] * chunk * rb, rb, chunk, p, nb, o);
      });
      const double tasks = double(nchunks) * chunk * rb / s / 1e9;
      const int64_t n128 = big_rows / 128;
      s = parallel([&](int, std::atomic<int64_t>& next) {
        float o[128];
        for (int64_t k; (k = next.fetch_add(1)) < n128;) RowsWith(v.four, v.one, big.data() + (order[k % nchunks] % n128) * 128 * rb, rb, 128, p, nb, o);
      });
      const double tasks128 = double(n128) * 128 * rb / s / 1e9;
      std::printf("%-12s %10.1f %10.1f %10.1f %10.1f %10.1f\n", v.name, cache, dram1, dramn, tasks, tasks128);
    }
  }
  // STREAM-like read, 1 and N threads, 1 GB.
  if (kernels) {
    std::vector<uint64_t> a((int64_t{1} << 30) / 8, 1);
    for (int nt : {1, threads}) {
      std::vector<std::thread> ts;
      std::vector<uint64_t> sums(nt);
      const int64_t n = nt == 1 ? static_cast<int64_t>(a.size()) / 4 : static_cast<int64_t>(a.size());
      const auto t0 = Clock::now();
      for (int t = 0; t < nt; ++t)
        ts.emplace_back([&, t] {
          uint64_t s0 = 0, s1 = 0, s2 = 0, s3 = 0;
          for (int64_t i = n * t / nt; i + 4 <= n * (t + 1) / nt; i += 4) s0 += a[i], s1 += a[i + 1], s2 += a[i + 2], s3 += a[i + 3];
          sums[t] = s0 + s1 + s2 + s3;
        });
      for (auto& th : ts) th.join();
      std::printf("stream read %2d threads: %.1f GB/s (%llu)\n", nt, n * 8 / Seconds(t0) / 1e9, (unsigned long long)sums[0]);
    }
  }
  // The executor at batch 1: 8 experts a call over ≈ 1 GB of experts (H 2048, F 768), q4_0 and bf16.
  for (BankType type : {BankType::kQ4_0, BankType::kBF16}) {
    const int64_t H = 2048, F = 768, E = type == BankType::kQ4_0 ? 384 : 128;
    std::vector<uint8_t> gate(E * MatrixBytes(type, F, H)), up(gate.size()), down(E * MatrixBytes(type, H, F));
    if (type == BankType::kQ4_0) {
      FillQ4(gate, RowBytes(type, H), 1), FillQ4(up, RowBytes(type, H), 2), FillQ4(down, RowBytes(type, F), 3);
    } else {
      for (auto* v : {&gate, &up, &down})
        for (size_t i = 0; i + 1 < v->size(); i += 2) (*v)[i] = static_cast<uint8_t>(i * 2654435761u >> 24), (*v)[i + 1] = 0x3c;
    }
    Banks b{gate.data(), up.data(), down.data(), type, E, H, F, type};
    std::vector<float> x(H, 0.01f), out(H);
    std::vector<int32_t> tok(8, 0), ex(8);
    std::vector<float> w(8, 0.125f);
    for (int nt : {threads, threads / 2, threads - 3}) {
      MoeExecutor exe(nt, IsaTier::kAvx512Bf16, false);
      double best = 1e9;
      for (int rep = 0; rep < 4; ++rep) {
        const auto t0 = Clock::now();
        for (int64_t c = 0; c < E / 8; ++c) {
          for (int j = 0; j < 8; ++j) ex[j] = static_cast<int32_t>(c * 8 + j);
          exe.Run(x.data(), 1, tok.data(), ex.data(), w.data(), 8, b, Act::kSilu, out.data());
        }
        best = std::min(best, Seconds(t0));
      }
      const double bytes = double(gate.size() + up.size() + down.size());
      std::printf("executor %s %2d threads: %.1f GB/s (%.1f us per 8-expert call)\n", BankTypeName(type), nt, bytes / best / 1e9,
                  best / (E / 8) * 1e6);
    }
  }
  return 0;
}
