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

  # What both halves of the build (nix/cargo-split.nix) set up in the same
  # way, so that cargo sees the same environment in each: a writable copy
  # of the source, the variables of nix/training-env.nix, and what nixpkgs'
  # stdenv gives every build, the production one's build lines included: a
  # linker that takes $NIX_LDFLAGS, and a cargo home that is not $HOME
  # (/homeless-shelter).
  setupScript = ''
    set -eu
    work="$NIX_BUILD_TOP/source"
    cp -R "$src" "$work"
    chmod -R u+w "$work"
    if [ -n "''${roots:-}" ]; then eval "$roots"; fi
    mkdir -p "$NIX_BUILD_TOP/fdl-bin"
    printf '%s' "$ldWrapper" > "$NIX_BUILD_TOP/fdl-bin/cc"
    chmod +x "$NIX_BUILD_TOP/fdl-bin/cc"
    export PATH="$NIX_BUILD_TOP/fdl-bin:$PATH" CARGO_HOME="$NIX_BUILD_TOP/cargo-home"
    if [ -n "''${fdlVendor:-}" ]; then
      mkdir -p "$CARGO_HOME"
      printf '%s\n' '[source.crates-io]' 'replace-with = "fdl-vendored"' '[source.fdl-vendored]' "directory = \"$fdlVendor\"" > "$CARGO_HOME/config.toml"
    fi
    # As the production toolchain runs it (nix/training.nix): the build
    # line, or floDl's default, in `cwd`, offline, cargo's own target dir.
    export CARGO_NET_OFFLINE=true
    unset CARGO_TARGET_DIR CARGO_BUILD_TARGET
  '';

  # The dependencies: the build line on the stubbed tree, then target/.
  # The line may fail on stubs (one that runs the built binary, say): what
  # cargo built until then is kept, and the crate's build does the rest.
  depsScript = setupScript + ''
    cd "$work"
    eval "$writeStubs"
    cd "$work/$cwd"
    /bin/sh -c "$build" || echo "fdl-prepare test flake: the build line exited $? on the dependency-only tree; keeping what it built" >&2
    cd "$work"
    eval "$saveTarget"
  '';

  trainingScript = setupScript + ''
    if [ -n "''${fdlDeps:-}" ]; then
      cd "$work"
      eval "$restoreTarget"
    fi
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
    # The headers' paths the C++ compiler wrote into the binary name the
    # build root; without this it, and libtorch's headers behind it, would
    # be part of the binary's closure (nix/training-env.nix).
    # Likewise the vendored crates' directory, whose sources' paths a newer
    # rustc writes into panic locations (Debian testing's does; 12's not).
    if [ -n "''${fdlRoot:-}" ]; then
      /usr/bin/python3 -I -S -c "$removeReferences" "$out/bin/$binName" "$fdlRoot" ''${fdlVendor:+"$fdlVendor"}
    fi
  '';

  # nixpkgs' remove-references-to, for a host without nixpkgs: the store
  # hash of each given path, wherever it appears, becomes eeee…, which Nix's
  # reference scan no longer finds.
  removeReferences = ''
    import os, sys
    target, *paths = sys.argv[1:]
    data = open(target, "rb").read()
    for path in paths:
        digest = os.path.basename(path)[:32].encode()
        data = data.replace(digest, b"e" * len(digest))
    with open(target, "wb") as f:
        f.write(data)
  '';

  # nixpkgs' importCargoLock + cargoSetupHook, for a host without nixpkgs
  # or network: every registry crate Cargo.lock names, copied into one
  # store directory with the checksum the lock gives it, from the crates
  # this flake carries (./registry) or Debian's packaged ones
  # (/usr/share/cargo/registry, librust-*-dev). As in production, the
  # directory is in the store and named by the lock alone, so both halves
  # of a split build see the crates at one path, which cargo's fingerprints
  # of registry crates hold it to.
  flakeRegistry = if builtins.pathExists ./registry then builtins.path { path = ./registry; name = "fdl-test-registry"; } else null;
  vendorFor =
    lockFile:
    let
      lock = builtins.fromTOML (builtins.readFile lockFile);
      fromRegistry = builtins.filter (
        p: builtins.isString (p.source or null) && builtins.match "registry\\+.*" p.source != null
      ) (lock.package or [ ]);
      line =
        p:
        let
          n = "${p.name}-${p.version}";
          own = flakeRegistry != null && builtins.pathExists "${flakeRegistry}/${n}";
        in
        "${n} ${if own then "${flakeRegistry}/${n}" else "/usr/share/cargo/registry/${n}"} ${p.checksum or "-"}";
    in
    if fromRegistry == [ ] then
      null
    else
      derivation {
        name = "fdl-test-cargo-vendor";
        inherit system;
        crates = builtins.concatStringsSep "\n" (map line fromRegistry);
        builder = sh;
        PATH = hostPath;
        args = [
          "-c"
          ''
            set -eu
            mkdir -p "$out"
            printf '%s\n' "$crates" | while read -r name from sum; do
              if [ ! -d "$from" ]; then
                echo "fdl-prepare test flake: Cargo.lock names $name, which is neither in the flake's registry nor in $from (install Debian's librust-*-dev package of it)" >&2
                exit 1
              fi
              cp -R "$from" "$out/$name"
              chmod -R u+w "$out/$name"
              if [ "$sum" = - ]; then sum=null; else sum="\"$sum\""; fi
              printf '{"package":%s,"files":{}}' "$sum" > "$out/$name/.cargo-checksum.json"
            done
          ''
        ];
      };

  mkRoot =
    name: script:
    derivation {
      inherit name system;
      builder = sh;
      args = [
        "-c"
        ("set -eu\n" + script)
      ];
      PATH = hostPath;
    };
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
      # the unfiltered source and the root names to leave out of it, for the
      # dependency tree (nix/cargo-split.nix)
      originalSource ? src,
      omit ? [ ],
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
            inherit libtorch mkRoot;
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
      line = if build == null then crate.defaultBuild else build;
      vendor = if split == null then null else vendorFor "${split.depsSource}/${crate.lockFileRel}";
      variantName = if variant == null then "notorch" else variant;
      common = {
        inherit system cwd ldWrapper;
        build = line;
        builder = sh;
        PATH = hostPath;
        FDL_LIBTORCH_VARIANT = if variant == null then "" else variant;
      }
      // (if vendor == null then { } else { fdlVendor = vendor; })
      // (
        if env == null then
          { }
        else
          env.env
          // {
            inherit (env) roots;
            NIX_LDFLAGS = ldflags;
          }
      );
      # A cargo project (a Cargo.lock at `cwd` or above) is built in two
      # derivations (nix/cargo-split.nix); anything else in one.
      split =
        if crate.hasLock then
          import (nixDir + "/cargo-split.nix") {
            source = originalSource;
            inherit crate omit;
          }
        else
          null;
      deps =
        if split == null then
          null
        else
          derivation (
            common
            // {
              name = "fdl-test-training-deps-${variantName}";
              src = split.depsSource;
              inherit (split) writeStubs saveTarget;
              args = [
                "-c"
                depsScript
              ];
            }
          );
    in
    assert checked;
    derivation (
      common
      // {
        name = "fdl-test-training-${variantName}";
        inherit src bin removeReferences;
        binName = baseNameOf bin;
        # One path a line, relative to the source root.
        candidates = builtins.concatStringsSep "\n" (crate.binCandidates bin);
        args = [
          "-c"
          trainingScript
        ];
      }
      // (if env == null then { } else { fdlRoot = "${env.root}"; })
      // (
        if deps == null then
          { }
        else
          {
            fdlDeps = deps;
            inherit (split) restoreTarget;
          }
      )
    )
    // {
      # The dependency derivation, for the flake's `trainingDeps` (the
      # runner roots it, `fdl-prepare publish` pushes it); the training
      # derivation itself where there is none.
      inherit deps;
    };

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
