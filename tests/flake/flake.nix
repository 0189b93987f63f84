{
  description = "fdl-prepare test flake: the flake contract from the same nix/ code, without nixpkgs";

  # Same inputs as the production flake, same defaults: the runner overrides
  # both with --override-input.
  inputs = {
    source = {
      follows = "";
      flake = false;
    };
    recipe = {
      follows = "";
      flake = false;
    };
  };

  outputs =
    {
      self,
      source,
      recipe,
    }:
    let
      # In the repository (git+file:///repo?dir=tests/flake) the shared code is
      # ../../nix; a flat copy (flake.nix, toolchain.nix and nix/ side by side,
      # referenced as path:) carries it as ./nix. nix/CONTRACT.md has both.
      nixDir =
        if builtins.pathExists ./nix then
          ./nix
        else if builtins.pathExists ../../nix/contract.nix then
          ../../nix
        else
          throw "fdl-prepare test flake: no nix/ beside flake.nix and no ../../nix; reference it as git+file://<repo>?dir=tests/flake or copy nix/ next to it";

      # ROCm stand-ins, so `auto` and coverage can route AMD boxes without
      # nixpkgs. The gfx lists are real: the targets PyTorch's libtorch image
      # script (.ci/docker/libtorch/build.sh) passes as PYTORCH_ROCM_ARCH,
      # before gfx950, gfx1150 and gfx1151 were added (rocm6.4) and after,
      # with ROCm 7.0.2 (rocm7.0). The production flake has no ROCm variant
      # (nix/libtorch.nix says why).
      rocmStandIns = toolchain: {
        "rocm6.4" = {
          vendor = "amd";
          rocm = "6.4";
          cuda = null;
          archs = [ ];
          gfx = [
            "gfx900"
            "gfx906"
            "gfx908"
            "gfx90a"
            "gfx942"
            "gfx1030"
            "gfx1100"
            "gfx1101"
            "gfx1102"
            "gfx1200"
            "gfx1201"
          ];
          package = toolchain.mkLibtorch { label = "rocm6.4"; };
        };
        "rocm7.0" = {
          vendor = "amd";
          rocm = "7.0";
          cuda = null;
          archs = [ ];
          gfx = [
            "gfx900"
            "gfx906"
            "gfx908"
            "gfx90a"
            "gfx942"
            "gfx1030"
            "gfx1100"
            "gfx1101"
            "gfx1102"
            "gfx1200"
            "gfx1201"
            "gfx950"
            "gfx1150"
            "gfx1151"
          ];
          package = toolchain.mkLibtorch { label = "rocm7.0"; };
        };
      };

      # A test (or a person) adds variants without editing this file: an
      # extra.nix here is a function toolchain -> { <label> = { cuda; archs; package; }; },
      # merged over the stand-ins above (a label that exists is replaced).
      extraVariants =
        toolchain:
        rocmStandIns toolchain
        // (if builtins.pathExists ./extra.nix then import ./extra.nix toolchain else { });

      # An evaluation as costly as nixpkgs' (seconds, not milliseconds), for
      # the warm-path tests and bench/warm_path.py: a heavy.nix here holds
      # the size of an attribute set generated on the way to `fdl`. Reading
      # the flake's metadata does not evaluate it; evaluating `fdl` does.
      weight = if builtins.pathExists ./heavy.nix then import ./heavy.nix else 0;
      generated = builtins.listToAttrs (
        builtins.genList (i: {
          name = "a${toString i}";
          value = i;
        }) weight
      );
      settled = builtins.length (builtins.attrNames generated);

      # A stand-in.nix here (holding `true`) makes the cpu variant the /bin/sh
      # stand-in as well, for the many tests that exercise only variant logic
      # and would otherwise each need PyTorch's wheel; without it, cpu is the
      # real libtorch (toolchain.nix).
      standIn = builtins.pathExists ./stand-in.nix && import ./stand-in.nix;

      systems = [
        "x86_64-linux"
        "aarch64-linux"
      ];
      forSystems =
        f:
        builtins.listToAttrs (
          map (system: {
            name = system;
            value = f system;
          }) systems
        );
    in
    {
      legacyPackages = forSystems (system: {
        fdl = builtins.seq settled (
          import (nixDir + "/contract.nix") {
            inherit
              system
              source
              recipe
              extraVariants
              ;
            toolchain = import ./toolchain.nix {
              inherit system nixDir;
              standInCpu = standIn;
            };
          }
        );
      });
    };
}
