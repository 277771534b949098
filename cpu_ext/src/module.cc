// The nanobind module `freetoken_jax._cpu_ext`: the CPU side of expert execution.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/map.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <iterator>
#include <optional>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "cpu_features.h"
#include "ffi_bank_copy.h"
#include "ffi_experts.h"
#include "ffi_handoff.h"
#include "moe_executor.h"

namespace nb = nanobind;
using namespace freetoken;

namespace {

IsaTier ParseTier(const std::string& name) {
  for (int t = 0; t <= static_cast<int>(IsaTier::kAvx512Bf16); ++t)
    if (name == TierName(static_cast<IsaTier>(t))) return static_cast<IsaTier>(t);
  throw std::invalid_argument("unknown ISA tier '" + name + "'; use scalar, avx2_fma, avx512f or avx512_bf16");
}

using Bank = nb::ndarray<nb::ro, nb::ndim<2>, nb::c_contig, nb::device::cpu>;
using F32x2 = nb::ndarray<const float, nb::ndim<2>, nb::c_contig, nb::device::cpu>;
using Out = nb::ndarray<float, nb::ndim<2>, nb::c_contig, nb::device::cpu>;
using I32 = nb::ndarray<const int32_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;
using F32 = nb::ndarray<const float, nb::ndim<1>, nb::c_contig, nb::device::cpu>;

BankType TypeOf(const Bank& a, const char* name) {
  if (a.dtype() == nb::dtype<float>()) return BankType::kF32;
  if (a.dtype() == nb::dtype<uint16_t>()) return BankType::kBF16;  // bfloat16 bits
  throw std::invalid_argument(std::string(name) + " must be float32, bfloat16 viewed as uint16, or uint8 with a quantized format");
}

// Checks gate/up (an [ffn, H] matrix per expert) and down ([H, ffn]) and describes them: float32 /
// bfloat16 rows of ffn*H elements of one dtype, or uint8 rows in `format` (quant_dot.h), where
// "a/b" stores gate and up as a and down as b.
Banks MakeBanks(const Bank& gate, const Bank& up, const Bank& down, int64_t H, int64_t ffn, const std::string& format) {
  auto dim = [](const Bank& a, int i) { return static_cast<int64_t>(a.shape(i)); };
  if (ffn <= 0 || H <= 0) throw std::invalid_argument("ffn and the hidden size must be positive");
  BankType type, down_type;
  if (format.empty() || format == "bf16" || format == "f32") {
    type = down_type = TypeOf(gate, "gate");
    if (TypeOf(up, "up") != type || TypeOf(down, "down") != type) throw std::invalid_argument("gate, up and down must share one dtype");
  } else {
    const size_t slash = format.find('/');
    type = ParseBankType(format.substr(0, slash).c_str());
    down_type = slash == std::string::npos ? type : ParseBankType(format.substr(slash + 1).c_str());
    for (const Bank* b : {&gate, &up, &down})
      if (b->dtype() != nb::dtype<uint8_t>()) throw std::invalid_argument("banks of format " + format + " must be uint8");
    for (BankType t : {type, down_type})
      if (LayoutOf(t).block == 1 || !RowFits(t, H) || !RowFits(t, ffn))
        throw std::invalid_argument(format + ": " + BankTypeName(t) + " does not store rows of " + std::to_string(H) + " and " + std::to_string(ffn) +
                                    " weights (whole blocks of " + std::to_string(LayoutOf(t).block) + ")");
  }
  const int64_t E = dim(gate, 0);
  const int64_t elem = type == BankType::kF32 ? 4 : type == BankType::kBF16 ? 2 : 1;
  const int64_t want_gu = MatrixBytes(type, ffn, H) / elem, want_d = MatrixBytes(down_type, H, ffn) / elem;
  if (dim(gate, 1) != want_gu || dim(up, 0) != E || dim(up, 1) != want_gu || dim(down, 0) != E || dim(down, 1) != want_d)
    throw std::invalid_argument("banks must hold one expert per row: gate/up [E, " + std::to_string(want_gu) + "] and down [E, " +
                                std::to_string(want_d) + "] for x of width H and " + format + " weights");
  return Banks{gate.data(), up.data(), down.data(), type, E, H, ffn, down_type};
}

// Adds per-expert biases (float32, gate/up [E, ffn], down [E, H]) to `b`; all three or none.
using Bias = std::optional<F32x2>;
void AddBiases(Banks& b, const Bias& gate, const Bias& up, const Bias& down) {
  if (!gate && !up && !down) return;
  if (!gate || !up || !down) throw std::invalid_argument("expert biases come as gate, up and down together");
  auto is = [](const F32x2& a, int64_t r, int64_t c) { return static_cast<int64_t>(a.shape(0)) == r && static_cast<int64_t>(a.shape(1)) == c; };
  if (!is(*gate, b.experts, b.ffn) || !is(*up, b.experts, b.ffn) || !is(*down, b.experts, b.hidden))
    throw std::invalid_argument("expert biases must be float32 gate/up [E, ffn] and down [E, H]");
  b.gate_bias = gate->data();
  b.up_bias = up->data();
  b.down_bias = down->data();
}

}  // namespace

