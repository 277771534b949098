// The nanobind module `freetoken_jax._cpu_ext`: the CPU side of expert execution.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include "cpu_features.h"

namespace nb = nanobind;

NB_MODULE(_cpu_ext, m) {
  m.doc() = "freetoken_jax CPU expert executor (C++).";
  m.def(
      "supported_tiers",
      [] {
        std::vector<std::string> names;
        for (auto t : freetoken::SupportedTiers()) names.emplace_back(freetoken::TierName(t));
        return names;
      },
      "ISA tiers usable on this CPU, lowest first (scalar, avx2_fma, avx512f, avx512_bf16, amx_bf16).");
}
