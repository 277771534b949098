// Host->device copies of whole expert banks on streams of their own, as a pair of XLA FFI
// targets, for a prefill that loads layers ahead of its compute.
//
//   buf, token = freetoken_bank_copy_start(dep; handle)
//       buf: the bank's shape and type on the device; token: an int32[1] nothing writes
//   out = freetoken_bank_copy_wait(buf, dep; handle) -> buf (out aliases it)
//
// `start` records an event on XLA's stream (so that whatever used `buf`'s memory before has run),
// makes the copy streams wait for it, enqueues the copy of registered host bank `handle` into
// `buf` (cut into one piece a stream: FREETOKEN_BANK_COPY_STREAMS, 1 by default) and records each
// piece's event; it returns at once. `wait` makes XLA's stream wait for those events. Nothing but
// `wait` may take `buf`; the caller ties the token to what must follow the start (an optimization
// barrier). `dep` orders each call in the program (a copy cannot start before `start`'s dep
// exists, and XLA's stream waits only once `wait`'s dep exists); its value is not read. The
// copies of every `start` run one after another on the copy streams, whatever order XLA's
// schedule gives the compute. CPU handlers copy with memcpy at `start`.
#pragma once

#include <cstddef>
#include <cstdint>

namespace freetoken {

// Registers a bank of `bytes` bytes at host address `ptr` (pinned host memory on a GPU) and
// returns the handle the FFI calls take; the same (ptr, bytes) gets the same handle. The memory
// must outlive every call that uses the handle.
int64_t RegisterHostBank(uintptr_t ptr, int64_t bytes);

// The CUDA starts so far: how many, the host time spent in them (enqueueing should take
// microseconds; a copy from memory the driver must stage blocks the caller for the whole copy),
// and the bytes they copied.
struct BankCopyStats {
  int64_t starts;
  double host_s;
  int64_t bytes;
};
BankCopyStats TakeBankCopyStats(bool reset);

void* BankCopyStartHandlerCpu();
void* BankCopyWaitHandlerCpu();
void* BankCopyStartHandlerCuda();
void* BankCopyWaitHandlerCuda();

}  // namespace freetoken
