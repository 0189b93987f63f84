# A toolchain without nixpkgs, for the test flake: the same interface as
# nix/nixpkgs.nix, built from the host's /bin/sh and /usr/bin tools.
#
# The builders run the host's shell and coreutils. Without a sandbox
# (Debian 12's nix-bin) they simply see them; with one (Debian 13 and NixOS
# ship `sandbox = true`) the host must lend them to the sandbox, as the
# tests and scripts/demo do:
#   sandbox-paths = /bin/sh=<the real /bin/sh> /usr /lib /lib64
# (tests/nix_fixtures.py `SANDBOX_LENT`). Without that, every build here
# fails with "mkdir: command not found", which fdl-prepare names as the
# flake's failure, not the training source's.
{ system }:
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

  trainingScript = ''
    set -eu
    work="$NIX_BUILD_TOP/source"
    cp -R "$src" "$work"
    chmod -R u+w "$work"
    cd "$work/$cwd"
    if [ "$hasBuild" = 1 ]; then
      /bin/sh -c "$build" || {
        rc=$?
        echo "fdl-prepare test flake: the build line exited $rc" >&2
        exit "$rc"
      }
    fi
    if [ ! -f "$bin" ]; then
      echo "fdl-prepare test flake: the build produced no file '$bin' in '$cwd'; set bin in .fdl-run.toml or source.bin" >&2
      exit 1
    fi
    mkdir -p "$out/bin"
    cp "$bin" "$out/bin/$binName"
    chmod 0755 "$out/bin/$binName"
  '';
in
{
  libtorch-bin = mkLibtorch { };
  inherit mkLibtorch;

  # Runs the recipe's build line with /bin/sh in a writable copy of the
  # source at `cwd`, then installs `bin`: a test steers success, failure
  # (exit 3), a hang (sleep) or a change through the source tree alone.
  buildTraining =
    {
      src,
      cwd,
      build,
      bin,
      libtorch,
      variant,
      ...
    }:
    derivation (
      {
        name = "fdl-test-training-${if variant == null then "notorch" else variant}";
        inherit system src cwd bin;
        binName = baseNameOf bin;
        hasBuild = if build == null then "0" else "1";
        build = if build == null then "" else build;
        builder = sh;
        args = [
          "-c"
          trainingScript
        ];
        PATH = hostPath;
        FDL_LIBTORCH_VARIANT = if variant == null then "" else variant;
      }
      // (
        if libtorch == null then
          { }
        else
          {
            LIBTORCH = "${libtorch.out or libtorch}";
            LIBTORCH_LIB = "${libtorch.out or libtorch}";
            LIBTORCH_INCLUDE = "${libtorch.dev or libtorch.out or libtorch}";
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
