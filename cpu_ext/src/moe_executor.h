// The CPU expert executor: routed-expert FFNs computed straight from host expert banks.
//
// For work items (token t, expert e, weight w) it computes
//   out[t] += w * (down_e h + bd_e),  h = act(gate_e x_t + bg_e, up_e x_t + bu_e)
// (the biases where the banks have them)
// with gate/up banks holding per expert an [F, H] matrix (row f: its f-th output row, length H)
// and the down bank an [H, F] one, in float32, bfloat16 or a quantized format (quant_dot.h); one
// bank row per expert. Work is split in two phases over a persistent thread pool, each task one
// run of rows of one matrix (long runs first, short ones last, so that streams are long and
// threads finish together): (1) every item's gate and up rows, then its hidden units and their
// prepared copy (by the thread that ends its expert's last run); (2) the down rows: for a few items (decode) each item's into partial sums added
// up per block of output rows afterwards, in item order; for many items each task a block of
// output rows over every item. No two threads write the same output row, and the sums do not
// depend on the thread count.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "cpu_features.h"
#include "quant_dot.h"

namespace freetoken {

#ifdef FREETOKEN_TRACE_PHASES
// Built with FREETOKEN_TRACE_PHASES (benchmarks/probe_quant_dot.cc only), a decode-sized job
// records when it started (0), began phase 1 (1), ended it (2), ended phase 2 (3) and returned
// (4), and the time its items' activations took in all.
using TraceClock = std::chrono::steady_clock;
inline constexpr int kTraceMarks = 5;
extern TraceClock::time_point trace_marks[kTraceMarks];
extern std::atomic<int64_t> trace_activate_ns;
#endif

// The activations the executor computes, in enum order, by the names the Python side uses
// (freetoken_jax/config.py ACTIVATIONS; the module exports this table and a test checks the two).
// The gated activations h(g, u) of gate and up: act(g) * u for the first three; "swiglu_oai" is
// gpt-oss's clamped SwiGLU (alpha 1.702, limit 7): (clamp(u, ±7) + 1) * g' * sigmoid(1.702 g'),
// g' = min(g, 7).
enum class Act { kSilu, kGelu, kGeluTanh, kSwigluOai };
inline constexpr const char* kActNames[] = {"silu", "gelu", "gelu_tanh", "swiglu_oai"};
// Parses a name of kActNames; throws std::invalid_argument listing them.
Act ParseAct(const std::string& name);

// A pool of worker threads (optionally pinned one per core) that runs `fn(task)` for
// task in [0, n); the calling thread takes tasks too. `Run` returns once every task has run.
// Joining a job takes no lock: the task counter carries the job's generation in its upper 32
// bits and a thread takes a task by compare-and-swap only while the generation is its job's, so
// a thread that comes late takes nothing of a later job (a job cannot end while one of its tasks
// is taken and not yet counted, nor the next start before it ends). Idle workers spin for a while,
// then sleep on a condition variable.
class ThreadPool {
 public:
  ThreadPool(int threads, bool pin);
  ~ThreadPool();
  void Run(int64_t n, const std::function<void(int64_t)>& fn);
  int size() const { return static_cast<int>(workers_.size()) + 1; }

 private:
  void Work(int index);
  int64_t Take(uint32_t generation);  // runs tasks of that job while there are any; returns how many
  std::vector<std::thread> workers_;
  std::mutex mu_;  // for sleeping only
  std::condition_variable cv_, done_cv_;
  std::atomic<const std::function<void(int64_t)>*> fn_{nullptr};
  std::atomic<int64_t> n_{0};
  std::atomic<uint64_t> next_{0};       // generation << 32 | next task
  std::atomic<uint32_t> published_{0};  // the generation of the last job
  uint32_t generation_ = 0;
  std::atomic<int64_t> completed_{0};  // tasks of this generation that have run
  std::atomic<int> sleepers_{0};       // workers asleep (or about to be) on cv_
  std::atomic<bool> caller_sleeps_{false};
  std::atomic<bool> stop_{false};
  std::chrono::microseconds spin_;  // how long an idle worker spins before it sleeps
};

struct Banks {
  const void* gate;
  const void* up;
  const void* down;
  BankType type;                 // gate and up
  int64_t experts, hidden, ffn;  // E, H, F
  BankType down_type;            // down (a GGUF Q4_K_M layer keeps it in Q6_K)
  // Per-expert biases, float32 (gpt-oss), or null: gate and up [E, F], down [E, H].
  const float* gate_bias = nullptr;
  const float* up_bias = nullptr;
  const float* down_bias = nullptr;
};

// Row r of expert e's [rows, n] matrix in a bank, and the matrix's scale (nvfp4's trailer; 1 for
// the other formats).
inline const uint8_t* BankRow(const void* bank, BankType type, int64_t e, int64_t rows, int64_t n, int64_t r) {
  return static_cast<const uint8_t*>(bank) + e * MatrixBytes(type, rows, n) + r * RowBytes(type, n);
}
float MatrixScale(const void* bank, BankType type, int64_t e, int64_t rows, int64_t n);

class MoeExecutor {
 public:
  MoeExecutor(int threads, IsaTier max_tier, bool pin);
  IsaTier tier() const { return tier_; }
  int threads() const { return pool_.size(); }
  // x: [T, H] float32; out: [T, H] float32, accumulated into.
  void Run(const float* x, int64_t tokens, const int32_t* token_of, const int32_t* expert_of, const float* weight_of, int64_t items,
           const Banks& banks, Act act, float* out);

 private:
  IsaTier tier_;
  ThreadPool pool_;
  std::mutex run_mu_;  // one Run at a time: the pool serves one caller
  // What a job works in, kept from job to job (under run_mu_) up to kKeepBytes: a decode job
  // allocates none of it, so its pages are not handed back to the system and faulted in again on
  // every call; a prompt chunk's (up to hundreds of MB) is released when its job ends.
  struct Scratch {
    static constexpr size_t kKeepBytes = size_t{8} << 20;
    std::vector<uint8_t> xprep, hprep;
    std::vector<float> scale, gu, hidden, partial;
    void Trim();
  } scratch_;
};

}  // namespace freetoken
