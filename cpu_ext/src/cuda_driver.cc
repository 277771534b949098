#include "cuda_driver.h"

#include <dlfcn.h>

#include <initializer_list>
#include <type_traits>

namespace freetoken {

const Cuda& Driver() {
  static const Cuda cuda = [] {
    Cuda c;
    void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!lib) {
      c.error = "libcuda.so.1 could not be loaded";
      return c;
    }
    auto sym = [&](auto& fn, std::initializer_list<const char*> names, bool required) {
      for (const char* name : names)
        if ((fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(dlsym(lib, name)))) return;
      if (required && c.error.empty()) c.error = std::string("libcuda.so.1 lacks ") + *names.begin();
    };
    sym(c.memcpy_dtoh, {"cuMemcpyDtoHAsync_v2"}, true);
    sym(c.memcpy_htod, {"cuMemcpyHtoDAsync_v2"}, true);
    sym(c.memcpy_dtod, {"cuMemcpyDtoDAsync_v2"}, true);
    sym(c.launch_host_func, {"cuLaunchHostFunc"}, true);
    sym(c.mem_host_alloc, {"cuMemHostAlloc"}, true);
    sym(c.host_device_pointer, {"cuMemHostGetDevicePointer_v2"}, true);
    sym(c.write_value32, {"cuStreamWriteValue32_v2", "cuStreamWriteValue32"}, false);
    sym(c.wait_value32, {"cuStreamWaitValue32_v2", "cuStreamWaitValue32"}, false);
    sym(c.init, {"cuInit"}, true);
    sym(c.device_get, {"cuDeviceGet"}, true);
    sym(c.primary_ctx_retain, {"cuDevicePrimaryCtxRetain"}, true);
    sym(c.ctx_push, {"cuCtxPushCurrent_v2", "cuCtxPushCurrent"}, true);
    sym(c.ctx_pop, {"cuCtxPopCurrent_v2", "cuCtxPopCurrent"}, true);
    sym(c.ctx_get_current, {"cuCtxGetCurrent"}, true);
    sym(c.module_load_data, {"cuModuleLoadData"}, false);
    sym(c.module_get_function, {"cuModuleGetFunction"}, false);
    sym(c.launch_kernel, {"cuLaunchKernel"}, false);
    sym(c.func_set_attribute, {"cuFuncSetAttribute"}, false);
    sym(c.device_get_attribute, {"cuDeviceGetAttribute"}, false);
    sym(c.ctx_get_device, {"cuCtxGetDevice"}, false);
    sym(c.stream_create, {"cuStreamCreate"}, true);
    sym(c.event_create, {"cuEventCreate"}, true);
    sym(c.event_record, {"cuEventRecord"}, true);
    sym(c.stream_wait_event, {"cuStreamWaitEvent"}, true);
    return c;
  }();
  return cuda;
}

ScopedContext::ScopedContext(int ordinal) {
  if (ordinal < 0) return;
  const Cuda& c = Driver();
  if (!c.error.empty() || c.init(0) || c.device_get(&device_, ordinal) || c.primary_ctx_retain(&ctx_, device_) || c.ctx_push(ctx_)) {
    ctx_ = nullptr;
    error_ = c.error.empty() ? "could not make CUDA device " + std::to_string(ordinal) + "'s primary context current" : c.error;
  }
}

ScopedContext::~ScopedContext() {
  void* popped;
  if (ctx_) Driver().ctx_pop(&popped);
}

}  // namespace freetoken
