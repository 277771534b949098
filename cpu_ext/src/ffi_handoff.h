// The split handoff from a jitted XLA program to the CPU expert executor, as XLA FFI targets.
//
//   token = freetoken_moe_submit(packed f32[T*(H+2K+1)]; handle, tokens=T, top_k=K)
//   out   = freetoken_moe_wait(token; handle, top_k=K) -> f32[T,H]
//
// `packed` is x [T,H], ids [T,K] (int32 bits), w [T,K] and valid [T] (int32 bits) end to end,
// so the input crosses to the host in one copy. `submit` copies it into the layer's staging job
// and signals that it is staged; it returns at once. `wait` blocks until the job is done and
// copies the result out. Work placed between the two (in the program's order, which the caller
// fixes with optimization barriers) runs while the CPU computes.
//
// A dispatcher thread watches every staging job's flags in mapped host memory: ready (inputs
// staged), arrived (the stream reached wait), done (result staged), each 0 or 1. It runs a job
// on the layer's host banks with the MoE executor as soon as its inputs are staged. CUDA
// handlers only enqueue work on XLA's stream, the same at every call, so XLA may record them into
// its CUDA graphs: `submit` the device-to-host copy into pinned staging and `ready = 1`; `wait`
// `arrived = 1`, a wait until `done == 1`, `done = 0` and the host-to-device copy. By default one
// kernel a side does that (for a job of up to 64 KB each way, the copy included; a larger job's
// data moves by copies on the stream); with FREETOKEN_HANDOFF_SYNC=stream_memops the flags are
// stream memory operations (cuStreamWriteValue32 / cuStreamWaitValue32) beside the copies, with
// FREETOKEN_HANDOFF_SYNC=host_function host functions on the stream.
// FREETOKEN_HANDOFF_TRACE=N prints the dispatcher's first N events to stderr. The CUDA driver API
// is reached through dlopen("libcuda.so.1"), so the module builds without CUDA and runs on any
// machine. CPU handlers do the same with plain copies. Entries with w == 0 or valid == 0 are
// skipped (those the GPU computes, padding).
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

// How CUDA handlers signal: signalling kernels (the default where the driver launches them;
// for a job of up to 64 KB each way they also move its input and result: one kernel a side),
// stream memory operations, or host functions. Switch only while no handoff is in flight;
// graphs already recorded keep the operations they were recorded with (all work with the same
// flags); kernels are loaded by `PrepareHandoffJob`, so switch to them before preparing jobs.
enum { kSyncStreamMemOps = 0, kSyncHostFunction = 1, kSyncKernel = 2 };
int HandoffSync();
void SetHandoffSync(int mode);

// Creates the staging job of (layer `handle`, `tokens`, `top_k`) ahead of the calls: a handler
// recorded into a CUDA graph must not allocate. `cuda_ordinal` is the CUDA device whose
// primary context allocates its pinned memory, or -1 for a CPU-backend job. Throws on error.
void PrepareHandoffJob(int64_t handle, int64_t tokens, int64_t top_k, int cuda_ordinal);

// XLA FFI handler entry points (XLA_FFI_Handler*), for jax.ffi.register_ffi_target; the
// `Graph` CUDA handlers carry the command-buffer-compatible trait (XLA records them into its
// CUDA graphs), the others do not (XLA launches the graph pieces around them one by one).
void* SubmitHandlerCpu();
void* WaitHandlerCpu();
void* SubmitHandlerCuda();
void* WaitHandlerCuda();
void* SubmitHandlerCudaGraph();
void* WaitHandlerCudaGraph();

}  // namespace freetoken
