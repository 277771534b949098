#include "ffi_handoff.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstddef>
#include <cstdlib>
#include <new>
#include <stdexcept>
#include <cstring>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "cuda_driver.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace freetoken {
namespace {

// How a CUDA stream and the dispatcher signal each other: kernels that write the flag and spin
// on it, moving a decode-sized job's input and result too (the default where the driver loads
// modules and launches kernels: on the H200 they took hybrid decode from 164.9 to 176.5 tok/s,
// benchmarks/RESULTS.md 2026-12-04), stream memory operations (FREETOKEN_HANDOFF_SYNC=
// stream_memops: the stream writes a flag in mapped host memory and waits for one, beside copies
// on the stream), or host functions launched on the stream (FREETOKEN_HANDOFF_SYNC=host_function).
// All follow the same flag protocol, so graphs recorded in one mode stay correct after
// `SetHandoffSync` switches.
std::atomic<int> sync_mode{-1};  // -1: not chosen yet

bool HasStreamMemOps() {
  const Cuda& c = Driver();
  return c.error.empty() && c.write_value32 && c.wait_value32;
}

bool HasKernelLaunch() {
  const Cuda& c = Driver();
  return c.error.empty() && c.module_load_data && c.module_get_function && c.launch_kernel;
}

int SyncMode() {
  int m = sync_mode.load(std::memory_order_relaxed);
  if (m >= 0) return m;
  const std::string env = std::getenv("FREETOKEN_HANDOFF_SYNC") ? std::getenv("FREETOKEN_HANDOFF_SYNC") : "";
  m = env == "host_function"                          ? kSyncHostFunction
      : env == "stream_memops" && HasStreamMemOps()    ? kSyncStreamMemOps
      : HasKernelLaunch()                              ? kSyncKernel
      : HasStreamMemOps()                              ? kSyncStreamMemOps
                                                       : kSyncHostFunction;
  sync_mode.store(m, std::memory_order_relaxed);
  return m;
}

// The kernels of kSyncKernel, in PTX (the module is built without CUDA; the driver compiles it
// for the device when it is loaded). Where a job's input and result are small (kKernelCopyBytes),
// one kernel a side moves them too, through the staging buffers' mapped device addresses: one
// node in the graph instead of a copy and one to three memory operations, each with a latency of
// its own.
//   ft_handoff_submit(src, dst, n, ready), one block: the n 32-bit words at device address src
//     stored into the staging buffer dst; then, after every thread's system-scope fence and the
//     block's barrier, ready = 1;
//   ft_handoff_collect(arrived, done, src, dst, n), one block: thread 0 writes arrived = 1 and
//     spins until done == 1; after the barrier every thread loads its share of the n result words
//     from the staging buffer src (system-scope loads, four in flight a thread) into device
//     address dst; thread 0 then writes done = 0;
// and, one thread each, for larger jobs (whose data a copy moves on the stream before or after):
//   ft_handoff_ready(ready): after a system-scope fence, ready = 1 (the stream's copy of the
//     inputs precedes it in stream order);
//   ft_handoff_wait(arrived, done): arrived = 1; spins until done == 1; done = 0.
constexpr char kSignalPtx[] = R"(.version 7.0
.target sm_70
.address_size 64
.visible .entry ft_handoff_submit(.param .u64 src, .param .u64 dst, .param .u64 n, .param .u64 ready)
{
  .reg .u64 %rd<10>;
  .reg .u32 %r<5>;
  .reg .pred %p<3>;
  ld.param.u64 %rd1, [src];
  ld.param.u64 %rd2, [dst];
  ld.param.u64 %rd3, [n];
  ld.param.u64 %rd4, [ready];
  mov.u32 %r1, %tid.x;
  mov.u32 %r2, %ntid.x;
  cvt.u64.u32 %rd5, %r1;
  cvt.u64.u32 %rd6, %r2;
COPY:
  setp.ge.u64 %p1, %rd5, %rd3;
  @%p1 bra COPIED;
  shl.b64 %rd7, %rd5, 2;
  add.u64 %rd8, %rd1, %rd7;
  ld.global.u32 %r3, [%rd8];
  add.u64 %rd9, %rd2, %rd7;
  st.global.u32 [%rd9], %r3;
  add.u64 %rd5, %rd5, %rd6;
  bra COPY;
COPIED:
  fence.sc.sys;
  bar.sync 0;
  setp.ne.u32 %p2, %r1, 0;
  @%p2 bra END;
  mov.u32 %r4, 1;
  st.volatile.global.u32 [%rd4], %r4;
  fence.sc.sys;
END:
  ret;
}
.visible .entry ft_handoff_collect(.param .u64 arrived, .param .u64 done, .param .u64 src, .param .u64 dst, .param .u64 n)
{
  .reg .u64 %rd<24>;
  .reg .u32 %r<12>;
  .reg .pred %p<8>;
  ld.param.u64 %rd1, [arrived];
  ld.param.u64 %rd2, [done];
  ld.param.u64 %rd3, [src];
  ld.param.u64 %rd4, [dst];
  ld.param.u64 %rd5, [n];
  mov.u32 %r1, %tid.x;
  mov.u32 %r2, %ntid.x;
  setp.ne.u32 %p1, %r1, 0;
  @%p1 bra SYNCED;
  mov.u32 %r3, 1;
  st.volatile.global.u32 [%rd1], %r3;
  fence.sc.sys;
SPIN:
  ld.volatile.global.u32 %r4, [%rd2];
  setp.ne.u32 %p2, %r4, 1;
  @%p2 nanosleep.u32 100;
  @%p2 bra SPIN;
  fence.sc.sys;
SYNCED:
  bar.sync 0;
  cvt.u64.u32 %rd6, %r1;
  cvt.u64.u32 %rd7, %r2;
LOOP:
  setp.ge.u64 %p3, %rd6, %rd5;
  @%p3 bra COPIED;
  add.u64 %rd8, %rd6, %rd7;
  add.u64 %rd9, %rd8, %rd7;
  add.u64 %rd10, %rd9, %rd7;
  setp.lt.u64 %p4, %rd8, %rd5;
  setp.lt.u64 %p5, %rd9, %rd5;
  setp.lt.u64 %p6, %rd10, %rd5;
  shl.b64 %rd11, %rd6, 2;
  shl.b64 %rd12, %rd8, 2;
  shl.b64 %rd13, %rd9, 2;
  shl.b64 %rd14, %rd10, 2;
  add.u64 %rd15, %rd3, %rd11;
  add.u64 %rd16, %rd3, %rd12;
  add.u64 %rd17, %rd3, %rd13;
  add.u64 %rd18, %rd3, %rd14;
  ld.relaxed.sys.global.u32 %r5, [%rd15];
  @%p4 ld.relaxed.sys.global.u32 %r6, [%rd16];
  @%p5 ld.relaxed.sys.global.u32 %r7, [%rd17];
  @%p6 ld.relaxed.sys.global.u32 %r8, [%rd18];
  add.u64 %rd15, %rd4, %rd11;
  add.u64 %rd16, %rd4, %rd12;
  add.u64 %rd17, %rd4, %rd13;
  add.u64 %rd18, %rd4, %rd14;
  st.global.u32 [%rd15], %r5;
  @%p4 st.global.u32 [%rd16], %r6;
  @%p5 st.global.u32 [%rd17], %r7;
  @%p6 st.global.u32 [%rd18], %r8;
  add.u64 %rd6, %rd10, %rd7;
  bra LOOP;
COPIED:
  @%p1 bra END;
  mov.u32 %r9, 0;
  st.volatile.global.u32 [%rd2], %r9;
  fence.sc.sys;
END:
  ret;
}
.visible .entry ft_handoff_ready(.param .u64 ready)
{
  .reg .u64 %rd<2>;
  .reg .u32 %r<2>;
  ld.param.u64 %rd1, [ready];
  mov.u32 %r1, 1;
  fence.sc.sys;
  st.volatile.global.u32 [%rd1], %r1;
  ret;
}
.visible .entry ft_handoff_wait(.param .u64 arrived, .param .u64 done)
{
  .reg .u64 %rd<3>;
  .reg .u32 %r<3>;
  .reg .pred %p<2>;
  ld.param.u64 %rd1, [arrived];
  ld.param.u64 %rd2, [done];
  mov.u32 %r1, 1;
  st.volatile.global.u32 [%rd1], %r1;
  fence.sc.sys;
SPIN:
  ld.volatile.global.u32 %r2, [%rd2];
  setp.ne.u32 %p1, %r2, 1;
  @%p1 nanosleep.u32 100;
  @%p1 bra SPIN;
  fence.sc.sys;
  mov.u32 %r1, 0;
  st.volatile.global.u32 [%rd2], %r1;
  fence.sc.sys;
  ret;
}
)";

