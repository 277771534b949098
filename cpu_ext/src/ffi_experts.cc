#include "ffi_experts.h"

#include <cstdint>
#include <string>

#include "../cuda/q4_0_experts.h"
#include "cuda_driver.h"
#include "q4_0_experts_ptx.h"  // kQ4_0ExpertsPtx: made by CMake from cuda/q4_0_experts.ptx
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace freetoken {
namespace {

constexpr int kMaxSharedAttr = 8;     // CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
constexpr int kSharedOptinAttr = 97;  // CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN
constexpr int kSmCountAttr = 16;      // CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT

struct Kernels {
  void* gate_up = nullptr;
  void* down = nullptr;
  void* moe = nullptr;
  int shared = 0;  // bytes of dynamic shared memory a block may take
  int sms = 0;     // the device's multiprocessors: ft_q4_0_moe's grid
};

PerContext<Kernels> kernels;

// A bank operand: uint8 [E, row] or [L, E, row]; the address of entry `index`'s expert 0, its
// experts and their row's bytes.
struct Bank {
  const uint8_t* base;
  int64_t experts, row;
};

ffi::Error BankOf(const char* what, ffi::AnyBuffer b, int64_t index, int64_t need, Bank* out) {
  auto d = b.dimensions();
  if (b.element_type() != ffi::DataType::U8 || (d.size() != 2 && d.size() != 3))
    return ffi::Error::InvalidArgument(std::string(what) + ": a uint8 bank [experts, row] or [layers, experts, row]");
  const int64_t layers = d.size() == 3 ? d[0] : 1;
  if (index < 0 || index >= layers)
    return ffi::Error::InvalidArgument(std::string(what) + ": entry " + std::to_string(index) + " of " + std::to_string(layers));
  const int64_t experts = d[d.size() - 2], row = d[d.size() - 1];
  if (row < need || row % 16)
    return ffi::Error::InvalidArgument(std::string(what) + ": rows of " + std::to_string(row) + " bytes; the kernels read " +
                                       std::to_string(need) + " and need a multiple of 16");
  *out = Bank{static_cast<const uint8_t*>(b.untyped_data()) + index * experts * row, experts, row};
  return ffi::Error::Success();
}

ffi::Error Launch(void* fn, unsigned gx, unsigned gy, unsigned threads, int64_t shared, void* stream, void** params) {
  if (Driver().launch_kernel(fn, gx, gy, 1, threads, 1, 1, static_cast<unsigned>(shared), stream, params, nullptr))
    return ffi::Error::Internal("launching a q4_0 expert kernel failed");
  return ffi::Error::Success();
}

// F and D positive multiples of 256 (rows of a multiple of 16 bytes; a block's rows divide them).
ffi::Error CheckSizes(const std::string& name, int64_t F, int64_t D) {
  if (F % 256 || D % 256 || F <= 0 || D <= 0) return ffi::Error::InvalidArgument(name + ": F and D must be positive multiples of 256");
  return ffi::Error::Success();
}

// What gate_up and moe both take: x [T, D], ids and w [T, K], h [T, K, ffn], F and D as
// CheckSizes asks, and gate and up banks (entry `index`) with rows of one width that hold F rows
// of D inputs. Sets T, D, K and the two banks.
ffi::Error GateUpOperands(const std::string& name, ffi::AnyBuffer gate, ffi::AnyBuffer up, ffi::Buffer<ffi::BF16>& x,
                          ffi::Buffer<ffi::S32>& ids, ffi::Buffer<ffi::F32>& w, ffi::Span<const int64_t> hd, int64_t index, int64_t ffn,
                          int64_t* T, int64_t* D, int64_t* K, Bank* g, Bank* u) {
  auto xd = x.dimensions(), id = ids.dimensions(), wd = w.dimensions();
  if (xd.size() != 2 || id.size() != 2 || id[0] != xd[0] || wd.size() != 2 || wd[0] != id[0] || wd[1] != id[1] || hd.size() != 3 ||
      hd[0] != id[0] || hd[1] != id[1] || hd[2] != ffn)
    return ffi::Error::InvalidArgument(name + ": x [T, D], ids and w [T, K], h [T, K, F]");
  *T = xd[0], *D = xd[1], *K = id[1];
  if (auto e = CheckSizes(name, ffn, *D); e.failure()) return e;
  if (auto e = BankOf("gate", gate, index, ffn * ft_q4_0::row_bytes(*D), g); e.failure()) return e;
  if (auto e = BankOf("up", up, index, ffn * ft_q4_0::row_bytes(*D), u); e.failure()) return e;
  if (g->row != u->row) return ffi::Error::InvalidArgument(name + ": gate and up rows differ");
  return ffi::Error::Success();
}

ffi::Error GateUp(void* stream, ffi::AnyBuffer gate, ffi::AnyBuffer up, ffi::Buffer<ffi::BF16> x, ffi::Buffer<ffi::S32> ids,
                  ffi::Buffer<ffi::F32> w, ffi::Result<ffi::Buffer<ffi::BF16>> h, int64_t index, int64_t ffn) {
  const Kernels* k = kernels.Current();
  if (!k) return ffi::Error::Internal("the q4_0 expert kernels were not loaded in this CUDA context");
  int64_t T, D, K;
  const int64_t F = ffn;
  Bank g, u;
  if (auto e = GateUpOperands("freetoken_q4_0_gate_up", gate, up, x, ids, w, h->dimensions(), index, ffn, &T, &D, &K, &g, &u); e.failure())
    return e;
  const int64_t shared = ft_q4_0::gate_up_smem(D);
  if (shared > k->shared) return ffi::Error::InvalidArgument("freetoken_q4_0_gate_up: D too large for the device's shared memory");
  if (T * K == 0) return ffi::Error::Success();
  if (T * K > 65535) return ffi::Error::InvalidArgument("freetoken_q4_0_gate_up: more than 65535 token-expert pairs in one call");
  const uint8_t *gp = g.base, *up_ = u.base;
  const void *xp = x.typed_data(), *ip = ids.typed_data(), *wp = w.typed_data();
  void* hp = h->typed_data();
  int64_t stride = g.row;
  int Fi = static_cast<int>(F), Di = static_cast<int>(D), Ki = static_cast<int>(K);
  void* params[] = {&gp, &up_, &stride, &xp, &ip, &wp, &hp, &Fi, &Di, &Ki};
  return Launch(k->gate_up, static_cast<unsigned>(F / ft_q4_0::kGateUpRows), static_cast<unsigned>(T * K), ft_q4_0::kGateUpWarps * 32,
                shared, stream, params);
}

ffi::Error Down(void* stream, ffi::AnyBuffer down, ffi::Buffer<ffi::BF16> h, ffi::Buffer<ffi::S32> ids, ffi::Result<ffi::Buffer<ffi::BF16>> y,
                int64_t index) {
  const Kernels* k = kernels.Current();
  if (!k) return ffi::Error::Internal("the q4_0 expert kernels were not loaded in this CUDA context");
  auto hd = h.dimensions(), id = ids.dimensions(), yd = y->dimensions();
  if (hd.size() != 3 || id.size() != 2 || hd[0] != id[0] || hd[1] != id[1] || yd.size() != 2 || yd[0] != id[0])
    return ffi::Error::InvalidArgument("freetoken_q4_0_down: h [T, K, F], ids [T, K], y [T, D]");
  const int64_t T = hd[0], K = hd[1], F = hd[2], D = yd[1];
  if (auto e = CheckSizes("freetoken_q4_0_down", F, D); e.failure()) return e;
  Bank d;
  if (auto e = BankOf("down", down, index, D * ft_q4_0::row_bytes(F), &d); e.failure()) return e;
  const int64_t shared = ft_q4_0::down_smem(F, K);
  if (shared > k->shared) return ffi::Error::InvalidArgument("freetoken_q4_0_down: K·F too large for the device's shared memory");
  if (T * K == 0) return ffi::Error::Success();
  if (T > 65535) return ffi::Error::InvalidArgument("freetoken_q4_0_down: more than 65535 tokens in one call");
  const uint8_t* dp = d.base;
  const void *hp = h.typed_data(), *ip = ids.typed_data();
  void* yp = y->typed_data();
  int64_t stride = d.row;
  int Fi = static_cast<int>(F), Di = static_cast<int>(D), Ki = static_cast<int>(K);
  void* params[] = {&dp, &stride, &hp, &ip, &yp, &Fi, &Di, &Ki};
  return Launch(k->down, static_cast<unsigned>(D / ft_q4_0::kDownRows), static_cast<unsigned>(T), ft_q4_0::kDownWarps * 32, shared, stream,
                params);
}

// Gate, up and down in one launch: y [T, D] and h [T, K, F] (the kernel's scratch: the pairs' h
// between its two phases).
ffi::Error Moe(void* stream, ffi::AnyBuffer gate, ffi::AnyBuffer up, ffi::AnyBuffer down, ffi::Buffer<ffi::BF16> x, ffi::Buffer<ffi::S32> ids,
               ffi::Buffer<ffi::F32> w, ffi::Result<ffi::Buffer<ffi::BF16>> y, ffi::Result<ffi::Buffer<ffi::BF16>> h, int64_t index,
               int64_t down_index, int64_t ffn) {
  const Kernels* k = kernels.Current();
  if (!k) return ffi::Error::Internal("the q4_0 expert kernels were not loaded in this CUDA context");
  int64_t T, D, K;
  const int64_t F = ffn;
  Bank g, u, d;
  if (auto e = GateUpOperands("freetoken_q4_0_moe", gate, up, x, ids, w, h->dimensions(), index, ffn, &T, &D, &K, &g, &u); e.failure())
    return e;
  if (auto yd = y->dimensions(); yd.size() != 2 || yd[0] != T || yd[1] != D) return ffi::Error::InvalidArgument("freetoken_q4_0_moe: y [T, D]");
  if (auto e = BankOf("down", down, down_index, D * ft_q4_0::row_bytes(F), &d); e.failure()) return e;
  const int64_t shared = ft_q4_0::moe_smem(T, F, D, K);
  if (shared > k->shared) return ffi::Error::InvalidArgument("freetoken_q4_0_moe: T·D or K·F too large for the device's shared memory");
  if (T * K == 0) return ffi::Error::Success();
  const uint8_t *gp = g.base, *up_ = u.base, *dp = d.base;
  const void *xp = x.typed_data(), *ip = ids.typed_data(), *wp = w.typed_data();
  void *hp = h->typed_data(), *yp = y->typed_data();
  int64_t stride = g.row, dstride = d.row;
  int Ti = static_cast<int>(T), Fi = static_cast<int>(F), Di = static_cast<int>(D), Ki = static_cast<int>(K);
  void* params[] = {&gp, &up_, &stride, &dp, &dstride, &xp, &ip, &wp, &hp, &yp, &Ti, &Fi, &Di, &Ki};
  return Launch(k->moe, static_cast<unsigned>(k->sms), 1, ft_q4_0::kMoeWarps * 32, shared, stream, params);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(FreetokenQ4GateUpCuda, GateUp,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<void*>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::BF16>>()
                                  .Attr<int64_t>("index")
                                  .Attr<int64_t>("ffn"),
                              {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(FreetokenQ4MoeCuda, Moe,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<void*>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::BF16>>()
                                  .Ret<ffi::Buffer<ffi::BF16>>()
                                  .Attr<int64_t>("index")
                                  .Attr<int64_t>("down_index")
                                  .Attr<int64_t>("ffn"),
                              {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(FreetokenQ4DownCuda, Down,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<void*>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::BF16>>()
                                  .Attr<int64_t>("index"),
                              {ffi::Traits::kCmdBufferCompatible});

std::string LoadExpertKernels(int ordinal) {
  const Cuda& c = Driver();
  if (!c.error.empty()) return c.error;
  if (!c.module_load_data || !c.module_get_function || !c.launch_kernel || !c.func_set_attribute || !c.device_get_attribute)
    return "the CUDA driver lacks cuModuleLoadData, cuLaunchKernel or cuFuncSetAttribute";
  ScopedContext scope(ordinal);
  if (!scope.error().empty()) return scope.error();
  return kernels.Load([&](void*, Kernels* k) -> std::string {
    void* module = nullptr;
    if (c.module_load_data(&module, kQ4_0ExpertsPtx))
      return "the driver could not load the q4_0 expert kernels' PTX (a driver older than the PTX's CUDA 13, or a GPU older than sm_80)";
    if (c.module_get_function(&k->gate_up, module, "ft_q4_0_gate_up") || c.module_get_function(&k->down, module, "ft_q4_0_down") ||
        c.module_get_function(&k->moe, module, "ft_q4_0_moe"))
      return "the q4_0 expert kernels' PTX lacks its entry points";
    if (c.device_get_attribute(&k->shared, kSharedOptinAttr, scope.device()) || c.device_get_attribute(&k->sms, kSmCountAttr, scope.device()) ||
        c.func_set_attribute(k->gate_up, kMaxSharedAttr, k->shared) || c.func_set_attribute(k->down, kMaxSharedAttr, k->shared) ||
        c.func_set_attribute(k->moe, kMaxSharedAttr, k->shared))
      return "could not raise the q4_0 expert kernels' shared memory limit";
    return "";
  });
}

int ExpertKernelsSharedMemory(int ordinal) {
  if (!Driver().error.empty()) return 0;
  ScopedContext scope(ordinal);
  const Kernels* k = scope.error().empty() ? kernels.Of(scope.context()) : nullptr;
  return k ? k->shared : 0;
}

void* Q4GateUpHandlerCuda() { return reinterpret_cast<void*>(&FreetokenQ4GateUpCuda); }
void* Q4DownHandlerCuda() { return reinterpret_cast<void*>(&FreetokenQ4DownCuda); }
void* Q4MoeHandlerCuda() { return reinterpret_cast<void*>(&FreetokenQ4MoeCuda); }

}  // namespace freetoken
