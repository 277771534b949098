// Bank element types of the CPU executor and their dot products with a float32 vector.
//
// A bank row holds one matrix row of an expert: float32, bfloat16, or the blocks of a quantized
// format (freetoken_jax/quant/formats.py and docs/FORMATS.md give the byte layouts; the table in
// quant_dot.cc mirrors formats.py and a test checks that they agree).
#pragma once

#include <cstdint>

#include "cpu_features.h"

namespace freetoken {

enum class BankType { kF32, kBF16, kQ8_0, kQ4_0, kMxfp4, kNvfp4, kFp8, kQ4_K, kQ5_K, kQ6_K };

struct FormatLayout {
  int64_t block;        // weights per block along the row
  int64_t block_bytes;  // bytes per block
  int64_t trailer;      // bytes after a matrix's rows (nvfp4: its float32 scale)
  bool pads;            // a short last block is zero-padded (fp8); otherwise rows hold whole blocks
};

FormatLayout LayoutOf(BankType type);
// Parses "f32", "bf16", "q8_0", "q4_0", "mxfp4", "nvfp4", "fp8", "q4_k", "q5_k", "q6_k"; throws
// std::invalid_argument.
BankType ParseBankType(const char* name);
const char* BankTypeName(BankType type);

inline int64_t RowBytes(BankType type, int64_t n) {
  const FormatLayout l = LayoutOf(type);
  return (n + l.block - 1) / l.block * l.block_bytes;
}
inline int64_t MatrixBytes(BankType type, int64_t rows, int64_t n) { return rows * RowBytes(type, n) + LayoutOf(type).trailer; }
// Whether rows of n weights can be stored (whole blocks, unless the format pads).
inline bool RowFits(BankType type, int64_t n) {
  const FormatLayout l = LayoutOf(type);
  return n > 0 && (l.pads || n % l.block == 0);
}

// Σ_i w_i x_i over one row of n weights. `prep` is x prepared by `Prepare` for the kernels that
// read it (null where PrepBytes is 0). An nvfp4 row leaves out its matrix's float32 scale.
using DotFn = float (*)(const uint8_t* row, const float* x, const void* prep, int64_t n);
DotFn DotFor(IsaTier tier, BankType type);
// out[i] = row i · x for `rows` rows `stride` bytes apart (rows of one matrix), where a kernel
// computes several rows at once (sharing loads of x and scale conversions); null where the tier
// and type have only the single-row kernel.
using DotRowsFn = void (*)(const uint8_t* row, int64_t stride, int64_t rows, const float* x, const void* prep, int64_t n, float* out);
DotRowsFn DotRowsFor(IsaTier tier, BankType type);
// The width of the VNNI tier's q4_0, q8_0, mxfp4 and nvfp4 kernels: FREETOKEN_VNNI_BITS (512, the
// default: two blocks a step; 256: one), read once; throws std::invalid_argument on another value.
int VnniBits();

// What some kernels read instead of (or beside) the float32 vector, made once per vector: the
// bf16 dot tier reads x rounded to bf16; the int8 kernels (VNNI: the 4- to 8-bit formats but fp8
// from tier avx512_bf16 up; AVX2: q4_0, mxfp4 and nvfp4 at tier avx2_fma) read x quantized to
// int8 per block of 32 as llama.cpp does (d = max|x| / 127,
// q = round(x / d)), so their sums are those of x dequantized from those blocks. 0 bytes: the
// kernel reads x alone.
int64_t PrepBytes(IsaTier tier, BankType type, int64_t n);
void Prepare(IsaTier tier, BankType type, const float* x, int64_t n, uint8_t* out);
// Whether Prepare makes int8 blocks for (tier, type): the kernels of the tier read them.
bool PreparesInt8(IsaTier tier, BankType type);
// The int8 blocks Prepare makes (VnniPrepBytes: codes, lane sums, scales), by the scalar loop
// that its vector code is checked against.
void PrepareInt8Reference(BankType type, const float* x, int64_t n, uint8_t* out);

}  // namespace freetoken
