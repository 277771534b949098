// Launch geometry of the q4_0 decode expert kernels (q4_0_experts.cu), shared by the kernels and
// the C++ module that launches them (ffi_experts.cc).
#pragma once

#include <stdint.h>

#ifdef __CUDACC__
#define FT_HD __host__ __device__
#else
#define FT_HD
#endif

namespace ft_q4_0 {

constexpr int kPad = 4;  // floats of padding after every 64 staged inputs
constexpr int kGateUpRows = 16, kGateUpR = 2, kGateUpStages = 2, kGateUpWarps = 4;  // rows of F a block; a warp's; copy stages; warps
constexpr int kDownRows = 8, kDownR = 2, kDownStages = 2, kDownWarps = 2;            // rows of D a block; ...

FT_HD inline constexpr int64_t padded_floats(int64_t n) { return n + n / 64 * kPad; }
FT_HD inline constexpr int64_t row_bytes(int64_t in) { return in / 32 * 18; }
// Dynamic shared memory of a block: its staged rows and its inputs as float32.
FT_HD inline constexpr int64_t gate_up_smem(int64_t D, int64_t rows = kGateUpRows) { return 2 * rows * row_bytes(D) + padded_floats(D) * 4; }
FT_HD inline constexpr int64_t down_smem(int64_t F, int64_t K, int64_t rows = kDownRows) { return K * rows * row_bytes(F) + padded_floats(K * F) * 4; }

}  // namespace ft_q4_0
