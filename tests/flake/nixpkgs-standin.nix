# A stand-in for nixpkgs, for evaluating the production flake's wiring with
# Nix 2.8, which cannot evaluate current nixpkgs. tests/test_flake.py puts it
# in a directory as default.nix, beside nixpkgs' real lib/ (NIXPKGS_LIB) and a
# one-line flake.nix, and passes that as `--override-input nixpkgs path:…`.
#
# `lib` is nixpkgs' own; the packages are the least that records what the
# production code asks of them: libtorch-bin keeps its version, src and
# cudaSupport where a test can read them, buildRustPackage and
# buildPythonApplication hand back their arguments. Nothing here builds.
{ system, ... }:
let
  lib = import ./lib;

  tool = name: { outPath = "/nix/store/00000000000000000000000000000000-${name}"; };

  mkLibtorch =
    attrs:
    derivation {
      name = "libtorch-${attrs.version}-${if attrs.cudaSupport then "cuda" else "cpu"}";
      inherit system;
      builder = "/bin/sh";
      args = [
        "-c"
        "exit 1"
      ];
      outputs = [
        "out"
        "dev"
      ];
    }
    // {
      inherit (attrs) version src cudaSupport;
      override = args: mkLibtorch (attrs // args);
      overrideAttrs = f: mkLibtorch (attrs // f attrs);
    };

  pkgs = {
    inherit lib system;

    fetchzip = args: args // { fetcher = "fetchzip"; };

    libtorch-bin = mkLibtorch {
      version = "2.5.0";
      src = "nixpkgs' own archive";
      cudaSupport = false;
    };

    rustPlatform.buildRustPackage = args: args // { builtWith = "buildRustPackage"; };

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

    python3.withPackages = f: {
      pythonWith = map (p: p.outPath) (f pkgs.python3Packages);
      outPath = "/nix/store/00000000000000000000000000000000-python3-env";
    };
    ruff = tool "ruff";
    nixfmt-rfc-style = tool "nixfmt";
    runCommand = name: attrs: script: attrs // { inherit name script; builtWith = "runCommand"; };

    nix = tool "nix";
    sshfs = tool "sshfs";
    fuse = tool "fuse";
    fuse3 = tool "fuse3";
    openssh = tool "openssh";
    git = tool "git";

    callPackage =
      path: args:
      let
        f = import path;
      in
      f (builtins.intersectAttrs (builtins.functionArgs f) pkgs // args);
  };
in
pkgs
