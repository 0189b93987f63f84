{
  description = "fdl-prepare: a pinned libtorch and the training binary, built for a GPU box before it dials";

  inputs = {
    # Pinned by revision in the URL: nixos-25.11 as of 2026-05-10, for a
    # Rust new enough for floDl's crates (edition 2024, let-chains: rustc
    # 1.88 or later; nixos-25.05 had 1.86). nix/nixpkgs.nix refuses, at
    # evaluation, a nixpkgs whose rustc is older. There is no flake.lock in
    # the repository yet (it was written offline); the first online run does
    # `nix flake lock` and commits the lock file, which adds the narHash.
    # Without it, every evaluation on a box re-fetches nixpkgs to lock it,
    # and a box without internet cannot evaluate at all.
    #
    # libtorch is NOT taken from this nixpkgs: it is PyTorch's wheels,
    # pinned in nix/wheels.nix (nix/libtorch-wheel.nix).
    nixpkgs.url = "github:NixOS/nixpkgs/8fd9daa3db09ced9700431c5b7ad0e8ba199b575";

    # The training source tree and the directory holding recipe.json. Both
    # default to this flake itself (there is no recipe.json here, so
    # `fdl.training` refuses to evaluate until one is passed); fdl-prepare
    # always overrides them:
    #   --override-input source 'path:/nix/store/…-source?narHash=sha256-…'
    #   --override-input recipe 'path:<state dir>/recipe'
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
      nixpkgs,
      source,
      recipe,
    }:
    let
      # The wiring uses builtins only: evaluating `fdl.variants` or
      # `fdl.contract` must not even fetch nixpkgs, let alone libtorch.
      # nix/wheels.nix pins cpu and cu128 for x86_64, cpu for aarch64 (a
      # variant without a pin for the system fails when its libtorch is
      # evaluated, saying so).
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

      # One nixpkgs per system, shared by everything below: each
      # `import nixpkgs` is a new instantiation (seconds, and memory), and
      # Nix does not share them between calls.
      pkgsBySystem = forSystems (system: import nixpkgs { inherit system; });
      pkgsFor = system: pkgsBySystem.${system};

      # A downstream flake's way to add a variant without touching this
      # repository or the Python side (nix/CONTRACT.md, "Adding a variant").
      mkFdl =
        {
          system,
          source,
          recipe,
          extraVariants ? (_toolchain: { }),
          pkgs ? pkgsFor system,
        }:
        import ./nix/contract.nix {
          inherit
            system
            source
            recipe
            extraVariants
            ;
          toolchain = import ./nix/nixpkgs.nix pkgs;
        };

      flakeRef = "path:${self.outPath}" + (if self ? narHash then "?narHash=${self.narHash}" else "");
    in
    {
      lib = {
        inherit mkFdl;
        # The toolchain-agnostic contract, for flakes that bring their own.
        contract = import ./nix/contract.nix;
      };

      legacyPackages = forSystems (system: {
        fdl = mkFdl { inherit system source recipe; };
      });

      packages = forSystems (
        system:
        let
          pkgs = pkgsFor system;
          fdl-prepare = pkgs.callPackage ./nix/app.nix {
            src = ./.;
            inherit flakeRef;
            # dirtyRev: Nix 2.17 and later; on older ones a dirty tree is "unknown".
            rev = self.rev or self.dirtyRev or "unknown";
          };
        in
        {
          inherit fdl-prepare;
          default = fdl-prepare;
        }
      );

      apps = forSystems (
        system:
        let
          prepare = {
            type = "app";
            program = "${self.packages.${system}.fdl-prepare}/bin/fdl-prepare";
          };
          # `nix run .#publish -- SOURCE_DIR --to URL ...` on the controller:
          # build once, sign, fill the cache the boxes substitute from.
          publish = {
            type = "app";
            program = "${self.packages.${system}.fdl-prepare}/bin/fdl-prepare-publish";
          };
        in
        {
          inherit prepare publish;
          default = prepare;
        }
      );

      # `nix fmt`: the formatter the Nix files here are written in.
      formatter = forSystems (system: (pkgsFor system).nixfmt-rfc-style);

      # `nix flake check`: the app builds, the code gates hold (ruff,
      # mypy --strict, nixfmt; nix/checks.nix), and the NixOS module
      # evaluates as nixpkgs' own NixOS evaluates it, refusing a misspelt key
      # or a mistyped value (nix/module-check.nix). All need current nixpkgs,
      # so they run on a box or a CI that can fetch it; the suite itself runs
      # through scripts/test, which a build sandbox cannot host (it runs the
      # module check's cases against stand-ins, tests/module_eval.nix).
      checks = forSystems (system: {
        app = self.packages.${system}.fdl-prepare;
        gates = (pkgsFor system).callPackage ./nix/checks.nix { src = ./.; };
        module =
          let
            outcome = import ./nix/module-check.nix {
              inherit (nixpkgs) lib;
              evalConfig =
                modules:
                nixpkgs.lib.nixosSystem {
                  modules = [
                    self.nixosModules.default
                    {
                      nixpkgs.hostPlatform = system;
                      boot.isContainer = true;
                      system.stateVersion = "25.11";
                    }
                  ]
                  ++ modules;
                };
              # Every unit, the assertions and the warnings, as
              # `nixos-rebuild build` evaluates them; nothing is built.
              force = evaluated: evaluated.config.system.build.toplevel.drvPath;
            };
          in
          # The typical configuration first, uncaught: if it does not
          # evaluate, its own error says why.
          builtins.seq outcome.typical (
            if outcome.failed == [ ] then
              (pkgsFor system).writeText "fdl-prepare-module-check" (
                builtins.concatStringsSep "\n" (map (r: r.name) outcome.results) + "\n"
              )
            else
              throw "checks.${system}.module: nixosModules.default breaks what nix/module-check.nix holds it to: ${builtins.concatStringsSep "; " outcome.failed}"
          );
      });

      nixosModules.default = import ./nix/module.nix self;
    };
}
