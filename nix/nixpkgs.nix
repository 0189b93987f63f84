# The production toolchain: what nix/contract.nix needs, taken from a nixpkgs
# package set. Every attribute is a thunk over `pkgs`, so evaluating the
# variants metadata never imports nixpkgs (nor fetches it). Kept thin: what
# can be decided without nixpkgs lives in nix/cargo.nix and
# nix/training-env.nix, where the test flake exercises it.
pkgs:
let
  inherit (pkgs) lib fetchzip;

  # libtorch is pinned here rather than taken as nixpkgs ships it, because no
  # nixpkgs branch carried libtorch-bin 2.7.0: master went from 2.5.0+cu124
  # (also what nixos-25.05 has) to 2.9.0+cu130 in NixOS/nixpkgs#456389, and
  # the 2.7.0+cu128 bump, NixOS/nixpkgs#412902, was closed without merging. We keep nixpkgs' recipe
  # (bin.nix: split out/dev outputs, rpath fix-ups, `cudaSupport` switch) and
  # swap in the 2.7.0 archives, with the hashes that PR computed for them
  # (`nix-prefetch-url --unpack`, i.e. fetchzip's hash of the unpacked tree).
  #
  # floDl itself pins 2.10.0 (cpu, cu126, cu128: flodl-cli/src/libtorch/
  # download.rs, archives named libtorch-shared-with-deps-2.10.0%2B<variant>.zip).
  # No source that can be cited carries hashes for those archives (nixpkgs
  # never had libtorch-bin 2.10.0, floDl verifies none), and a hash computed
  # here from a download nobody vouches for is not a pin. So 2.7.0 stays,
  # the closest citable pin, and there is no cu126 until its archive has
  # one: nix/CONTRACT.md, "Production flake notes", says what a bump takes.
  version = "2.7.0";
  archives = {
    cpu = {
      name = "libtorch-cxx11-abi-shared-with-deps-2.7.0-cpu.zip";
      url = "https://download.pytorch.org/libtorch/cpu/libtorch-cxx11-abi-shared-with-deps-2.7.0%2Bcpu.zip";
      sha256 = "0cvj3yajx9ysy4ych9y1qib2m0z618fwydac8l1r839lw59hq4gi";
    };
    cu128 = {
      name = "libtorch-cxx11-abi-shared-with-deps-2.7.0-cu128.zip";
      url = "https://download.pytorch.org/libtorch/cu128/libtorch-cxx11-abi-shared-with-deps-2.7.0%2Bcu128.zip";
      sha256 = "1is5g23i2plmfg6lvpqcbnkmwzxn3lxyygklrcsasj762qckmmyr";
    };
  };

  pinned =
    cudaSupport:
    (pkgs.libtorch-bin.override { inherit cudaSupport; }).overrideAttrs (_old: {
      inherit version;
      src = fetchzip archives.${if cudaSupport then "cu128" else "cpu"};
    });

  # Same shape as nixpkgs' libtorch-bin: a derivation with `.override
  # { cudaSupport; }`, which is all nix/libtorch.nix relies on.
  libtorch-bin = pinned false // {
    override = args: pinned (args.cudaSupport or false);
  };

  # A CUDA variant's CUDA_HOME, cudart and NCCL come from nixpkgs' CUDA
  # packages of the variant's own CUDA version ("12.8": cudaPackages_12_8),
  # so the headers floDl's shim compiles against match the runtime libtorch
  # was built with.
  cudaFor =
    cuda:
    let
      name = "cudaPackages_" + lib.replaceStrings [ "." ] [ "_" ] cuda;
    in
    pkgs.${name}
      or (throw "fdl-prepare flake: a variant is built for CUDA ${cuda}, and this nixpkgs has no ${name}: pin a nixpkgs that has it, or drop the variant");

  # floDl's crates are edition 2024 and use let-chains: rustc 1.88 or later.
  rustc = pkgs.rustc;
  minimumRustc = "1.88";
in
{
  inherit pkgs libtorch-bin;
  # Checked when the training build is evaluated, never for the variants.
  buildTraining =
    args:
    assert lib.assertMsg (lib.versionAtLeast rustc.version minimumRustc)
      "fdl-prepare flake: this nixpkgs has rustc ${rustc.version}, and floDl's crates need ${minimumRustc} or later (edition 2024, let-chains): pin a newer nixpkgs in flake.nix";
    import ./training.nix {
      inherit lib cudaFor rustc;
      inherit (pkgs) rustPlatform autoAddDriverRunpath runCommand removeReferencesTo;
    } args;
}
