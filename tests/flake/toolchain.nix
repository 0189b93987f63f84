# A toolchain without nixpkgs, for the test flake: the same interface as
# nix/nixpkgs.nix, built from the host's /bin/sh and /usr/bin tools.
#
# The builders run the host's shell, coreutils, python3, cargo and C++
# compiler, always by path (/usr/bin), never from the caller's PATH: a
# rustup cargo in someone's home is not part of any box. Without a sandbox
# (Debian 12's nix-bin) they simply see them; with one (Debian 13 and NixOS
# ship `sandbox = true`) the host must lend them to the sandbox, as the tests
# and scripts/demo do:
#   sandbox-paths = /bin/sh=<the real /bin/sh> /usr /lib /lib64 /etc/alternatives
# (tests/nix_fixtures.py `SANDBOX_LENT`; /etc/alternatives is where
# Debian's c++ and cc point). Without that, every build here fails with
# "mkdir: command not found", which fdl-prepare names as the flake's
# failure, not the training source's.
{
  system,
  # nix/ (cargo.nix, training-env.nix): the code the production toolchain
  # shares with this one.
  nixDir,
  # true: the cpu variant is the /bin/sh stand-in too, for the many tests
  # that exercise only variant logic (a flat copy with stand-in.nix).
  standInCpu ? false,
}:
let
  sh = "/bin/sh";
  hostPath = "/usr/bin:/bin";

  libtorchScript = ''
    set -eu
    mkdir -p "$out/lib" "$out/share" "$dev/include/torch"
    printf '%s\n' "$label" > "$out/share/fdl-libtorch-variant"
    printf 'stand-in for libtorch (%s)\n' "$label" > "$out/lib/libtorch.so"
    printf '/* stand-in for the libtorch headers (%s) */\n' "$label" > "$dev/include/torch/torch.h"
  '';

  # Shaped like nixpkgs' libtorch-bin: `out` and `dev` outputs and
  # `.override { cudaSupport = true; }`, which is all nix/libtorch.nix uses.
  # `label` names an extra stand-in (tests/flake/extra.nix).
  mkLibtorch =
    {
      cudaSupport ? false,
      label ? (if cudaSupport then "cuda" else "cpu"),
    }:
    derivation {
      name = "fdl-test-libtorch-${label}";
      inherit system label;
      builder = sh;
      args = [
        "-c"
        libtorchScript
      ];
      outputs = [
        "out"
        "dev"
      ];
      PATH = hostPath;
    }
    // {
      override = args: mkLibtorch ({ inherit cudaSupport; } // args);
    };

  # The real libtorch, from PyTorch's wheels by nix/libtorch-wheel.nix, the
  # production flake's own derivation, with the host's tools by path.
  # python3 -I -S: the host's interpreter without site-packages or /etc, the
  # same in and out of a sandbox; patchelf (scripts/setup installs it) only
  # for a CUDA variant, whose libraries are re-pointed at their layout in the
  # store and at the driver directory.
  wheelTools = {
    inherit sh;
    python = "/usr/bin/python3";
    patchelf = "/usr/bin/patchelf";
    path = hostPath;
  };
  wheels = import (nixDir + "/libtorch-wheel.nix") {
    inherit system;
    tools = wheelTools;
  };

  # The cpu variant is PyTorch's 2.13.0 CPU wheel rather than the production
  # flake's 2.10.0 one: it is the CPU wheel these hosts' pip can get
  # (scripts/setup), and its hash is the one pip checked. The cu128 variant
  # is the production pin itself (nix/wheels.nix).
  cpuPin = {
    version = "2.13.0";
    cuda = null;
    archs = [ ];
    wheels.x86_64-linux = [
      {
        url = "https://download.pytorch.org/whl/cpu/torch-2.13.0%2Bcpu-cp311-cp311-manylinux_2_28_x86_64.whl";
        sha256 = "6746dbcbeb526eb61330b76b41ff1b4eb848951103a892eeb080dfa2b264667b";
      }
    ];
  };
  torchWheel = wheels.fetchWheel (builtins.head cpuPin.wheels.x86_64-linux);

  # A CUDA toolkit stand-in with the shape the production flake gives
  # CUDA_HOME's parts: headers, the runtime's lib/ and NCCL's lib/.
  cudaStandIn =
    version:
    let
      drv = derivation {
        name = "fdl-test-cuda-${version}";
        inherit system version;
        builder = sh;
        args = [
          "-c"
          ''
            set -eu
            mkdir -p "$out/include" "$out/lib" "$out/nccl/lib"
            printf '/* stand-in for the CUDA %s runtime headers */\n' "$version" > "$out/include/cuda_runtime.h"
            printf 'stand-in for libcudart (CUDA %s)\n' "$version" > "$out/lib/libcudart.so"
            printf 'stand-in for libnccl (CUDA %s)\n' "$version" > "$out/nccl/lib/libnccl.so"
          ''
        ];
        PATH = hostPath;
      };
    in
    {
      inherit version;
      include = "${drv}/include";
      lib = "${drv}/lib";
      nccl = "${drv}/nccl/lib";
    };

  # A real CUDA variant's parts: CUDA_HOME is the libtorch's `cuda` output,
  # the libraries the binary loads are in its `out`.
  cudaOf =
    version: libtorch:
    {
      inherit version;
      include = "${libtorch.cuda}/include";
      lib64 = "${libtorch.cuda}/lib64";
      lib = "${libtorch.out}/nvidia/cuda_runtime/lib";
      nccl = "${libtorch.out}/nvidia/nccl/lib";
    };

  # nixpkgs' ld-wrapper hands $NIX_LDFLAGS to every link; the host's cc does
  # not, so this one does. rustc links with `cc`, first on PATH.
  ldWrapper = ''
    #!/bin/sh
    for flag in $NIX_LDFLAGS; do set -- "$@" "-Wl,$flag"; done
    exec /usr/bin/cc "$@"
  '';

  trainingScript = ''
    set -eu
    work="$NIX_BUILD_TOP/source"
    cp -R "$src" "$work"
    chmod -R u+w "$work"
    if [ -n "''${roots:-}" ]; then eval "$roots"; fi
    # What nixpkgs' stdenv gives every build, the production one's build
    # lines included: a linker that takes $NIX_LDFLAGS, and a cargo home
    # that is not $HOME (/homeless-shelter).
    mkdir -p "$NIX_BUILD_TOP/fdl-bin"
    printf '%s' "$ldWrapper" > "$NIX_BUILD_TOP/fdl-bin/cc"
    chmod +x "$NIX_BUILD_TOP/fdl-bin/cc"
    export PATH="$NIX_BUILD_TOP/fdl-bin:$PATH" CARGO_HOME="$NIX_BUILD_TOP/cargo-home"
    # As the production toolchain runs it (nix/training.nix): the build
    # line, or floDl's default, in `cwd`, offline, cargo's own target dir.
    export CARGO_NET_OFFLINE=true
    unset CARGO_TARGET_DIR CARGO_BUILD_TARGET
    cd "$work/$cwd"
    /bin/sh -c "$build" || {
      rc=$?
      echo "fdl-prepare test flake: the build line exited $rc" >&2
      exit "$rc"
    }
    cd "$work"
    found=
    while IFS= read -r f; do
      if [ -f "$f" ]; then found=$f; break; fi
    done <<EOF
    $candidates
    EOF
    if [ -z "$found" ]; then
      echo "fdl-prepare test flake: the build produced no file '$bin' relative to cwd '$cwd' (looked for: $(printf '%s' "$candidates" | tr '\n' ' ')); publish a run whose bin is the path the build writes, relative to cwd (target/release/NAME; ../target/release/NAME for a workspace member)" >&2
      exit 1
    fi
    mkdir -p "$out/bin"
    cp "$found" "$out/bin/$binName"
    chmod 0755 "$out/bin/$binName"
  '';
