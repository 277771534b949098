// The split handoff from a jitted XLA program to the CPU expert executor, as XLA FFI targets.
//
//   token = freetoken_moe_submit(packed f32[T*(H+2K+1)]; handle, tokens=T, top_k=K)
//   out   = freetoken_moe_wait(token; handle, top_k=K) -> f32[T,H]
//
// `packed` is x [T,H], ids [T,K] (int32 bits), w [T,K] and valid [T] (int32 bits) end to end,
// so the input crosses to the host in one copy. `submit` copies it into a staging job and posts the job to the dispatcher thread, which
// runs the MoE executor on the layer's host banks; it returns at once. `wait` blocks until that
// job is done and copies the result out. Work placed between the two (in the program's order,
// which the caller fixes with optimization barriers) runs while the CPU computes.
//
// CUDA handlers enqueue everything on XLA's stream: the device-to-host copy into pinned staging,
// a host function that posts the job, and — for `wait` — a host function that blocks the stream
// until the job is done followed by the host-to-device copy. The CUDA driver API is reached
// through dlopen("libcuda.so.1"), so the module builds without CUDA and runs on any machine.
// CPU handlers do the same with plain copies. Entries with w == 0 or valid == 0 are skipped
// (those the GPU computes, padding).
#pragma once

#include <cstdint>

#include "moe_executor.h"

namespace freetoken {

// Registers one MoE layer (its executor, banks and activation) and returns the handle that
// the FFI calls take as their `handle` attribute. The banks must outlive every call.
int64_t RegisterHandoffLayer(MoeExecutor* executor, const Banks& banks, Act act);

// Handoff timing summed over calls (seconds): `window` from the stream reaching submit to it
// leaving wait, `gpu` from submit to the stream reaching wait, `cpu` from submit to the job's
// end; `ideal` sums max(gpu, cpu) per call, so window - ideal is the handoff's exposed latency.
struct HandoffStats {
  int64_t count;
  double window, gpu, cpu, ideal;
};
HandoffStats TakeHandoffStats(bool reset);

// XLA FFI handler entry points (XLA_FFI_Handler*), for jax.ffi.register_ffi_target.
void* SubmitHandlerCpu();
void* WaitHandlerCpu();
void* SubmitHandlerCuda();
void* WaitHandlerCuda();

}  // namespace freetoken
