// Run-time detection of the x86-64 instruction-set tiers the CPU expert kernels use.
#pragma once
#include <string>
#include <vector>

namespace freetoken {

// kAvx512F: AVX-512 F/BW/VL; kAvx512Bf16: also BF16 and VNNI dot products (the int8 kernels of
// q8_0 / q4_0 use VNNI); kAmxBf16: also AMX tiles (no AMX kernel yet: it runs the kAvx512Bf16 ones).
enum class IsaTier : int { kScalar = 0, kAvx2Fma = 1, kAvx512F = 2, kAvx512Bf16 = 3, kAmxBf16 = 4 };

// Tiers this CPU (and the OS, for the AVX/AMX register state) supports, lowest first.
std::vector<IsaTier> SupportedTiers();
const char* TierName(IsaTier tier);

}  // namespace freetoken
