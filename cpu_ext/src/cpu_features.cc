#include "cpu_features.h"

#if defined(__x86_64__) || defined(_M_X64)
#include <cpuid.h>
#include <immintrin.h>
#endif

namespace freetoken {
namespace {

#if defined(__x86_64__) || defined(_M_X64)
struct Regs { unsigned a = 0, b = 0, c = 0, d = 0; };

Regs Cpuid(unsigned leaf, unsigned sub) {
  Regs r;
  __cpuid_count(leaf, sub, r.a, r.b, r.c, r.d);
  return r;
}

unsigned long long Xgetbv() {
  unsigned lo, hi;
  __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
  return (static_cast<unsigned long long>(hi) << 32) | lo;
}
#endif

}  // namespace

std::vector<IsaTier> SupportedTiers() {
  std::vector<IsaTier> tiers{IsaTier::kScalar};
#if defined(__x86_64__) || defined(_M_X64)
  unsigned max_leaf = __get_cpuid_max(0, nullptr);
  if (max_leaf < 7) return tiers;
  Regs l1 = Cpuid(1, 0);
  bool osxsave = l1.c & (1u << 27);
  if (!osxsave) return tiers;
  unsigned long long xcr0 = Xgetbv();
  bool ymm = (xcr0 & 0x6) == 0x6;
  bool zmm = ymm && (xcr0 & 0xe0) == 0xe0;
  Regs l7 = Cpuid(7, 0);
  Regs l7s1 = Cpuid(7, 1);
  bool avx2 = l7.b & (1u << 5), fma = l1.c & (1u << 12);
  bool avx512f = l7.b & (1u << 16), avx512bw = l7.b & (1u << 30), avx512vl = l7.b & (1u << 31);
  bool avx512bf16 = l7s1.a & (1u << 5), avx512vnni = l7.c & (1u << 11);
  if (ymm && avx2 && fma) tiers.push_back(IsaTier::kAvx2Fma); else return tiers;
  if (zmm && avx512f && avx512bw && avx512vl) tiers.push_back(IsaTier::kAvx512F); else return tiers;
  if (avx512bf16 && avx512vnni) tiers.push_back(IsaTier::kAvx512Bf16);
#endif
  return tiers;
}

const char* TierName(IsaTier tier) {
  switch (tier) {
    case IsaTier::kScalar: return "scalar";
    case IsaTier::kAvx2Fma: return "avx2_fma";
    case IsaTier::kAvx512F: return "avx512f";
    case IsaTier::kAvx512Bf16: return "avx512_bf16";
  }
  return "unknown";
}

}  // namespace freetoken
