# A stand-in for nixpkgs, for evaluating the production flake's wiring with
# Nix 2.8, which cannot evaluate current nixpkgs. tests/test_flake.py puts it
# in a directory as default.nix, beside nixpkgs' real lib/ (NIXPKGS_LIB) and a
# one-line flake.nix, and passes that as `--override-input nixpkgs path:…`.
#
# `lib` is nixpkgs' own; the packages are the least that records what the
# production code asks of them: the tools libtorch's wheels are unpacked with
# are store paths named after what they stand for, buildRustPackage and
# buildPythonApplication hand back their arguments, and the `config` the
# flake instantiated nixpkgs with is kept. Nothing here builds.
{
  system,
  config ? { },
  ...
}:
let
  lib = import ./lib;

  tool = name: { outPath = "/nix/store/00000000000000000000000000000000-${name}"; };

  pkgs = {
    inherit lib system config;

    rustc = {
      version = "1.91.1";
      outPath = "/nix/store/00000000000000000000000000000000-rustc-1.91.1";
    };
    autoAddDriverRunpath = tool "auto-add-driver-runpath-hook";
    # What nix/libtorch-wheel.nix builds with, in production.
    bash = tool "bash";
    python3 = tool "python3" // {
      withPackages = f: {
        pythonWith = map (p: p.outPath) (f pkgs.python3Packages);
        outPath = "/nix/store/00000000000000000000000000000000-python3-env";
      };
    };
    patchelf = tool "patchelf";
    coreutils = tool "coreutils";

    rustPlatform.buildRustPackage =
      args:
      args
      // {
        builtWith = "buildRustPackage";
        nixpkgsConfig = config;
      };

    python3Packages = {
      buildPythonApplication =
        args:
        args
        // {
          builtWith = "buildPythonApplication";
          outPath = "/nix/store/00000000000000000000000000000000-fdl-prepare";
        };
      setuptools = tool "setuptools";
      nvidia-ml-py = tool "nvidia-ml-py";
      sh = tool "sh";
      typer = tool "typer";
      rich = tool "rich";
      mypy = tool "mypy";
      pytest = tool "pytest";
    };

    ruff = tool "ruff";
    nixfmt-rfc-style = tool "nixfmt";
    runCommand =
      name: attrs: script:
      attrs
      // {
        inherit name script;
        builtWith = "runCommand";
        outPath = "/nix/store/00000000000000000000000000000000-${name}";
      };

    removeReferencesTo = tool "remove-references-to";
    nix = tool "nix";
    sshfs = tool "sshfs";
    fuse = tool "fuse";
    fuse3 = tool "fuse3";
    openssh = tool "openssh";
    rsync = tool "rsync";
    git = tool "git";

    callPackage =
      path: args:
      let
        f = import path;
      in
      f (builtins.intersectAttrs (builtins.functionArgs f) pkgs // args);
  };
in
# Counted by the test that nixpkgs is instantiated once per system.
builtins.trace "fdl-standin: nixpkgs instantiated for ${system}" pkgs
