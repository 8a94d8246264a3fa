#include "backend/unfused.h"

#include <cstdlib>
#include <sstream>

#include "core/error.h"

namespace dtrain {

CudaUnfused parse_cuda_unfused(const std::string& value) {
  CudaUnfused u;
  std::stringstream ss(value);
  for (std::string item; std::getline(ss, item, ',');) {
    const size_t b = item.find_first_not_of(" \t"), e = item.find_last_not_of(" \t");
    item = b == std::string::npos ? "" : item.substr(b, e - b + 1);
    if (item.empty()) continue;
    if (item == "gelu_epilogue") {
      u.gelu_epilogue = true;
    } else if (item == "bgrad_epilogue") {
      u.bgrad_epilogue = true;
    } else if (item == "conv_cat") {
      u.conv_cat = true;
    } else if (item == "all") {
      u.gelu_epilogue = u.bgrad_epilogue = u.conv_cat = true;
    } else {
      user_error("DTRAIN_CUDA_UNFUSED: unknown '{}' (expected a comma-separated list of gelu_epilogue, "
                 "bgrad_epilogue, conv_cat, all)",
                 item);
    }
  }
  return u;
}

CudaUnfused cuda_unfused_from_env() {
  const char* v = std::getenv("DTRAIN_CUDA_UNFUSED");
  return parse_cuda_unfused(v ? v : "");
}

}  // namespace dtrain
