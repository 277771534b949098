// Run-time detection of the x86-64 instruction-set tiers the CPU expert kernels use.
#pragma once
#include <string>
#include <vector>

namespace freetoken {

enum class IsaTier : int { kScalar = 0, kAvx2Fma = 1, kAvx512F = 2, kAvx512Bf16 = 3, kAmxBf16 = 4 };

// Tiers this CPU (and the OS, for the AVX/AMX register state) supports, lowest first.
std::vector<IsaTier> SupportedTiers();
const char* TierName(IsaTier tier);

}  // namespace freetoken
