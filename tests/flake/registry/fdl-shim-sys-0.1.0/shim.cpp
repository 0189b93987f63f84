// One call into libtorch through its C++ API, as floDl's shim makes them.
#include <torch/torch.h>

extern "C" double fdl_shim_ones_sum(long long n) {
    return torch::ones({n}, torch::kFloat64).sum().item<double>();
}