NB_MODULE(_cpu_ext, m) {
  m.attr("ACTIVATIONS") = nb::tuple(nb::cast(std::vector<std::string>(std::begin(kActNames), std::end(kActNames))));
  m.doc() = "freetoken_jax CPU expert executor (C++).";
  // Executors live as long as the process (one shared pool per thread count, referenced by the
  // compiled steps' handoff registry): that they are still alive at exit is by design.
  nb::set_leak_warnings(false);
  m.def(
      "supported_tiers",
      [] {
        std::vector<std::string> names;
        for (auto t : SupportedTiers()) names.emplace_back(TierName(t));
        return names;
      },
      "ISA tiers usable on this CPU, lowest first (scalar, avx2_fma, avx512f, avx512_bf16).");

  m.def(
      "format_nbytes", [](const std::string& format, int64_t rows, int64_t n) { return MatrixBytes(ParseBankType(format.c_str()), rows, n); },
      nb::arg("format"), nb::arg("rows"), nb::arg("n"), "Bytes of one [rows, n] matrix in `format` (the executor's table).");
  m.def(
      "prepare",
      [](nb::ndarray<const float, nb::ndim<1>, nb::c_contig, nb::device::cpu> x, const std::string& format, const std::string& tier,
         bool reference) {
        const BankType type = ParseBankType(format.c_str());
        const IsaTier t = ParseTier(tier);
        const int64_t n = static_cast<int64_t>(x.shape(0));
        const auto tiers = SupportedTiers();
        if (std::find(tiers.begin(), tiers.end(), t) == tiers.end()) throw std::invalid_argument("this CPU lacks tier " + tier);
        if (reference && !PreparesInt8(t, type))
          throw std::invalid_argument("the reference prepares int8 blocks only: " + format + " at tier " + tier + " reads none");
        std::string out(static_cast<size_t>(PrepBytes(t, type, n)), '\0');
        uint8_t* p = reinterpret_cast<uint8_t*>(out.data());
        if (reference) PrepareInt8Reference(type, x.data(), n, p);
        else Prepare(t, type, x.data(), n, p);
        return nb::bytes(out.data(), out.size());
      },
      nb::arg("x"), nb::arg("format"), nb::arg("tier"), nb::arg("reference") = false,
      "What the executor's kernels of (format, tier) read beside x (empty where they read x alone); "
      "`reference`: the int8 blocks by the scalar loop.");
  m.def(
      "stream_read",
      [](nb::ndarray<nb::ro, nb::ndim<1>, nb::c_contig, nb::device::cpu> a, int threads) {
        // STREAM-like read: every 64-bit word summed, split across threads (the sum defeats
        // dead-code elimination and is returned).
        const uint64_t* p = static_cast<const uint64_t*>(a.data());
        const int64_t n = static_cast<int64_t>(a.nbytes() / 8);
        threads = std::max(1, threads);
        std::vector<uint64_t> sums(threads, 0);
        {
          nb::gil_scoped_release release;
          std::vector<std::thread> ts;
          for (int t = 0; t < threads; ++t)
            ts.emplace_back([&, t] {
              const int64_t lo = n * t / threads, hi = n * (t + 1) / threads;
              uint64_t s0 = 0, s1 = 0, s2 = 0, s3 = 0;
              int64_t i = lo;
              for (; i + 4 <= hi; i += 4) { s0 += p[i]; s1 += p[i + 1]; s2 += p[i + 2]; s3 += p[i + 3]; }
              for (; i < hi; ++i) s0 += p[i];
              sums[t] = s0 + s1 + s2 + s3;
            });
          for (auto& t : ts) t.join();
        }
        uint64_t total = 0;
        for (auto s : sums) total += s;
        return total;
      },
      nb::arg("array"), nb::arg("threads"), "Sums an array's 64-bit words with `threads` threads (a read-bandwidth probe).");

  nb::class_<MoeExecutor>(m, "CpuMoeExecutor")
      .def(
          "__init__",
          [](MoeExecutor* self, int threads, const std::string& max_tier, bool pin) {
            if (threads <= 0) throw std::invalid_argument("threads must be positive");
            new (self) MoeExecutor(threads, ParseTier(max_tier), pin);
          },
          nb::arg("threads"), nb::arg("max_tier") = "avx512_bf16", nb::arg("pin") = false)
      .def_prop_ro("tier", [](const MoeExecutor& e) { return std::string(TierName(e.tier())); })
      .def_prop_ro("threads", &MoeExecutor::threads)
      .def(
          "run",
          [](MoeExecutor& self, F32x2 x, I32 tokens, I32 experts, F32 weights, Bank gate, Bank up, Bank down, int64_t ffn,
             const std::string& act, Out out, const std::string& format, Bias gate_bias, Bias up_bias, Bias down_bias) {
            const int64_t T = static_cast<int64_t>(x.shape(0)), H = static_cast<int64_t>(x.shape(1));
            const int64_t N = static_cast<int64_t>(tokens.shape(0));
            auto dim = [](const auto& a, int i) { return static_cast<int64_t>(a.shape(i)); };
            Banks b = MakeBanks(gate, up, down, H, ffn, format);
            AddBiases(b, gate_bias, up_bias, down_bias);
            const int64_t E = b.experts;
            if (dim(experts, 0) != N || dim(weights, 0) != N) throw std::invalid_argument("tokens, experts and weights must have one length");
            if (dim(out, 0) != T || dim(out, 1) != H) throw std::invalid_argument("out must have x's shape");
            for (int64_t i = 0; i < N; ++i) {
              if (tokens.data()[i] < 0 || tokens.data()[i] >= T) throw std::invalid_argument("token index out of range");
              if (experts.data()[i] < 0 || experts.data()[i] >= E) throw std::invalid_argument("expert id out of range");
            }
            Act a = ParseAct(act);
            nb::gil_scoped_release release;
            self.Run(x.data(), T, tokens.data(), experts.data(), weights.data(), N, b, a, out.data());
          },
          nb::arg("x"), nb::arg("tokens"), nb::arg("experts"), nb::arg("weights"), nb::arg("gate"), nb::arg("up"), nb::arg("down"), nb::arg("ffn"),
          nb::arg("act"), nb::arg("out"), nb::arg("format") = "", nb::arg("gate_bias").none() = nb::none(),
          nb::arg("up_bias").none() = nb::none(), nb::arg("down_bias").none() = nb::none(),
          "out[t] += w * (down_e act(gate_e x_t + bg_e, up_e x_t + bu_e) + bd_e) for every (t, e, w); x and out float32 [T, H]; "
          "`format`: the banks' quantized format (empty: float32 or bfloat16 by dtype); biases (float32) optional.");

  m.def(
      "register_handoff_layer",
      [](MoeExecutor& executor, Bank gate, Bank up, Bank down, int64_t hidden, int64_t ffn, const std::string& act,
         const std::string& format, Bias gate_bias, Bias up_bias, Bias down_bias) {
        Banks b = MakeBanks(gate, up, down, hidden, ffn, format);
        AddBiases(b, gate_bias, up_bias, down_bias);
        return RegisterHandoffLayer(&executor, b, ParseAct(act));
      },
      nb::arg("executor"), nb::arg("gate"), nb::arg("up"), nb::arg("down"), nb::arg("hidden"), nb::arg("ffn"), nb::arg("act"),
      nb::arg("format") = "", nb::arg("gate_bias").none() = nb::none(), nb::arg("up_bias").none() = nb::none(),
      nb::arg("down_bias").none() = nb::none(),
      "Registers one MoE layer's host banks for the FFI handoff; returns its handle. The banks and the executor must outlive "
      "every call that uses the handle.");
  m.def(
      "handoff_stats",
      [](bool reset) {
        HandoffStats s = TakeHandoffStats(reset);
        nb::dict d;
        d["count"] = s.count;
        d["window_s"] = s.window;
        d["gpu_s"] = s.gpu;
        d["cpu_s"] = s.cpu;
        d["unseen"] = s.unseen;
        return d;
      },
      nb::arg("reset") = false,
      "FFI handoff timing summed over calls, from the inputs being staged: cpu (to the job's end), gpu (to the stream reaching "
      "wait, seen once the job has ended), window (the larger).");
  m.def(
      "handoff_sync",
      [](const std::string& mode) {
        if (mode == "stream_memops") SetHandoffSync(kSyncStreamMemOps);
        else if (mode == "host_function") SetHandoffSync(kSyncHostFunction);
        else if (mode == "kernel") SetHandoffSync(kSyncKernel);
        else if (!mode.empty())
          throw std::invalid_argument("handoff sync is 'stream_memops', 'host_function' or 'kernel', got '" + mode + "'");
        const int m = HandoffSync();
        return std::string(m == kSyncStreamMemOps ? "stream_memops" : m == kSyncKernel ? "kernel" : "host_function");
      },
      nb::arg("mode") = "",
      "How CUDA handoffs signal: 'stream_memops', 'host_function' or 'kernel'; sets it when `mode` is given (only while no "
      "handoff is in flight); returns the mode in use.");
  m.def(
      "ffi_handlers",
      [] {
        auto cap = [](void* fn) { return nb::capsule(fn); };
        std::map<std::string, std::map<std::string, nb::capsule>> h;
        h["freetoken_moe_submit"]["cpu"] = cap(SubmitHandlerCpu());
        h["freetoken_moe_wait"]["cpu"] = cap(WaitHandlerCpu());
        h["freetoken_moe_submit"]["CUDA"] = cap(SubmitHandlerCuda());
        h["freetoken_moe_wait"]["CUDA"] = cap(WaitHandlerCuda());
        h["freetoken_moe_submit_graph"]["cpu"] = cap(SubmitHandlerCpu());
        h["freetoken_moe_wait_graph"]["cpu"] = cap(WaitHandlerCpu());
        h["freetoken_moe_submit_graph"]["CUDA"] = cap(SubmitHandlerCudaGraph());
        h["freetoken_moe_wait_graph"]["CUDA"] = cap(WaitHandlerCudaGraph());
        h["freetoken_bank_copy_start"]["cpu"] = cap(BankCopyStartHandlerCpu());
        h["freetoken_bank_copy_wait"]["cpu"] = cap(BankCopyWaitHandlerCpu());
        h["freetoken_bank_copy_start"]["CUDA"] = cap(BankCopyStartHandlerCuda());
        h["freetoken_bank_copy_wait"]["CUDA"] = cap(BankCopyWaitHandlerCuda());
        h["freetoken_q4_0_gate_up"]["CUDA"] = cap(Q4GateUpHandlerCuda());
        h["freetoken_q4_0_down"]["CUDA"] = cap(Q4DownHandlerCuda());
        h["freetoken_q4_0_moe"]["CUDA"] = cap(Q4MoeHandlerCuda());
        return h;
      },
      "XLA FFI handlers of the split CPU handoff, the bank copies and the q4_0 expert kernels: {target name: {platform: "
      "capsule}}; the '_graph' targets and the kernels may be recorded into XLA's CUDA graphs.");
  m.def("load_expert_kernels", &LoadExpertKernels, nb::arg("ordinal"),
        "Loads the q4_0 expert kernels into CUDA device `ordinal`'s primary context (once); '' on success, else why they "
        "cannot run there.");
  m.def("expert_kernels_shared_memory", &ExpertKernelsSharedMemory, nb::arg("ordinal"),
        "The dynamic shared memory a block of the expert kernels may take on device `ordinal` (0 where not loaded).");
  m.def(
      "bank_copy_stats",
      [](bool reset) {
        BankCopyStats s = TakeBankCopyStats(reset);
        nb::dict d;
        d["starts"] = s.starts;
        d["host_s"] = s.host_s;
        d["bytes"] = s.bytes;
        return d;
      },
      nb::arg("reset") = false, "The CUDA bank copies started so far: starts, host seconds spent enqueueing them, bytes.");
  m.def(
      "register_host_bank", [](uintptr_t ptr, int64_t bytes) { return RegisterHostBank(ptr, bytes); }, nb::arg("ptr"), nb::arg("bytes"),
      "Registers `bytes` bytes of host memory at `ptr` (an expert bank) for the FFI bank copies; returns its handle (the same "
      "for the same memory). The memory must outlive every call that uses the handle.");
  m.def(
      "prepare_handoff_job",
      [](int64_t handle, int64_t tokens, int64_t top_k, int cuda_ordinal) { PrepareHandoffJob(handle, tokens, top_k, cuda_ordinal); },
      nb::arg("handle"), nb::arg("tokens"), nb::arg("top_k"), nb::arg("cuda_ordinal"),
      "Creates the staging job of (layer, tokens, top_k) ahead of the FFI calls (pinned memory through CUDA device "
      "`cuda_ordinal`'s primary context; -1: a CPU-backend job).");
}
