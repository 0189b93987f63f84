// floDl's flodl-sys contract in small: LIBTORCH_PATH is the only input, the
// shim is compiled with the cc crate against include/ and the C++ API's
// include/, torch, torch_cpu and c10 are linked, no rpath is emitted, and
// the build script reruns only when LIBTORCH_PATH, CUDA_HOME or the shim
// change.
use std::env;
use std::path::PathBuf;

fn main() {
    println!("cargo:rerun-if-changed=shim.cpp");
    println!("cargo:rerun-if-env-changed=LIBTORCH_PATH");
    println!("cargo:rerun-if-env-changed=CUDA_HOME");
    let root = PathBuf::from(env::var("LIBTORCH_PATH").unwrap_or_else(|_| "/usr/local/libtorch".to_string()));
    let api = root.join("include/torch/csrc/api/include");
    if !api.join("torch/torch.h").exists() {
        panic!("fdl-shim-sys: no libtorch at LIBTORCH_PATH = {}", root.display());
    }
    cc::Build::new()
        .cpp(true)
        .flag("-std=c++17")
        .flag("-w")
        .include(root.join("include"))
        .include(api)
        .file("shim.cpp")
        .compile("fdl_shim");
    println!("cargo:rustc-link-search=native={}", root.join("lib").display());
    for lib in ["torch", "torch_cpu", "c10"] {
        println!("cargo:rustc-link-lib=dylib={lib}");
    }
}
