#include "ffi_handoff.h"

#include <dlfcn.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
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

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace freetoken {
namespace {

// ---------------------------------------------------------------------------------------------
// CUDA driver entry points, loaded on first use (the module is built without CUDA).

struct Cuda {
  using Stream = void*;
  int (*memcpy_dtoh)(void*, uint64_t, size_t, Stream) = nullptr;
  int (*memcpy_htod)(uint64_t, const void*, size_t, Stream) = nullptr;
  int (*launch_host_func)(Stream, void (*)(void*), void*) = nullptr;
  int (*mem_host_alloc)(void**, size_t, unsigned) = nullptr;
  std::string error;
};

const Cuda& Driver() {
  static const Cuda cuda = [] {
    Cuda c;
    void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!lib) {
      c.error = "libcuda.so.1 could not be loaded";
      return c;
    }
    auto sym = [&](auto& fn, const char* name) {
      fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(dlsym(lib, name));
      if (!fn && c.error.empty()) c.error = std::string("libcuda.so.1 lacks ") + name;
    };
    sym(c.memcpy_dtoh, "cuMemcpyDtoHAsync_v2");
    sym(c.memcpy_htod, "cuMemcpyHtoDAsync_v2");
    sym(c.launch_host_func, "cuLaunchHostFunc");
    sym(c.mem_host_alloc, "cuMemHostAlloc");
    return c;
  }();
  return cuda;
}

// ---------------------------------------------------------------------------------------------
// Layers, jobs and the dispatcher thread.

struct Layer {
  MoeExecutor* executor;
  Banks banks;
  Act act;
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
  std::vector<int32_t> token_of, expert_of;
  std::vector<float> weight_of;
  std::atomic<bool> done{false};
  int64_t t_post = 0, t_done = 0;  // steady-clock ns: the stream reached submit; the job ended
  std::mutex mu;
  std::condition_variable cv;
  std::string error;
};

int64_t NowNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// Per-handoff timing, summed: window = the stream reaching submit to leaving wait; gpu = to
// reaching wait (the work between the two); cpu = to the job's end.
std::atomic<int64_t> stat_count{0}, stat_window{0}, stat_gpu{0}, stat_cpu{0}, stat_ideal{0};

std::mutex registry_mu;
std::vector<std::unique_ptr<Layer>> layers;
std::map<std::tuple<int64_t, int64_t, int64_t, bool>, std::unique_ptr<Job>> jobs;

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
  try {
    l.executor->Run(j->x, j->T, j->token_of.data(), j->expert_of.data(), j->weight_of.data(),
                    static_cast<int64_t>(j->token_of.size()), l.banks, l.act, j->out);
  } catch (const std::exception& e) {
    j->error = e.what();
  }
  {
    std::lock_guard<std::mutex> g(j->mu);
    j->t_done = NowNs();
    j->done.store(true, std::memory_order_release);
  }
  j->cv.notify_all();
}

class Dispatcher {
 public:
  static Dispatcher& Get() {
    static Dispatcher* d = new Dispatcher;  // never destroyed: XLA may call in at exit
    return *d;
  }
  void Post(Job* j) {
    {
      std::lock_guard<std::mutex> g(mu_);
      queue_.push_back(j);
    }
    cv_.notify_one();
  }

 private:
  Dispatcher() { std::thread([this] { Loop(); }).detach(); }
  void Loop() {
    for (;;) {
      Job* j;
      {
        std::unique_lock<std::mutex> g(mu_);
        cv_.wait(g, [&] { return !queue_.empty(); });
        j = queue_.front();
        queue_.pop_front();
      }
      RunJob(j);
    }
  }
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Job*> queue_;
};

void Post(void* job) {
  static_cast<Job*>(job)->t_post = NowNs();
  Dispatcher::Get().Post(static_cast<Job*>(job));
}

// Blocks until the job is done: spins briefly (the GPU side usually ends near the CPU side),
// then sleeps. Leaves the job ready for its next submit.
void Await(void* job) {
  Job* j = static_cast<Job*>(job);
  const int64_t t_in = NowNs();
  for (int i = 0; i < 20000 && !j->done.load(std::memory_order_acquire); ++i) {
#if defined(__x86_64__)
    _mm_pause();
#endif
  }
  if (!j->done.load(std::memory_order_acquire)) {
    std::unique_lock<std::mutex> g(j->mu);
    j->cv.wait(g, [&] { return j->done.load(std::memory_order_acquire); });
  }
  j->done.store(false, std::memory_order_relaxed);
  const int64_t t_out = NowNs();
  stat_count.fetch_add(1, std::memory_order_relaxed);
  stat_window.fetch_add(t_out - j->t_post, std::memory_order_relaxed);
  stat_gpu.fetch_add(t_in - j->t_post, std::memory_order_relaxed);
  stat_cpu.fetch_add(j->t_done - j->t_post, std::memory_order_relaxed);
  stat_ideal.fetch_add(std::max(t_in, j->t_done) - j->t_post, std::memory_order_relaxed);
  if (!j->error.empty()) std::fprintf(stderr, "freetoken_jax CPU expert job failed: %s\n", j->error.c_str());
}

const Layer* FindLayer(int64_t handle) {
  std::lock_guard<std::mutex> g(registry_mu);
  if (handle < 0 || handle >= static_cast<int64_t>(layers.size())) return nullptr;
  return layers[handle].get();
}

