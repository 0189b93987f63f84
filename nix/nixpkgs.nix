# The production toolchain: what nix/contract.nix needs, taken from a nixpkgs
# package set. Every attribute is a thunk over `pkgs`, so evaluating the
# variants metadata never imports nixpkgs (nor fetches it).
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
  # Bumping libtorch means changing `version` and these two entries.
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
in
{
  inherit pkgs libtorch-bin;
  buildTraining = import ./training.nix { inherit lib; inherit (pkgs) rustPlatform; };
}
