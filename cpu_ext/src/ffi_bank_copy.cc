#include "ffi_bank_copy.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "cuda_driver.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace freetoken {
namespace {

constexpr int kMaxStreams = 8;

struct Bank {
  uintptr_t ptr;
  int64_t bytes;
  void* ready = nullptr;  // CUDA events, created at the bank's first copy
  void* done[kMaxStreams] = {};
};

// The copy streams: FREETOKEN_BANK_COPY_STREAMS (1 by default, at most 8); a bank's copy is cut
// into that many pieces, one a stream, so that pieces may run on different copy engines.
int NumStreams() {
  static const int n = [] {
    const char* env = std::getenv("FREETOKEN_BANK_COPY_STREAMS");
    const int v = env ? std::atoi(env) : 1;
    return v < 1 ? 1 : v > kMaxStreams ? kMaxStreams : v;
  }();
  return n;
}

// A bank's copy in NumStreams() pieces of `Piece` bytes (the last shorter), `Pieces` of them: the
// start enqueues them and the wait waits for each.
int64_t Piece(const Bank& b) { return (b.bytes + NumStreams() - 1) / NumStreams(); }
int Pieces(const Bank& b) { return b.bytes == 0 ? 0 : static_cast<int>((b.bytes + Piece(b) - 1) / Piece(b)); }

std::mutex mu;
std::deque<Bank> banks;  // by handle; a deque keeps references stable as it grows
std::map<void*, std::vector<void*>> copy_streams;  // CUDA context -> the bank copies' streams
std::atomic<int64_t> stat_starts{0}, stat_start_ns{0}, stat_bytes{0};  // CUDA starts: calls, host time in them, bytes

int64_t Now() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

ffi::Error Find(int64_t handle, size_t bytes, Bank** out) {
  std::lock_guard<std::mutex> g(mu);
  if (handle < 0 || handle >= static_cast<int64_t>(banks.size()))
    return ffi::Error::InvalidArgument("unknown host bank handle " + std::to_string(handle));
  Bank& b = banks[handle];
  if (static_cast<int64_t>(bytes) != b.bytes)
    return ffi::Error::InvalidArgument("host bank " + std::to_string(handle) + " has " + std::to_string(b.bytes) +
                                       " bytes; the device buffer " + std::to_string(bytes));
  *out = &b;
  return ffi::Error::Success();
}

ffi::Error StartCpu(ffi::AnyBuffer, ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::AnyBuffer>, int64_t handle) {
  Bank* b;
  if (auto e = Find(handle, out->size_bytes(), &b); e.failure()) return e;
  std::memcpy(out->untyped_data(), reinterpret_cast<const void*>(b->ptr), b->bytes);
  return ffi::Error::Success();
}

ffi::Error WaitCpu(ffi::AnyBuffer buf, ffi::AnyBuffer, ffi::Result<ffi::AnyBuffer> out, int64_t handle) {
  Bank* b;
  if (auto e = Find(handle, buf.size_bytes(), &b); e.failure()) return e;
  if (out->untyped_data() != buf.untyped_data()) std::memcpy(out->untyped_data(), buf.untyped_data(), buf.size_bytes());
  return ffi::Error::Success();
}

// The copy streams of the current context (XLA calls handlers with its context current) and the
// bank's events, made on first use.
ffi::Error Prepare(Bank* b, std::vector<void*>** streams) {
  const Cuda& c = Driver();
  if (!c.error.empty()) return ffi::Error::Internal(c.error);
  void* ctx = nullptr;
  if (c.ctx_get_current(&ctx) || !ctx) return ffi::Error::Internal("no current CUDA context in the bank copy");
  std::lock_guard<std::mutex> g(mu);
  std::vector<void*>& s = copy_streams[ctx];
  while (static_cast<int>(s.size()) < NumStreams()) {
    void* st = nullptr;
    if (c.stream_create(&st, /*CU_STREAM_NON_BLOCKING*/ 1)) return ffi::Error::Internal("could not create a bank copy stream");
    s.push_back(st);
  }
  void** events[kMaxStreams + 1] = {&b->ready};
  for (int i = 0; i < NumStreams(); ++i) events[i + 1] = &b->done[i];
  for (int i = 0; i <= NumStreams(); ++i)
    if (!*events[i] && c.event_create(events[i], /*CU_EVENT_DISABLE_TIMING*/ 2)) {
      *events[i] = nullptr;
      return ffi::Error::Internal("could not create a bank copy event");
    }
  *streams = &s;
  return ffi::Error::Success();
}

ffi::Error StartCuda(void* stream, ffi::AnyBuffer, ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::AnyBuffer>, int64_t handle) {
  Bank* b;
  std::vector<void*>* streams;
  if (auto e = Find(handle, out->size_bytes(), &b); e.failure()) return e;
  if (auto e = Prepare(b, &streams); e.failure()) return e;
  const Cuda& c = Driver();
  const int64_t t0 = Now();
  int rc = c.event_record(b->ready, stream);
  const int64_t piece = Piece(*b);
  for (int i = 0; i < Pieces(*b); ++i) {
    const int64_t at = i * piece, len = std::min<int64_t>(piece, b->bytes - at);
    void* s = (*streams)[i];
    rc |= c.stream_wait_event(s, b->ready, 0);
    rc |= c.memcpy_htod(reinterpret_cast<uint64_t>(out->untyped_data()) + at, reinterpret_cast<const void*>(b->ptr + at), len, s);
    rc |= c.event_record(b->done[i], s);
  }
  stat_start_ns += Now() - t0;
  stat_starts += 1;
  stat_bytes += b->bytes;
  if (rc) return ffi::Error::Internal("enqueueing host bank " + std::to_string(handle) + "'s copy failed");
  return ffi::Error::Success();
}

ffi::Error WaitCuda(void* stream, ffi::AnyBuffer buf, ffi::AnyBuffer, ffi::Result<ffi::AnyBuffer> out, int64_t handle) {
  Bank* b;
  if (auto e = Find(handle, buf.size_bytes(), &b); e.failure()) return e;
  if (!b->ready) return ffi::Error::InvalidArgument("host bank " + std::to_string(handle) + " waited for before any copy");
  const Cuda& c = Driver();
  int rc = 0;
  for (int i = 0; i < Pieces(*b); ++i) rc |= c.stream_wait_event(stream, b->done[i], 0);
  if (out->untyped_data() != buf.untyped_data())  // XLA kept the alias apart: copy, after the wait
    rc |= c.memcpy_dtod(reinterpret_cast<uint64_t>(out->untyped_data()), reinterpret_cast<uint64_t>(buf.untyped_data()),
                        buf.size_bytes(), stream);
  if (rc) return ffi::Error::Internal("enqueueing the wait for host bank " + std::to_string(handle) + " failed");
  return ffi::Error::Success();
}

}  // namespace

