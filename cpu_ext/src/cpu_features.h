// Run-time detection of the x86-64 instruction-set tiers the CPU expert kernels use.
#pragma once
#include <string>
#include <vector>

namespace freetoken {

// kAvx512F: AVX-512 F/BW/VL; kAvx512Bf16: also BF16 and VNNI dot products (the int8 kernels of
// the 4- and 8-bit formats use VNNI). There is no AMX tier: AMX tiles pay for prefill-sized
// batches, which the executor does not run (prefill computes on the GPU).
enum class IsaTier : int { kScalar = 0, kAvx2Fma = 1, kAvx512F = 2, kAvx512Bf16 = 3 };

// Tiers this CPU (and the OS, for the AVX register state) supports, lowest first.
std::vector<IsaTier> SupportedTiers();
const char* TierName(IsaTier tier);

}  // namespace freetoken
