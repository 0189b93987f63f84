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

      # A test (or a person) adds variants without editing this file: an
      # extra.nix here is a function toolchain -> { <label> = { cuda; archs; package; }; }.
      extraVariants = if builtins.pathExists ./extra.nix then import ./extra.nix else (_toolchain: { });

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
            toolchain = import ./toolchain.nix { inherit system; };
          }
        );
      });
    };
}