struct SignalKernels {
  void* ready = nullptr;
  void* wait = nullptr;
  void* submit = nullptr;   // with the input's copy
  void* collect = nullptr;  // with the result's copy
};
// Jobs whose input and result each take at most this many bytes move them in the signalling
// kernels (kSyncKernel); larger ones by copies on the stream (a block's loads from host memory
// take a PCIe round trip per four words a thread).
constexpr int64_t kKernelCopyBytes = 64 << 10;
constexpr unsigned kKernelCopyThreads = 512;
PerContext<SignalKernels> signal_kernels;

// Loads the signalling kernels into the current context (once); outside any stream capture.
std::string LoadSignalKernels() {
  if (!HasKernelLaunch()) return "the CUDA driver lacks cuModuleLoadData / cuLaunchKernel";
  return signal_kernels.Load([](void*, SignalKernels* k) -> std::string {
    const Cuda& c = Driver();
    void* module = nullptr;
    if (c.module_load_data(&module, kSignalPtx) || c.module_get_function(&k->ready, module, "ft_handoff_ready") ||
        c.module_get_function(&k->wait, module, "ft_handoff_wait") || c.module_get_function(&k->submit, module, "ft_handoff_submit") ||
        c.module_get_function(&k->collect, module, "ft_handoff_collect"))
      return "loading the handoff's signalling kernels failed";
    return "";
  });
}

