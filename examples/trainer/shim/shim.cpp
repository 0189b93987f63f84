// The C++ side of the example trainer: a two-layer perceptron and plain SGD
// through libtorch's C++ API, behind a C interface the Rust side calls.
// Every entry point catches C++ exceptions and hands back a message instead,
// since an exception must never unwind into Rust.

#include <torch/torch.h>
#include <torch/version.h>

#ifdef FLODL_BUILD_CUDA
// What floDl's ops_cuda.cpp includes under its `cuda` feature; through
// ATen/cuda/CUDAContextLight.h they need cuBLAS, cuBLASLt, cuSPARSE and
// cuSOLVER's headers too, all from $CUDA_HOME/include.
#include <ATen/cuda/CUDAEvent.h>
#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>
#include <nccl.h>
#endif

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

// The CUDA build's view of the box, in one line: what the runtime and NCCL
// it links say, and whether libtorch sees a device. Without a driver (or a
// card) CUDA is simply unavailable, and training runs on the CPU.
const char* example_cuda_status() {
#ifdef FLODL_BUILD_CUDA
    static std::string status;
    try {
        int runtime = 0;
        cudaRuntimeGetVersion(&runtime);
        int nccl = 0;
        ncclGetVersion(&nccl);
        const bool available = torch::cuda::is_available();
        status = "CUDA runtime " + std::to_string(runtime / 1000) + "." + std::to_string((runtime % 1000) / 10) +
                 ", NCCL " + std::to_string(nccl) + ", " +
                 (available ? std::to_string(torch::cuda::device_count()) + " CUDA device(s)"
                            : std::string("CUDA unavailable"));
        if (available) {
            // A stream, an event and a graph on device 0: the headers above
            // in use, and libtorch_cuda linked, not dropped as unneeded.
            auto stream = c10::cuda::getCurrentCUDAStream(0);
            at::cuda::CUDAEvent event;
            event.record(stream);
            event.synchronize();
            at::cuda::CUDAGraph graph;
        }
    } catch (const std::exception& e) {
        status = std::string("CUDA check failed: ") + e.what();
    }
    return status.c_str();
#else
    return "built without CUDA";
#endif
}

}  // extern "C"
