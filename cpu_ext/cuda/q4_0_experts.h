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
constexpr int kGateUpRows = 16, kGateUpR = 4, kGateUpWarps = 4;  // rows of F a block; a warp's; warps a block
constexpr int kDownRows = 16, kDownR = 1, kDownWarps = 16;       // rows of D a block; ...
constexpr int kMoeWarps = 16, kMoeR = 4;  // the one-kernel layer (ft_q4_0_moe): warps a block (one block an SM), rows a warp's pass
static_assert(kGateUpRows == kGateUpR * kGateUpWarps && kDownRows == kDownR * kDownWarps, "a block's rows are its warps'");

FT_HD inline constexpr int64_t padded_floats(int64_t n) { return n + n / 64 * kPad; }
FT_HD inline constexpr int64_t row_bytes(int64_t in) { return in / 32 * 18; }
// Dynamic shared memory of a block: its inputs as padded float32 (x; the token's K pairs' h).
FT_HD inline constexpr int64_t gate_up_smem(int64_t D) { return padded_floats(D) * 4; }
FT_HD inline constexpr int64_t down_smem(int64_t F, int64_t K) { return padded_floats(K * F) * 4; }
// ft_q4_0_moe's: the T tokens' x, then (the same memory) one token's K pairs' h.
FT_HD inline constexpr int64_t moe_smem(int64_t T, int64_t F, int64_t D, int64_t K) {
  return (T * padded_floats(D) > padded_floats(K * F) ? T * padded_floats(D) : padded_floats(K * F)) * 4;
}

}  // namespace ft_q4_0
