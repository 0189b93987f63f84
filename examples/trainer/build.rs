// The build contract of floDl's flodl-sys, which is what fdl-prepare's flake
// has to satisfy (nix/CONTRACT.md, "floDl's build contract"):
//
// - LIBTORCH_PATH is the only input: one root holding include/ and lib/
//   (default /usr/local/libtorch, as flodl-sys);
// - include/torch/csrc/api/include/torch/torch.h must exist before anything
//   is compiled, so a wrong root fails in a second with a sentence, not
//   after a minute of C++ errors;
// - a C++17 shim is compiled against include/ and
//   include/torch/csrc/api/include, and torch, torch_cpu and c10 are linked;
// - under the `cuda` feature: FLODL_BUILD_CUDA defined, $CUDA_HOME/include
//   added, torch_cuda, c10_cuda, cudart (from $CUDA_HOME/lib64), dl and nccl
//   linked;
// - no rpath is emitted: whoever builds the binary decides where it finds
//   libtorch at run time (the flake: libtorch's lib/ in the store).
//
// flodl-sys uses the `cc` crate for the compile; this crate has no
// dependencies at all (the test flake builds offline, with the
// distribution's cargo), so it runs the C++ compiler itself.

use std::env;
use std::path::PathBuf;
use std::process::{exit, Command};

fn main() {
    println!("cargo:rerun-if-env-changed=LIBTORCH_PATH");
    println!("cargo:rerun-if-env-changed=CXX");
    println!("cargo:rerun-if-changed=shim/shim.cpp");
    println!("cargo:rerun-if-env-changed=CUDA_HOME");
    // As flodl-sys under its `cuda` feature: CUDA_HOME (default
    // /usr/local/cuda) gives include/ to the compile and lib64/ to the link.
    let cuda = env::var_os("CARGO_FEATURE_CUDA").is_some();
    let cuda_home = PathBuf::from(env::var("CUDA_HOME").unwrap_or_else(|_| "/usr/local/cuda".to_string()));

    let root = PathBuf::from(env::var("LIBTORCH_PATH").unwrap_or_else(|_| "/usr/local/libtorch".to_string()));
    let header = root.join("include/torch/csrc/api/include/torch/torch.h");
    if !header.exists() {
        eprintln!(
            "\nexample-trainer: libtorch not found at LIBTORCH_PATH = `{}` (expected `{}` to exist).\n\
             Set LIBTORCH_PATH to a libtorch root holding include/ and lib/; fdl-prepare's flake sets it.\n",
            root.display(),
            header.display()
        );
        exit(1);
    }

    let out = PathBuf::from(env::var("OUT_DIR").expect("cargo sets OUT_DIR"));
    let object = out.join("shim.o");
    let cxx = env::var("CXX").unwrap_or_else(|_| "c++".to_string());
    let include = root.join("include");
    let api = root.join("include/torch/csrc/api/include");
    let mut compile = Command::new(&cxx);
    compile
        .args(["-std=c++17", "-O2", "-fPIC", "-w", "-c", "shim/shim.cpp", "-o"])
        .arg(&object)
        .arg("-I")
        .arg(&include)
        .arg("-I")
        .arg(&api);
    if cuda {
        compile.arg("-DFLODL_BUILD_CUDA=1").arg("-I").arg(cuda_home.join("include"));
    }
    run(&mut compile);

    let archive = out.join("libexample_shim.a");
    let _ = std::fs::remove_file(&archive);
    run(Command::new(env::var("AR").unwrap_or_else(|_| "ar".to_string())).arg("crs").arg(&archive).arg(&object));

    println!("cargo:rustc-link-search=native={}", out.display());
    println!("cargo:rustc-link-lib=static=example_shim");
    println!("cargo:rustc-link-search=native={}", root.join("lib").display());
    println!("cargo:rustc-link-lib=dylib=torch");
    println!("cargo:rustc-link-lib=dylib=torch_cpu");
    println!("cargo:rustc-link-lib=dylib=c10");
    if cuda {
        println!("cargo:rustc-link-lib=dylib=torch_cuda");
        println!("cargo:rustc-link-lib=dylib=c10_cuda");
        println!("cargo:rustc-link-search=native={}", cuda_home.join("lib64").display());
        println!("cargo:rustc-link-lib=dylib=cudart");
        println!("cargo:rustc-link-lib=dylib=dl");
        println!("cargo:rustc-link-lib=dylib=nccl");
    }
    // The shim is C++: its runtime comes last, after everything that needs it.
    println!("cargo:rustc-link-lib=dylib=stdc++");
}

fn run(command: &mut Command) {
    let shown = format!("{:?}", command);
    match command.status() {
        Ok(status) if status.success() => {}
        Ok(status) => {
            eprintln!("example-trainer: `{}` failed ({})", shown, status);
            exit(1);
        }
        Err(error) => {
            eprintln!("example-trainer: cannot run `{}`: {}", shown, error);
            exit(1);
        }
    }
}
