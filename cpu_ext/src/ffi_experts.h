// Decode's routed experts over q4_0 banks as two XLA FFI targets on CUDA, launching the kernels of
// cpu_ext/cuda/q4_0_experts.cu (its PTX, embedded in this module and loaded through the driver):
//
//   h = freetoken_q4_0_gate_up(gate, up, x, ids, w; index, ffn)                  h: bf16 [T, K, F]
//   y = freetoken_q4_0_down(down, h, ids; index)                                y: bf16 [T, D]
//   y, h = freetoken_q4_0_moe(gate, up, down, x, ids, w; index, down_index, ffn)  both in one launch
//                                                                  (h its scratch between them)
//
// gate/up/down: uint8 banks [E, row] or stacked [L, E, row] (`index`: the entry of the stack, 0
// for a bank of rank 2), each expert's q4_0 matrix its row's first bytes; x bf16 [T, D]; ids int32
// [T, K] (rows of the bank: the caller keeps them in range, as it does for a gather); w float32
// [T, K]. The handlers check every shape (F and D multiples of 256, rows of a multiple of 16 bytes
// that hold the matrix, the shared memory a block needs) and return an error before launching.
// Both may be recorded into XLA's CUDA graphs.
#pragma once

#include <string>

namespace freetoken {

// Loads the kernels into CUDA device `ordinal`'s primary context (once; outside any capture) and
// sets their shared memory limit; "" on success, else why they cannot run there.
std::string LoadExpertKernels(int ordinal);

// The most dynamic shared memory a block of the kernels may have on device `ordinal` (0 where
// the kernels are not loaded there).
int ExpertKernelsSharedMemory(int ordinal);

void* Q4GateUpHandlerCuda();
void* Q4DownHandlerCuda();
void* Q4MoeHandlerCuda();

}  // namespace freetoken
