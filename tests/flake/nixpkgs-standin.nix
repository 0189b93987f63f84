# A stand-in for nixpkgs, for evaluating the production flake's wiring with
# Nix 2.8, which cannot evaluate current nixpkgs. tests/test_flake.py puts it
# in a directory as default.nix, beside nixpkgs' real lib/ (NIXPKGS_LIB) and a
# one-line flake.nix, and passes that as `--override-input nixpkgs path:…`.
#
# `lib` is nixpkgs' own; the packages are the least that records what the
# production code asks of them: libtorch-bin keeps its version, src and
# cudaSupport where a test can read them, buildRustPackage and
# buildPythonApplication hand back their arguments, the CUDA packages are
# store paths named after what they stand for, and the `config` the flake
# instantiated nixpkgs with is kept. Nothing here builds.
{
  system,
  config ? { },
  ...
}:
let
  lib = import ./lib;

  tool = name: { outPath = "/nix/store/00000000000000000000000000000000-${name}"; };

  # A package with nixpkgs' split outputs (`include`, `lib`, ...), each its
  # own store path.
  split =
    pname: version: outputs:
    let
      path = output: "/nix/store/00000000000000000000000000000000-${pname}-${version}-${output}";
      self =
        {
          inherit pname version outputs;
          name = "${pname}-${version}";
          outPath = path "out";
        }
        // builtins.listToAttrs (
          map (output: {
            name = output;
            value = self // {
              outPath = path output;
              outputSpecified = true;
            };
          }) outputs
        );
    in
    self;

  cudaPackagesOf = version: {
    cuda_cudart = split "cuda_cudart" version [
      "out"
      "include"
      "lib"
      "dev"
    ];
    nccl = split "nccl" version [
      "out"
      "dev"
    ];
  };

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
    inherit lib system config;

    rustc = {
      version = "1.91.1";
      outPath = "/nix/store/00000000000000000000000000000000-rustc-1.91.1";
    };
    autoAddDriverRunpath = tool "auto-add-driver-runpath-hook";
    cudaPackages_12_6 = cudaPackagesOf "12.6";
    cudaPackages_12_8 = cudaPackagesOf "12.8";

    fetchzip = args: args // { fetcher = "fetchzip"; };

    libtorch-bin = mkLibtorch {
      version = "2.5.0";
      src = "nixpkgs' own archive";
      cudaSupport = false;
    };

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

    python3.withPackages = f: {
      pythonWith = map (p: p.outPath) (f pkgs.python3Packages);
      outPath = "/nix/store/00000000000000000000000000000000-python3-env";
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
