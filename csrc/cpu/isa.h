// The SIMD paths a CPU op is compiled for, and how one is chosen at run time: shared by adam.cpp and
// quantize.cpp. Each op supplies its own test of the CPU flags its paths need (`supported`).
#pragma once

#include <c10/util/Exception.h>

#include <string>
#include <vector>

namespace hybrid {
namespace cpu_isa {

enum class Isa : int { kScalar = 0, kAvx2 = 1, kAvx512 = 2 };

constexpr Isa kAll[] = {Isa::kScalar, Isa::kAvx2, Isa::kAvx512};  // slowest first

inline const char* isa_name(Isa isa) {
  switch (isa) {
    case Isa::kAvx512: return "avx512";
    case Isa::kAvx2: return "avx2";
    default: return "scalar";
  }
}

// The fastest path `supported` allows.
template <typename Supported>
Isa best_isa(Supported supported) {
  if (supported(Isa::kAvx512)) return Isa::kAvx512;
  if (supported(Isa::kAvx2)) return Isa::kAvx2;
  return Isa::kScalar;
}

// The names of the paths `supported` allows, slowest first.
template <typename Supported>
std::vector<std::string> supported_names(Supported supported) {
  std::vector<std::string> names;
  for (Isa isa : kAll) {
    if (supported(isa)) names.emplace_back(isa_name(isa));
  }
  return names;
}

// A path forced by name ("" or "auto": the best one). `op` names the op in errors; `hint` ends the error
// for a path this CPU cannot run (what to do instead).
template <typename Supported>
Isa parse_isa(const std::string& name, const char* op, const char* hint, Supported supported) {
  if (name.empty() || name == "auto") return best_isa(supported);
  for (Isa isa : kAll) {
    if (name == isa_name(isa)) {
      TORCH_CHECK(supported(isa), op, ": ISA '", name, "' is not supported by this CPU", hint);
      return isa;
    }
  }
  TORCH_CHECK(false, op, ": unknown ISA '", name, "'; use one of auto, scalar, avx2, avx512");
  return Isa::kScalar;
}

}  // namespace cpu_isa
}  // namespace hybrid