#define FREETOKEN_START_BINDING(...) \
  ffi::Ffi::Bind() __VA_ARGS__.Arg<ffi::AnyBuffer>().Ret<ffi::AnyBuffer>().Ret<ffi::AnyBuffer>().Attr<int64_t>("handle")
#define FREETOKEN_WAIT_BINDING(...) \
  ffi::Ffi::Bind() __VA_ARGS__.Arg<ffi::AnyBuffer>().Arg<ffi::AnyBuffer>().Ret<ffi::AnyBuffer>().Attr<int64_t>("handle")

XLA_FFI_DEFINE_HANDLER_SYMBOL(FreetokenBankCopyStartCpu, StartCpu, FREETOKEN_START_BINDING());
XLA_FFI_DEFINE_HANDLER_SYMBOL(FreetokenBankCopyWaitCpu, WaitCpu, FREETOKEN_WAIT_BINDING());
XLA_FFI_DEFINE_HANDLER_SYMBOL(FreetokenBankCopyStartCuda, StartCuda, FREETOKEN_START_BINDING(.Ctx<ffi::PlatformStream<void*>>()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(FreetokenBankCopyWaitCuda, WaitCuda, FREETOKEN_WAIT_BINDING(.Ctx<ffi::PlatformStream<void*>>()));

int64_t RegisterHostBank(uintptr_t ptr, int64_t bytes) {
  std::lock_guard<std::mutex> g(mu);
  for (size_t i = 0; i < banks.size(); ++i)
    if (banks[i].ptr == ptr && banks[i].bytes == bytes) return static_cast<int64_t>(i);
  banks.push_back(Bank{ptr, bytes});
  return static_cast<int64_t>(banks.size()) - 1;
}

BankCopyStats TakeBankCopyStats(bool reset) {
  BankCopyStats s{stat_starts.load(), stat_start_ns.load() * 1e-9, stat_bytes.load()};
  if (reset) {
    stat_starts = 0;
    stat_start_ns = 0;
    stat_bytes = 0;
  }
  return s;
}

void* BankCopyStartHandlerCpu() { return reinterpret_cast<void*>(&FreetokenBankCopyStartCpu); }
void* BankCopyWaitHandlerCpu() { return reinterpret_cast<void*>(&FreetokenBankCopyWaitCpu); }
void* BankCopyStartHandlerCuda() { return reinterpret_cast<void*>(&FreetokenBankCopyStartCuda); }
void* BankCopyWaitHandlerCuda() { return reinterpret_cast<void*>(&FreetokenBankCopyWaitCuda); }

}  // namespace freetoken
