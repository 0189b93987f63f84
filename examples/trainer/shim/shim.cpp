// The C++ side of the example trainer: a two-layer perceptron and plain SGD
// through libtorch's C++ API, behind a C interface the Rust side calls.
// Every entry point catches C++ exceptions and hands back a message instead,
// since an exception must never unwind into Rust.

#include <torch/torch.h>
#include <torch/version.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <string>

namespace {

char* copy_message(const char* what) {
    size_t n = std::strlen(what);
    char* out = static_cast<char*>(std::malloc(n + 1));
    if (out != nullptr) {
        std::memcpy(out, what, n + 1);
    }
    return out;
}

struct Model {
    torch::nn::Sequential net;
    torch::optim::SGD sgd;

    Model(int64_t inputs, int64_t hidden, double lr)
        : net(torch::nn::Linear(inputs, hidden), torch::nn::Tanh(), torch::nn::Linear(hidden, 1)),
          sgd(net->parameters(), torch::optim::SGDOptions(lr)) {}

    torch::Tensor loss(const float* x, const float* y, int64_t rows, int64_t inputs) {
        // from_blob borrows the caller's buffers; clone so the tensors own their data.
        auto features = torch::from_blob(const_cast<float*>(x), {rows, inputs}, torch::kFloat32).clone();
        auto targets = torch::from_blob(const_cast<float*>(y), {rows, 1}, torch::kFloat32).clone();
        return torch::mse_loss(net->forward(features), targets);
    }
};

}  // namespace

extern "C" {

const char* example_torch_version() {
    static const std::string version = std::to_string(TORCH_VERSION_MAJOR) + "." +
                                       std::to_string(TORCH_VERSION_MINOR) + "." +
                                       std::to_string(TORCH_VERSION_PATCH);
    return version.c_str();
}

void* example_model_new(int64_t inputs, int64_t hidden, double lr, uint64_t seed, char** error) {
    try {
        torch::manual_seed(seed);
        return new Model(inputs, hidden, lr);
    } catch (const std::exception& e) {
        *error = copy_message(e.what());
        return nullptr;
    }
}

void example_model_free(void* model) { delete static_cast<Model*>(model); }

// The loss on (x, y) without touching the weights.
int example_loss(void* model, const float* x, const float* y, int64_t rows, int64_t inputs, double* loss,
                 char** error) {
    try {
        torch::NoGradGuard no_grad;
        *loss = static_cast<Model*>(model)->loss(x, y, rows, inputs).item<double>();
        return 0;
    } catch (const std::exception& e) {
        *error = copy_message(e.what());
        return 1;
    }
}

// One training step on (x, y): forward, backward, SGD update. `loss` is the
// loss the step computed, before the update.
int example_step(void* model, const float* x, const float* y, int64_t rows, int64_t inputs, double* loss,
                 char** error) {
    try {
        auto* m = static_cast<Model*>(model);
        m->sgd.zero_grad();
        auto value = m->loss(x, y, rows, inputs);
        value.backward();
        m->sgd.step();
        *loss = value.item<double>();
        return 0;
    } catch (const std::exception& e) {
        *error = copy_message(e.what());
        return 1;
    }
}

void example_message_free(char* message) { std::free(message); }

}  // extern "C"
