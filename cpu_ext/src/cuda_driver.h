// CUDA driver entry points, loaded on first use through dlopen("libcuda.so.1"): the module is
// built without CUDA and runs on any machine; `error` says why the driver is unusable, if it is.
#pragma once

#include <cstddef>
#include <cstdint>
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

}  // namespace freetoken