// Launches signalling kernel `which` of the current context on `stream`: one block of `threads`.
ffi::Error LaunchSignal(void* SignalKernels::*which, void* stream, std::initializer_list<uint64_t> args, unsigned threads = 1) {
  const SignalKernels* k = signal_kernels.Current();
  if (!k) return ffi::Error::Internal("FREETOKEN_HANDOFF_SYNC=kernel: the signalling kernels were not loaded in this CUDA context");
  uint64_t values[5] = {0, 0, 0, 0, 0};
  void* params[5] = {&values[0], &values[1], &values[2], &values[3], &values[4]};
  size_t i = 0;
  for (uint64_t a : args) values[i++] = a;
  if (Driver().launch_kernel(k->*which, 1, 1, 1, threads, 1, 1, 0, stream, params, nullptr))
    return ffi::Error::Internal("launching the handoff's signalling kernel failed");
  return ffi::Error::Success();
}

// ---------------------------------------------------------------------------------------------
// Layers, jobs and the dispatcher thread.

struct Layer {
  MoeExecutor* executor;
  Banks banks;
  Act act;
};

// Flags in (mapped) host memory, each on its own cache line, each 0 or 1: `ready` (the inputs
// are staged), `arrived` (the stream reached wait), `done` (the result is staged). The stream
// writes only constants, so what it enqueues is the same at every call and may be recorded once
// into a CUDA graph and replayed:
//   stream: copy inputs out; ready = 1  ...  arrived = 1; wait until done == 1; done = 0; copy result in
//   dispatcher: sees ready == 1; ready = 0; runs the job; done = 1
// ready = 0 is written before done = 1, and the stream writes the next ready = 1 only after it
// has seen done == 1, so no handoff is lost or run twice.
struct Flags {
  alignas(64) volatile uint32_t ready;
  alignas(64) volatile uint32_t arrived;
  alignas(64) volatile uint32_t done;
};

// One staging job per (layer, T, K). A layer's submit/wait pairs follow one another in stream
// order (each wait blocks until its job is done), so one job per shape is never in flight twice.
struct Job {
  const Layer* layer = nullptr;
  int64_t T = 0, K = 0;
  float* x = nullptr;       // [T, H]
  int32_t* ids = nullptr;   // [T, K]
  float* w = nullptr;       // [T, K]
  int32_t* valid = nullptr; // [T]
  float* out = nullptr;     // [T, H]
  Flags* flags = nullptr;
  uint64_t flags_device = 0;  // the flags' device address (CUDA)
  uint64_t x_device = 0, out_device = 0;  // the staged input's and result's device addresses (CUDA)
  bool cuda = false;          // a CUDA job's errors can only be printed (its wait has returned)
  std::vector<int32_t> token_of, expert_of;
  std::vector<float> weight_of;
  std::mutex mu;
  std::condition_variable cv;
  std::string error;
};

int64_t NowNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// Per-handoff timing, summed, from the dispatcher's view: from seeing the inputs staged to the
// job's end (cpu), to seeing the stream reach wait (gpu; seen only once the job has ended, so
// when the stream came first this is the cpu time), and the larger of the two (window).
std::atomic<int64_t> stat_count{0}, stat_window{0}, stat_gpu{0}, stat_cpu{0}, stat_unseen{0};