// The staging job of (layer, T, K); pinned host memory for CUDA, plain memory on the CPU.
ffi::Error GetJob(int64_t handle, int64_t T, int64_t K, bool cuda, Job** out) {
  const Layer* layer = FindLayer(handle);
  if (!layer) return ffi::Error::InvalidArgument("unknown handoff layer handle " + std::to_string(handle));
  std::lock_guard<std::mutex> g(registry_mu);
  auto& slot = jobs[{handle, T, K, cuda}];
  *out = slot.get();
  if (slot) return ffi::Error::Success();
  const int64_t H = layer->banks.hidden;
  const size_t bytes = sizeof(float) * (2 * T * H + 2 * T * K + T);
  void* mem = nullptr;
  if (cuda) {
    const Cuda& c = Driver();
    if (!c.error.empty()) return ffi::Error::Internal(c.error);
    if (c.mem_host_alloc(&mem, bytes, /*CU_MEMHOSTALLOC_PORTABLE*/ 1) != 0)
      return ffi::Error::Internal("cuMemHostAlloc of " + std::to_string(bytes) + " bytes failed");
  } else {
    mem = ::operator new(bytes);
  }
  auto job = std::make_unique<Job>();
  job->layer = layer;
  job->T = T;
  job->K = K;
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
  slot = std::move(job);
  *out = slot.get();
  return ffi::Error::Success();
}

// The packed input: x [T*H], ids [T*K] (int32 bits), w [T*K], valid [T] (int32 bits), as one
// float32 vector, so that it crosses to the host in one copy.
ffi::Error CheckPacked(const Layer& l, const ffi::Buffer<ffi::F32>& packed, int64_t T, int64_t K) {
  if (T <= 0 || K <= 0) return ffi::Error::InvalidArgument("tokens and top_k must be positive");
  if (static_cast<int64_t>(packed.element_count()) != T * (l.banks.hidden + 2 * K + 1))
    return ffi::Error::InvalidArgument("packed input length is not tokens * (hidden + 2 * top_k + 1): x's width differs from the banks'");
  return ffi::Error::Success();
}

// ---------------------------------------------------------------------------------------------
// Handlers.

ffi::Error SubmitCpu(ffi::Buffer<ffi::F32> packed, ffi::ResultBuffer<ffi::S32> token, int64_t handle, int64_t T, int64_t K) {
  const Layer* l = FindLayer(handle);
  if (!l) return ffi::Error::InvalidArgument("unknown handoff layer handle");
  if (auto e = CheckPacked(*l, packed, T, K); e.failure()) return e;
  Job* j;
  if (auto e = GetJob(handle, T, K, false, &j); e.failure()) return e;
  std::memcpy(j->x, packed.typed_data(), packed.size_bytes());
  token->typed_data()[0] = 0;
  Post(j);
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

ffi::Error SubmitCuda(void* stream, ffi::Buffer<ffi::F32> packed, ffi::ResultBuffer<ffi::S32>, int64_t handle, int64_t T, int64_t K) {
  const Layer* l = FindLayer(handle);
  if (!l) return ffi::Error::InvalidArgument("unknown handoff layer handle");
  if (auto e = CheckPacked(*l, packed, T, K); e.failure()) return e;
  Job* j;
  if (auto e = GetJob(handle, T, K, true, &j); e.failure()) return e;
  const Cuda& c = Driver();
  int rc = c.memcpy_dtoh(j->x, reinterpret_cast<uint64_t>(packed.untyped_data()), packed.size_bytes(), stream);
  rc |= c.launch_host_func(stream, Post, j);
  if (rc) return ffi::Error::Internal("enqueueing the CPU expert job on the stream failed");
  return ffi::Error::Success();
}

ffi::Error WaitCuda(void* stream, ffi::Buffer<ffi::S32>, ffi::ResultBuffer<ffi::F32> out, int64_t handle, int64_t K) {
  Job* j;
  if (auto e = GetJob(handle, out->dimensions()[0], K, true, &j); e.failure()) return e;
  const Cuda& c = Driver();
  int rc = c.launch_host_func(stream, Await, j);
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

int64_t RegisterHandoffLayer(MoeExecutor* executor, const Banks& banks, Act act) {
  std::lock_guard<std::mutex> g(registry_mu);
  for (size_t i = 0; i < layers.size(); ++i) {
    const Layer& l = *layers[i];
    if (l.executor == executor && l.act == act && l.banks.gate == banks.gate && l.banks.up == banks.up && l.banks.down == banks.down &&
        l.banks.type == banks.type && l.banks.experts == banks.experts && l.banks.hidden == banks.hidden && l.banks.ffn == banks.ffn)
      return static_cast<int64_t>(i);
  }
  layers.push_back(std::make_unique<Layer>(Layer{executor, banks, act}));
  return static_cast<int64_t>(layers.size()) - 1;
}

HandoffStats TakeHandoffStats(bool reset) {
  HandoffStats s{stat_count.load(), stat_window.load() * 1e-9, stat_gpu.load() * 1e-9, stat_cpu.load() * 1e-9, stat_ideal.load() * 1e-9};
  if (reset) {
    stat_count = 0;
    stat_window = 0;
    stat_gpu = 0;
    stat_cpu = 0;
    stat_ideal = 0;
  }
  return s;
}

void* SubmitHandlerCpu() { return reinterpret_cast<void*>(&FreetokenSubmitCpu); }
void* WaitHandlerCpu() { return reinterpret_cast<void*>(&FreetokenWaitCpu); }
void* SubmitHandlerCuda() { return reinterpret_cast<void*>(&FreetokenSubmitCuda); }
void* WaitHandlerCuda() { return reinterpret_cast<void*>(&FreetokenWaitCuda); }

}  // namespace freetoken
