# What a floDl training build must see (nix/CONTRACT.md, "floDl's build
# contract"), as data and shell: builtins only, shared by the production
# toolchain (nix/training.nix) and the test flake's, so the test flake's real
# builds run these very lines.
#
# flodl-sys reads one root, LIBTORCH_PATH, holding include/ and lib/.
# The libtorch derivation splits them (lib/ in `out`, include/ in `dev`), so
# the root is a small derivation of its own (`mkRoot`, the toolchain's way of
# making one from `rootScript`): two links. Its path must be the same string
# in the dependency derivation and in the crate's (nix/cargo-split.nix):
# flodl-sys says `rerun-if-env-changed=LIBTORCH_PATH`, and a root in the
# build directory, which is another directory for each derivation on a box
# without a sandbox, would rerun the C++ shim on every build. Two things
# keep the headers off the boxes that only run the binary:
#   - the RUNPATH is set explicitly, with NIX_LDFLAGS, to libtorch's lib/ in
#     the store (nixpkgs' ld-wrapper, left to itself, would add the root's);
#   - the C++ compiler writes the headers' paths into the binary (__FILE__ in
#     c10's asserts), which would make the root, and through it `dev`, part
#     of the binary's closure: the toolchain strips references to the root
#     from the installed binary (`root` below), as nixpkgs'
#     remove-references-to does. The strings stay as text; they only name
#     where a header was.
# CUDA_HOME is in the same root, with the lib64/ flodl-sys links cudart and
# NCCL from (the CUDA libtorch's `cuda` output: link names and sonames).
{
  # nix/libtorch-wheel.nix's shape: `out` (lib/) and `dev` (include/)
  libtorch,
  # null (a CPU build) or { version; include; lib; nccl; lib64 ? lib; }:
  # store paths of the CUDA headers, of the runtime's and NCCL's libraries
  # (the binary's RUNPATH), and of the directory with the link names
  # (libcudart.so, libnccl.so) that becomes CUDA_HOME/lib64.
  cuda ? null,
  # name -> shell script that fills $out -> derivation (the toolchain's)
  mkRoot,
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
  # The root: libtorch/ (lib, include) and, for CUDA, cuda/ (include,
  # lib64), each a link into the store.
  root = mkRoot "fdl-build-root" (
    ''
      mkdir -p "$out/libtorch"
      ln -s '${out}/lib' "$out/libtorch/lib"
      ln -s '${dev}/include' "$out/libtorch/include"
    ''
    + (
      if cuda == null then
        ""
      else
        ''
          mkdir -p "$out/cuda"
          ln -s '${cuda.include}' "$out/cuda/include"
          ln -s '${cuda.lib64 or cuda.lib}' "$out/cuda/lib64"
        ''
    )
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

  inherit root;

  # Run before the build: exports LIBTORCH_PATH (and CUDA_HOME).
  roots =
    let
      r = "${root}";
    in
    ''
      export LIBTORCH_PATH='${r}/libtorch'
    ''
    + (if cuda == null then "" else "export CUDA_HOME='${r}/cuda'\n");
}
