// CUDA driver entry points, loaded on first use through dlopen("libcuda.so.1"): the module is
// built without CUDA and runs on any machine; `error` says why the driver is unusable, if it is.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>

namespace freetoken {

struct Cuda {
  using Stream = void*;
  using Event = void*;
  int (*memcpy_dtoh)(void*, uint64_t, size_t, Stream) = nullptr;
  int (*memcpy_htod)(uint64_t, const void*, size_t, Stream) = nullptr;
  int (*memcpy_dtod)(uint64_t, uint64_t, size_t, Stream) = nullptr;
  int (*launch_host_func)(Stream, void (*)(void*), void*) = nullptr;
  int (*mem_host_alloc)(void**, size_t, unsigned) = nullptr;
  int (*host_device_pointer)(uint64_t*, void*, unsigned) = nullptr;
  int (*write_value32)(Stream, uint64_t, uint32_t, unsigned) = nullptr;  // stream memory operations
  int (*wait_value32)(Stream, uint64_t, uint32_t, unsigned) = nullptr;
  int (*init)(unsigned) = nullptr;  // for allocating outside XLA's calls: device ordinal -> primary context
  int (*device_get)(int*, int) = nullptr;
  int (*primary_ctx_retain)(void**, int) = nullptr;
  int (*ctx_push)(void*) = nullptr;
  int (*ctx_pop)(void**) = nullptr;
  int (*ctx_get_current)(void**) = nullptr;
  int (*module_load_data)(void**, const void*) = nullptr;  // the handoff's signalling kernels
  int (*module_get_function)(void**, void*, const char*) = nullptr;
  int (*launch_kernel)(void*, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, Stream, void**, void**) = nullptr;
  int (*func_set_attribute)(void*, int, int) = nullptr;  // the expert kernels' shared memory
  int (*device_get_attribute)(int*, int, int) = nullptr;
  int (*ctx_get_device)(int*) = nullptr;
  int (*stream_create)(Stream*, unsigned) = nullptr;  // the bank copies' own stream and its events
  int (*event_create)(Event*, unsigned) = nullptr;
  int (*event_record)(Event, Stream) = nullptr;
  int (*stream_wait_event)(Stream, Event, unsigned) = nullptr;
  std::string error;
};

const Cuda& Driver();

// Makes CUDA device `ordinal`'s primary context current for the scope (nothing where ordinal < 0);
// `error` says why it could not.
class ScopedContext {
 public:
  explicit ScopedContext(int ordinal);
  ~ScopedContext();
  ScopedContext(const ScopedContext&) = delete;
  ScopedContext& operator=(const ScopedContext&) = delete;
  const std::string& error() const { return error_; }
  void* context() const { return ctx_; }
  int device() const { return device_; }

 private:
  void* ctx_ = nullptr;
  int device_ = 0;
  std::string error_;
};

// Kernels of type K loaded once per CUDA context and never unloaded.
template <class K>
class PerContext {
 public:
  // Runs `load(ctx, &k)` (it returns "" or why it failed) for the current context unless that
  // context has its kernels already; outside any stream capture.
  template <class F>
  std::string Load(F load) {
    void* ctx = nullptr;
    if (Driver().ctx_get_current(&ctx) || !ctx) return "no current CUDA context to load kernels into";
    std::lock_guard<std::mutex> g(mu_);
    if (of_.count(ctx)) return "";
    K k;
    std::string error = load(ctx, &k);
    if (error.empty()) of_[ctx] = k;
    return error;
  }
  // Those of context `ctx`, or null.
  const K* Of(void* ctx) const {
    std::lock_guard<std::mutex> g(mu_);
    auto it = of_.find(ctx);
    return it == of_.end() ? nullptr : &it->second;
  }
  // Those of the calling thread's current context (XLA calls handlers with it current); where
  // the thread holds none (or another), those of the one context they were loaded into, if
  // there is exactly one (one device).
  const K* Current() const {
    void* ctx = nullptr;
    if (Driver().ctx_get_current(&ctx)) ctx = nullptr;
    std::lock_guard<std::mutex> g(mu_);
    auto it = of_.find(ctx);
    if (it != of_.end()) return &it->second;
    return of_.size() == 1 ? &of_.begin()->second : nullptr;
  }

 private:
  mutable std::mutex mu_;
  std::map<void*, K> of_;  // map nodes stay put: the pointers handed out stay valid
};

}  // namespace freetoken