in
{
  inherit wheelTools mkLibtorch torchWheel;
  libtorchPins.cpu = cpuPin;
  # With a stand-in.nix, every shipped variant is a /bin/sh stand-in.
  libtorchStandIns =
    if standInCpu then
      {
        cpu = mkLibtorch { };
        cu128 = mkLibtorch { cudaSupport = true; };
      }
    else
      { };
  # The cu128 wheels, for the fixtures that check the store holds them.
  cudaWheels = map wheels.fetchWheel wheels.pins.variants.cu128.wheels.x86_64-linux;

  # The recipe's build line (a test steers success, failure (exit 3), a
  # hang (sleep) or a change through the source tree alone), or without
  # one floDl's `cargo build --release`, runs with /bin/sh in a writable
  # copy of the source at `cwd`, as the production flake runs it: offline,
  # LIBTORCH_PATH and FDL_GPU_FEATURE set, the RUNPATH at libtorch's lib/ in
  # the store; then `bin`, relative to `cwd`, is installed.
  buildTraining =
    {
      src,
      cwd,
      build,
      bin,
      libtorch,
      variant,
      cuda ? null,
      ...
    }:
    let
      crate = import (nixDir + "/cargo.nix") { inherit src cwd; };
      cudaParts =
        if cuda == null then
          null
        else if libtorch ? cuda then
          cudaOf cuda libtorch
        else
          cudaStandIn cuda;
      env =
        if libtorch == null then
          null
        else
          import (nixDir + "/training-env.nix") {
            inherit libtorch;
            cuda = cudaParts;
          };
      # Without a build line the recipe is floDl's default, a cargo build,
      # whose crate is checked as the production toolchain checks it.
      useCargo = build == null;
      checked = if useCargo then builtins.seq crate.lockDir (crate.check { }) else true;
      ldflags =
        if env == null then
          ""
        else
          env.env.NIX_LDFLAGS + (if cuda == null then "" else " -rpath ${env.driverDir}");
    in
    assert checked;
    derivation (
      {
        name = "fdl-test-training-${if variant == null then "notorch" else variant}";
        inherit
          system
          src
          cwd
          bin
          ldWrapper
          ;
        binName = baseNameOf bin;
        build = if build == null then crate.defaultBuild else build;
        # One path a line, relative to the source root.
        candidates = builtins.concatStringsSep "\n" (crate.binCandidates bin);
        builder = sh;
        args = [
          "-c"
          trainingScript
        ];
        PATH = hostPath;
        FDL_LIBTORCH_VARIANT = if variant == null then "" else variant;
      }
      // (
        if env == null then
          { }
        else
          env.env
          // {
            inherit (env) roots;
            NIX_LDFLAGS = ldflags;
          }
      )
    );

  # A fixed-output derivation whose output is `text`, checked against `hash`
  # (SRI). Give it a wrong hash to get a real hash mismatch.
  fixedOutput =
    {
      name,
      text,
      hash,
    }:
    derivation {
      inherit name system text;
      builder = sh;
      args = [
        "-c"
        "printf '%s' \"$text\" > \"$out\""
      ];
      PATH = hostPath;
      outputHashMode = "flat";
      outputHash = hash;
    };
}
