# What a floDl training build must see (nix/CONTRACT.md, "floDl's build
# contract"), as data and one shell snippet: builtins only, shared by the
# production toolchain (nix/training.nix) and the test flake's, so the test
# flake's real builds run these very lines.
#
# flodl-sys reads one root, LIBTORCH_PATH, holding include/ and lib/.
# nixpkgs' libtorch-bin splits them (lib/ in `out`, include/ in `dev`), and
# the two obvious ways of joining them are both wrong:
#   - a merged root in the store: the binary's RUNPATH names it, so every
#     box downloads the 39 MB of headers it references;
#   - a merged root in the build directory: nixpkgs' ld-wrapper adds a
#     RUNPATH only for -L directories in the store, so the binary cannot
#     find libtorch_cpu.so at run time.
# So the root is made in the build directory, where nothing in the output
# can refer to it, and the RUNPATH is set explicitly, with NIX_LDFLAGS, to
# libtorch's lib/ in the store. CUDA_HOME is made the same way, with the
# lib64/ flodl-sys links cudart from (nixpkgs' CUDA packages have lib/).
{
  # nixpkgs' libtorch-bin shape: `out` (lib/) and `dev` (include/)
  libtorch,
  # null (a CPU build) or { version; include; lib; nccl; lib64 ? lib; }:
  # store paths of the CUDA headers, of the runtime's and NCCL's libraries
  # (the binary's RUNPATH), and of the directory with the link names
  # (libcudart.so, libnccl.so) that becomes CUDA_HOME/lib64.
  cuda ? null,
}:
let
  out = "${libtorch.out or libtorch}";
  dev = "${libtorch.dev or libtorch.out or libtorch}";

  rpath =
    [ "${out}/lib" ]
    ++ (
      if cuda == null then
        [ ]
      else
        [
          cuda.lib
          cuda.nccl
        ]
    );
in
{
  inherit rpath;

  # Where a Nix-built program finds the NVIDIA driver's libcuda.so.1 (and
  # the libnvidia-ml.so.1 floDl's shim dlopens): a CUDA binary needs it on
  # its RUNPATH too. nixpkgs adds it after the build (autoAddDriverRunpath);
  # the test flake passes it to the linker.
  driverDir = "/run/opengl-driver/lib";

  env = {
    # tch-rs' convention, for sources built on tch: torch-sys appends lib/
    # and include/ to these itself.
    LIBTORCH = out;
    LIBTORCH_LIB = out;
    LIBTORCH_INCLUDE = dev;
    # floDl's build_env: the vendor's cargo feature, empty for a CPU
    # variant (cargo takes `--features ""`).
    FDL_GPU_FEATURE = if cuda == null then "" else "cuda";
    # Linker arguments, as nixpkgs' ld-wrapper takes them (and the test
    # flake's stand-in for it).
    NIX_LDFLAGS = builtins.concatStringsSep " " (map (d: "-rpath ${d}") rpath);
  }
  // (if cuda == null then { } else { FDL_CUDA_VERSION = cuda.version; });

  # Run before the build: makes the roots under $NIX_BUILD_TOP and exports
  # LIBTORCH_PATH (and CUDA_HOME).
  roots = ''
    fdl_roots="$NIX_BUILD_TOP/fdl-roots"
    mkdir -p "$fdl_roots/libtorch"
    ln -sfn '${out}/lib' "$fdl_roots/libtorch/lib"
    ln -sfn '${dev}/include' "$fdl_roots/libtorch/include"
    export LIBTORCH_PATH="$fdl_roots/libtorch"
  ''
  + (
    if cuda == null then
      ""
    else
      ''
        mkdir -p "$fdl_roots/cuda"
        ln -sfn '${cuda.include}' "$fdl_roots/cuda/include"
        ln -sfn '${cuda.lib64 or cuda.lib}' "$fdl_roots/cuda/lib64"
        export CUDA_HOME="$fdl_roots/cuda"
      ''
  );
}
