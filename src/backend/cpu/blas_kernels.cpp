// OpenBLAS kernel selection for CPUs that Debian 12's OpenBLAS (0.3.21, DYNAMIC_ARCH) does not
// recognise. It picks its kernels by CPU family and model at load time; a newer CPU, or one a
// hypervisor shows under a generic name ("Intel(R) Xeon(R) Processor": Sapphire Rapids seen
// here), falls back to the Prescott (SSE3) kernels, 2-3x slower GEMMs on AVX2 or AVX-512
// hardware. OpenBLAS reads OPENBLAS_CORETYPE only when it loads, before main, so the process
// executes itself again with the variable naming the kernels its instructions allow (what
// numpy's documentation advises users to set by hand). A variable set by the user is left as it is.
#include <cblas.h>
#include <strings.h>
#include <unistd.h>

#include <cstdlib>
#include <string>

#include "backend/backend.h"

namespace dtrain {

namespace {
constexpr const char* kChosenVar = "DTRAIN_OPENBLAS_CORETYPE_FROM";  // the detected core, for `dtrain info`

const char* kernels_for_this_cpu() {
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512cd"))
    return "SkylakeX";
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return "Haswell";
  return nullptr;
}
}  // namespace

void select_blas_kernels(char** argv) {
  if (std::getenv("OPENBLAS_CORETYPE") || std::getenv(kChosenVar)) return;
  const char* core = openblas_get_corename();
  if (!core || ::strcasecmp(core, "prescott") != 0) return;
  const char* want = kernels_for_this_cpu();
  if (!want) return;
  ::setenv("OPENBLAS_CORETYPE", want, 1);
  ::setenv(kChosenVar, core, 1);
  ::execv("/proc/self/exe", argv);
  // exec failed (no /proc): go on with the generic kernels
  ::unsetenv("OPENBLAS_CORETYPE");
}

std::string blas_kernels_note() {
  const char* core = openblas_get_corename();
  std::string s = core ? core : "unknown";
  if (const char* from = std::getenv(kChosenVar); from && std::getenv("OPENBLAS_CORETYPE"))
    s += std::string(" (chosen by dtrain: OpenBLAS detected ") + from + " on this CPU)";
  else if (std::getenv("OPENBLAS_CORETYPE"))
    s += " (OPENBLAS_CORETYPE)";
  return s;
}

}  // namespace dtrain