std::mutex registry_mu;
std::vector<std::unique_ptr<Layer>> layers;
std::map<std::tuple<int64_t, int64_t, int64_t, bool>, std::unique_ptr<Job>> jobs;
std::vector<Job*> job_list;              // every job, in creation order (jobs are never freed)
std::atomic<uint64_t> job_list_version{0};

void RunJob(Job* j) {
  const Layer& l = *j->layer;
  const int64_t H = l.banks.hidden, E = l.banks.experts;
  j->token_of.clear();
  j->expert_of.clear();
  j->weight_of.clear();
  j->error.clear();
  for (int64_t t = 0; t < j->T; ++t) {
    if (!j->valid[t]) continue;
    for (int64_t k = 0; k < j->K; ++k) {
      const float w = j->w[t * j->K + k];
      const int32_t e = j->ids[t * j->K + k];
      if (w == 0.0f) continue;
      if (e < 0 || e >= E) {
        j->error = "expert id " + std::to_string(e) + " out of range";
        continue;
      }
      j->token_of.push_back(static_cast<int32_t>(t));
      j->expert_of.push_back(e);
      j->weight_of.push_back(w);
    }
  }
  std::memset(j->out, 0, sizeof(float) * j->T * H);
  if (!j->token_of.empty()) {
    try {
      l.executor->Run(j->x, j->T, j->token_of.data(), j->expert_of.data(), j->weight_of.data(),
                      static_cast<int64_t>(j->token_of.size()), l.banks, l.act, j->out);
    } catch (const std::exception& e) {
      j->error = e.what();
    }
  }
  if (j->cuda && !j->error.empty()) std::fprintf(stderr, "freetoken_jax CPU expert job failed: %s\n", j->error.c_str());
}

void Pause() {
#if defined(__x86_64__)
  _mm_pause();
#endif
}

// FREETOKEN_HANDOFF_TRACE=N prints the first N dispatcher events (run, arrival) to stderr.
int64_t TraceLimit() {
  static const int64_t limit = [] {
    const char* env = std::getenv("FREETOKEN_HANDOFF_TRACE");
    return env ? std::max<int64_t>(0, std::atoll(env)) : int64_t{0};
  }();
  return limit;
}

void Trace(const char* what, const Job* j, int64_t a = 0, int64_t b = 0) {
  static std::atomic<int64_t> printed{0};
  if (TraceLimit() == 0 || printed.fetch_add(1) >= TraceLimit()) return;
  std::fprintf(stderr, "[handoff %.6f] %s job=%p T=%lld K=%lld ready=%u arrived=%u done=%u %lld %lld\n", NowNs() * 1e-9, what,
               static_cast<const void*>(j), static_cast<long long>(j->T), static_cast<long long>(j->K), j->flags->ready,
               j->flags->arrived, j->flags->done, static_cast<long long>(a), static_cast<long long>(b));
}

// Watches every job's `ready` flag and runs a job as soon as its inputs are staged (one stream
// stages one at a time); then notes when the stream reaches wait, for the timing, without
// holding up the next job. It spins while handoffs come, polls every 50 us after 5 ms without
// one and every 500 us after a second (or at once when a handler kicks it).
class Dispatcher {
 public:
  static Dispatcher& Get() {
    static Dispatcher* d = new Dispatcher;  // never destroyed: XLA may call in at exit
    return *d;
  }
  void Kick() {
    kicked_.store(true, std::memory_order_release);
    cv_.notify_one();
  }

 private:
  struct Ran {
    Job* j;
    int64_t t_ready, t_done;
    bool checked;  // arrival looked for once: seen later means the stream came after the job
  };

  Dispatcher() { std::thread([this] { Loop(); }).detach(); }

