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
// A dispatcher thread runs the jobs in the order they were enqueued. Each staging job has three
// flags in mapped host memory holding handoff sequence numbers: ready (inputs staged), arrived
// (the stream reached wait), done (result staged). CUDA handlers enqueue everything on XLA's
// stream: `submit` the device-to-host copy into pinned staging and a write of `ready`; `wait` a
// write of `arrived`, a wait until `done` and the host-to-device copy. The writes and the wait
// are host functions on the stream, or with FREETOKEN_HANDOFF_SYNC=stream_memops (where the
// driver has them) stream memory operations (cuStreamWriteValue32 / cuStreamWaitValue32: no
// host thread in the loop).
// FREETOKEN_HANDOFF_TRACE=N prints the dispatcher's first N events to stderr. The CUDA driver API is reached
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

// Handoff timing summed over calls (seconds), as the dispatcher sees it: `cpu` from the inputs
// being staged to the job's end, `gpu` to the stream reaching wait (seen only once the job has
// ended: when the stream came first, this equals cpu), `window` the larger of the two. The
// handoff's own cost is not in these; measure it end to end (a step with empty jobs).
// `unseen` counts handoffs whose arrival at wait was not seen within 50 ms of the job's end.
struct HandoffStats {
  int64_t count;
  double window, gpu, cpu;
  int64_t unseen;
};
HandoffStats TakeHandoffStats(bool reset);

// How CUDA handlers signal: host functions (default) or stream memory operations (where the
// driver has them). Switch only while no handoff is in flight.
enum { kSyncStreamMemOps = 0, kSyncHostFunction = 1 };
int HandoffSync();
void SetHandoffSync(int mode);

// XLA FFI handler entry points (XLA_FFI_Handler*), for jax.ffi.register_ffi_target.
void* SubmitHandlerCpu();
void* WaitHandlerCpu();
void* SubmitHandlerCuda();
void* WaitHandlerCuda();

}  // namespace freetoken