  void Loop() {
    std::vector<Job*> watched;
    uint64_t version = ~uint64_t{0};
    std::vector<Ran> ran;
    int64_t idle_since = NowNs();
    for (;;) {
      if (job_list_version.load(std::memory_order_acquire) != version) {
        std::lock_guard<std::mutex> g(registry_mu);
        watched = job_list;
        version = job_list_version.load(std::memory_order_relaxed);
      }
      bool progress = false;
      for (Job* j : watched) {
        if (j->flags->ready != 1) continue;
        std::atomic_thread_fence(std::memory_order_acquire);
        j->flags->ready = 0;
        const int64_t t_ready = NowNs();
        RunJob(j);
        const int64_t t_done = NowNs();
        {
          std::lock_guard<std::mutex> g(j->mu);
          std::atomic_thread_fence(std::memory_order_release);
          j->flags->done = 1;
        }
        j->cv.notify_all();
        ran.push_back({j, t_ready, t_done, false});
        Trace("ran (items, us)", j, static_cast<int64_t>(j->token_of.size()), (t_done - t_ready) / 1000);
        progress = true;
      }
      const int64_t now = NowNs();
      for (size_t i = 0; i < ran.size();) {
        Ran& r = ran[i];
        const bool seen = r.j->flags->arrived == 1;
        if (seen || now - r.t_done > 50'000'000) {
          const int64_t t_arrived = !seen ? r.t_done : r.checked ? now : r.t_done;
          if (seen) r.j->flags->arrived = 0;
          else stat_unseen.fetch_add(1, std::memory_order_relaxed);
          Trace(seen ? "arrived (gpu us, cpu us)" : "arrival unseen", r.j, (t_arrived - r.t_ready) / 1000, (r.t_done - r.t_ready) / 1000);
          stat_count.fetch_add(1, std::memory_order_relaxed);
          stat_cpu.fetch_add(r.t_done - r.t_ready, std::memory_order_relaxed);
          stat_gpu.fetch_add(t_arrived - r.t_ready, std::memory_order_relaxed);
          stat_window.fetch_add(std::max(t_arrived, r.t_done) - r.t_ready, std::memory_order_relaxed);
          ran.erase(ran.begin() + static_cast<std::ptrdiff_t>(i));
          progress = true;
          continue;
        }
        r.checked = true;
        ++i;
      }
      if (progress || kicked_.exchange(false, std::memory_order_acq_rel)) {
        idle_since = now;
      } else if (now - idle_since < 5'000'000 || !ran.empty()) {
        Pause();
      } else {
        std::unique_lock<std::mutex> g(mu_);
        cv_.wait_for(g, std::chrono::microseconds(now - idle_since > 1'000'000'000 ? 500 : 50),
                     [&] { return kicked_.load(std::memory_order_acquire); });
      }
    }
  }
  std::mutex mu_;
  std::condition_variable cv_;
  std::atomic<bool> kicked_{false};
};

// Host functions on the stream (FREETOKEN_HANDOFF_SYNC=host_function), and the CPU backend's
// handlers: the flags written and awaited by host code.
void MarkReady(void* job) {
  Job* j = static_cast<Job*>(job);
  std::atomic_thread_fence(std::memory_order_release);
  j->flags->ready = 1;
}

void Await(void* job) {
  Job* j = static_cast<Job*>(job);
  j->flags->arrived = 1;
  const int64_t t0 = NowNs();
  for (int i = 0; j->flags->done != 1; ++i) {
    Pause();
    if ((i & 255) == 0 && NowNs() - t0 > 2'000'000) {  // then sleep until the dispatcher notifies
      std::unique_lock<std::mutex> g(j->mu);
      for (int waited = 30; !j->cv.wait_for(g, std::chrono::seconds(30), [&] { return j->flags->done == 1; }); waited += 30)
        std::fprintf(stderr, "freetoken_jax: the stream has waited %d s for CPU expert job %p (ready=%u done=%u)\n", waited,
                     static_cast<void*>(j), j->flags->ready, j->flags->done);
      break;
    }
  }
  std::atomic_thread_fence(std::memory_order_acquire);
  j->flags->done = 0;
}

const Layer* FindLayer(int64_t handle) {
  std::lock_guard<std::mutex> g(registry_mu);
  if (handle < 0 || handle >= static_cast<int64_t>(layers.size())) return nullptr;
  return layers[handle].get();
}

// The staging job of (layer, T, K): its buffers and flags in pinned, mapped host memory for
// CUDA, plain memory on the CPU. Checks the packed input's length against the layer's banks.
// Created by `PrepareHandoffJob` ahead of the calls (a handler recorded into a CUDA graph must
// not allocate), or else by the first call.
ffi::Error GetJob(int64_t handle, int64_t T, int64_t K, bool cuda, Job** out, int64_t packed_count = -1) {
  const Layer* layer = FindLayer(handle);
  if (!layer) return ffi::Error::InvalidArgument("unknown handoff layer handle " + std::to_string(handle));
  if (T <= 0 || K <= 0) return ffi::Error::InvalidArgument("tokens and top_k must be positive");
  const int64_t H = layer->banks.hidden;
  if (packed_count >= 0 && packed_count != T * (H + 2 * K + 1))
    return ffi::Error::InvalidArgument("packed input length is not tokens * (hidden + 2 * top_k + 1): x's width differs from the banks'");
  std::lock_guard<std::mutex> g(registry_mu);
  auto& slot = jobs[{handle, T, K, cuda}];
  *out = slot.get();
  if (slot) return ffi::Error::Success();
  const size_t flags_at = (sizeof(float) * (2 * T * H + 2 * T * K + T) + 63) / 64 * 64;  // the buffers, then the flags
  const size_t bytes = flags_at + sizeof(Flags);
  void* mem = nullptr;
  uint64_t device = 0;
  if (cuda) {
    const Cuda& c = Driver();
    if (!c.error.empty()) return ffi::Error::Internal(c.error);
    if (c.mem_host_alloc(&mem, bytes, /*CU_MEMHOSTALLOC_PORTABLE | CU_MEMHOSTALLOC_DEVICEMAP*/ 3) != 0)
      return ffi::Error::Internal("cuMemHostAlloc of " + std::to_string(bytes) + " bytes failed");
    if (c.host_device_pointer(&device, mem, 0) != 0) return ffi::Error::Internal("cuMemHostGetDevicePointer failed");
  } else {
    mem = ::operator new(bytes, std::align_val_t(64));
  }
  auto job = std::make_unique<Job>();
  job->layer = layer;
  job->T = T;
  job->K = K;
  job->cuda = cuda;
  char* p = static_cast<char*>(mem);
  auto take = [&](auto*& field, size_t count) {
    field = reinterpret_cast<std::remove_reference_t<decltype(field)>>(p);
    p += count * 4;
  };
  take(job->x, T * H);  // x, ids, w, valid: one contiguous block, the layout of the packed input
  take(job->ids, T * K);
  take(job->w, T * K);
  take(job->valid, T);
  take(job->out, T * H);
  job->flags = new (static_cast<char*>(mem) + flags_at) Flags{0, 0, 0};
  job->flags_device = device ? device + flags_at : 0;
  job->x_device = device;
  job->out_device = device ? device + (reinterpret_cast<char*>(job->out) - static_cast<char*>(mem)) : 0;
  slot = std::move(job);
  *out = slot.get();
  job_list.push_back(*out);
  job_list_version.fetch_add(1, std::memory_order_release);
  return ffi::Error::Success();
}

uint64_t FlagAddress(const Job* j, size_t offset) { return j->flags_device + offset; }

// Whether a job's signalling kernels move its input and result themselves (kSyncKernel).
bool KernelCopies(const Job* j) {
  // the packed input (x, ids, w, valid) is the larger way: T · (H + 2K + 1) words against T · H
  return j->x_device && 4 * j->T * (j->layer->banks.hidden + 2 * j->K + 1) <= kKernelCopyBytes;
}

// ---------------------------------------------------------------------------------------------
// Handlers. `packed` is x [T*H], ids [T*K] (int32 bits), w [T*K], valid [T] (int32 bits), as
// one float32 vector, so that it crosses to the host in one copy.

ffi::Error SubmitCpu(ffi::Buffer<ffi::F32> packed, ffi::ResultBuffer<ffi::S32> token, int64_t handle, int64_t T, int64_t K) {
  Job* j;
  if (auto e = GetJob(handle, T, K, false, &j, packed.element_count()); e.failure()) return e;
  std::memcpy(j->x, packed.typed_data(), packed.size_bytes());
  token->typed_data()[0] = 0;
  MarkReady(j);
  Dispatcher::Get().Kick();
  return ffi::Error::Success();
}

ffi::Error WaitCpu(ffi::Buffer<ffi::S32>, ffi::ResultBuffer<ffi::F32> out, int64_t handle, int64_t K) {
  Job* j;
  if (auto e = GetJob(handle, out->dimensions()[0], K, false, &j); e.failure()) return e;
  Await(j);
  if (!j->error.empty()) return ffi::Error::Internal("CPU expert job failed: " + j->error);
  std::memcpy(out->typed_data(), j->out, out->size_bytes());
  return ffi::Error::Success();
}

// The CUDA handlers only enqueue work on the stream (fixed per job: recordable into a graph).
ffi::Error SubmitCuda(void* stream, ffi::Buffer<ffi::F32> packed, ffi::ResultBuffer<ffi::S32>, int64_t handle, int64_t T, int64_t K) {
  Job* j;
  if (auto e = GetJob(handle, T, K, true, &j, packed.element_count()); e.failure()) return e;
  const Cuda& c = Driver();
  const int mode = SyncMode();
  if (mode == kSyncKernel && KernelCopies(j)) {
    auto e = LaunchSignal(&SignalKernels::submit, stream,
                          {reinterpret_cast<uint64_t>(packed.untyped_data()), j->x_device, static_cast<uint64_t>(packed.element_count()),
                           FlagAddress(j, offsetof(Flags, ready))},
                          kKernelCopyThreads);
    if (e.failure()) return e;
    Dispatcher::Get().Kick();
    return ffi::Error::Success();
  }
  int rc = c.memcpy_dtoh(j->x, reinterpret_cast<uint64_t>(packed.untyped_data()), packed.size_bytes(), stream);
  if (mode == kSyncStreamMemOps) {
    rc |= c.write_value32(stream, FlagAddress(j, offsetof(Flags, ready)), 1, 0);  // ordered after the copy, with a fence
  } else if (mode == kSyncKernel) {
    if (auto e = LaunchSignal(&SignalKernels::ready, stream, {FlagAddress(j, offsetof(Flags, ready))}); e.failure()) return e;
  } else {
    rc |= c.launch_host_func(stream, MarkReady, j);
  }
  if (rc) return ffi::Error::Internal("enqueueing the CPU expert job on the stream failed");
  Dispatcher::Get().Kick();
  return ffi::Error::Success();
}

ffi::Error WaitCuda(void* stream, ffi::Buffer<ffi::S32>, ffi::ResultBuffer<ffi::F32> out, int64_t handle, int64_t K) {
  Job* j;
  if (auto e = GetJob(handle, out->dimensions()[0], K, true, &j); e.failure()) return e;
  const Cuda& c = Driver();
  int rc = 0;
  const int mode = SyncMode();
  if (mode == kSyncKernel && KernelCopies(j))
    return LaunchSignal(&SignalKernels::collect, stream,
                        {FlagAddress(j, offsetof(Flags, arrived)), FlagAddress(j, offsetof(Flags, done)), j->out_device,
                         reinterpret_cast<uint64_t>(out->untyped_data()), static_cast<uint64_t>(out->element_count())},
                        kKernelCopyThreads);
  if (mode == kSyncStreamMemOps) {
    rc |= c.write_value32(stream, FlagAddress(j, offsetof(Flags, arrived)), 1, 0);
    rc |= c.wait_value32(stream, FlagAddress(j, offsetof(Flags, done)), 1, /*CU_STREAM_WAIT_VALUE_EQ*/ 1);
    rc |= c.write_value32(stream, FlagAddress(j, offsetof(Flags, done)), 0, 0);
  } else if (mode == kSyncKernel) {
    if (auto e = LaunchSignal(&SignalKernels::wait, stream, {FlagAddress(j, offsetof(Flags, arrived)), FlagAddress(j, offsetof(Flags, done))});
        e.failure())
      return e;
  } else {
    rc |= c.launch_host_func(stream, Await, j);
  }
  rc |= c.memcpy_htod(reinterpret_cast<uint64_t>(out->untyped_data()), j->out, out->size_bytes(), stream);
  if (rc) return ffi::Error::Internal("enqueueing the wait for the CPU expert job failed");
  return ffi::Error::Success();
}

}  // namespace

#define FREETOKEN_SUBMIT_BINDING(...)                                                               \
  ffi::Ffi::Bind() __VA_ARGS__.Arg<ffi::Buffer<ffi::F32>>().Ret<ffi::Buffer<ffi::S32>>().Attr<int64_t>("handle").Attr<int64_t>( \
      "tokens").Attr<int64_t>("top_k")
#define FREETOKEN_WAIT_BINDING(...) \
  ffi::Ffi::Bind() __VA_ARGS__.Arg<ffi::Buffer<ffi::S32>>().Ret<ffi::Buffer<ffi::F32>>().Attr<int64_t>("handle").Attr<int64_t>("top_k")

XLA_FFI_DEFINE_HANDLER_SYMBOL(FreetokenSubmitCpu, SubmitCpu, FREETOKEN_SUBMIT_BINDING());
XLA_FFI_DEFINE_HANDLER_SYMBOL(FreetokenWaitCpu, WaitCpu, FREETOKEN_WAIT_BINDING());
XLA_FFI_DEFINE_HANDLER_SYMBOL(FreetokenSubmitCuda, SubmitCuda, FREETOKEN_SUBMIT_BINDING(.Ctx<ffi::PlatformStream<void*>>()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(FreetokenWaitCuda, WaitCuda, FREETOKEN_WAIT_BINDING(.Ctx<ffi::PlatformStream<void*>>()));
// The same CUDA handlers, declared recordable into XLA's command buffers (CUDA graphs).
XLA_FFI_DEFINE_HANDLER_SYMBOL(FreetokenSubmitCudaGraph, SubmitCuda, FREETOKEN_SUBMIT_BINDING(.Ctx<ffi::PlatformStream<void*>>()),
                              {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(FreetokenWaitCudaGraph, WaitCuda, FREETOKEN_WAIT_BINDING(.Ctx<ffi::PlatformStream<void*>>()),
                              {ffi::Traits::kCmdBufferCompatible});

int64_t RegisterHandoffLayer(MoeExecutor* executor, const Banks& banks, Act act) {
  std::lock_guard<std::mutex> g(registry_mu);
  for (size_t i = 0; i < layers.size(); ++i) {
    const Layer& l = *layers[i];
    if (l.executor == executor && l.act == act && l.banks.gate == banks.gate && l.banks.up == banks.up && l.banks.down == banks.down &&
        l.banks.type == banks.type && l.banks.down_type == banks.down_type && l.banks.experts == banks.experts && l.banks.hidden == banks.hidden && l.banks.ffn == banks.ffn &&
        l.banks.gate_bias == banks.gate_bias && l.banks.up_bias == banks.up_bias && l.banks.down_bias == banks.down_bias)
      return static_cast<int64_t>(i);
  }
  layers.push_back(std::make_unique<Layer>(Layer{executor, banks, act}));
  return static_cast<int64_t>(layers.size()) - 1;
}

void PrepareHandoffJob(int64_t handle, int64_t tokens, int64_t top_k, int cuda_ordinal) {
  ScopedContext ctx(cuda_ordinal);
  if (!ctx.error().empty()) throw std::runtime_error(ctx.error());
  if (cuda_ordinal >= 0 && SyncMode() == kSyncKernel) {
    if (std::string e = LoadSignalKernels(); !e.empty()) {
      // Asked for by name, the kernels are required; as the default, the handoff falls back to the
      // stream memory operations (or host functions) and says so.
      const char* env = std::getenv("FREETOKEN_HANDOFF_SYNC");
      if (env && std::string(env) == "kernel") throw std::runtime_error(e);
      SetHandoffSync(kSyncStreamMemOps);
      std::fprintf(stderr, "freetoken_jax: %s; the CPU handoff signals by %s instead\n", e.c_str(),
                   SyncMode() == kSyncStreamMemOps ? "stream memory operations" : "host functions");
    }
  }
  Job* j;
  ffi::Error e = GetJob(handle, tokens, top_k, cuda_ordinal >= 0, &j);
  if (e.failure()) throw std::runtime_error(e.message());
}

HandoffStats TakeHandoffStats(bool reset) {
  HandoffStats s{stat_count.load(), stat_window.load() * 1e-9, stat_gpu.load() * 1e-9, stat_cpu.load() * 1e-9, stat_unseen.load()};
  if (reset) {
    stat_unseen = 0;
    stat_count = 0;
    stat_window = 0;
    stat_gpu = 0;
    stat_cpu = 0;
  }
  return s;
}

int HandoffSync() { return SyncMode(); }

void SetHandoffSync(int mode) {
  const bool missing = (mode == kSyncStreamMemOps && !HasStreamMemOps()) || (mode == kSyncKernel && !HasKernelLaunch());
  sync_mode.store(missing ? kSyncHostFunction : mode, std::memory_order_relaxed);
}

void* SubmitHandlerCpu() { return reinterpret_cast<void*>(&FreetokenSubmitCpu); }
void* WaitHandlerCpu() { return reinterpret_cast<void*>(&FreetokenWaitCpu); }
void* SubmitHandlerCuda() { return reinterpret_cast<void*>(&FreetokenSubmitCuda); }
void* WaitHandlerCuda() { return reinterpret_cast<void*>(&FreetokenWaitCuda); }
void* SubmitHandlerCudaGraph() { return reinterpret_cast<void*>(&FreetokenSubmitCudaGraph); }
void* WaitHandlerCudaGraph() { return reinterpret_cast<void*>(&FreetokenWaitCudaGraph); }

}  // namespace freetoken
