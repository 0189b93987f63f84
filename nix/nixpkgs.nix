# The production toolchain: what nix/contract.nix needs, taken from a nixpkgs
# package set. Every attribute is a thunk over `pkgs`, so evaluating the
# variants metadata never imports nixpkgs (nor fetches it). Kept thin: what
# can be decided without nixpkgs lives in nix/cargo.nix and
# nix/training-env.nix, where the test flake exercises it.
pkgs:
let
  inherit (pkgs) lib;

  # libtorch is not nixpkgs' libtorch-bin (2.5.0 and 2.9.0 on its branches,
  # never floDl's 2.10.0, and CUDA from nixpkgs' unfree packages): it is
  # PyTorch's own wheels, pinned in nix/wheels.nix and unpacked by
  # nix/libtorch-wheel.nix, the same derivation the test flake builds. Only
  # its tools come from here, each a thunk until a libtorch is built.
  wheelTools = {
    sh = "${pkgs.bash}/bin/bash";
    python = "${pkgs.python3}/bin/python3";
    patchelf = "${pkgs.patchelf}/bin/patchelf";
    path = lib.makeBinPath [ pkgs.coreutils ];
  };

  # floDl's crates are edition 2024 and use let-chains: rustc 1.88 or later.
  rustc = pkgs.rustc;
  minimumRustc = "1.88";
in
{
  inherit pkgs wheelTools;
  # Checked when the training build is evaluated, never for the variants.
  buildTraining =
    args:
    assert lib.assertMsg (lib.versionAtLeast rustc.version minimumRustc)
      "fdl-prepare flake: this nixpkgs has rustc ${rustc.version}, and floDl's crates need ${minimumRustc} or later (edition 2024, let-chains): pin a newer nixpkgs in flake.nix";
    import ./training.nix {
      inherit lib rustc;
      inherit (pkgs) rustPlatform autoAddDriverRunpath runCommand removeReferencesTo;
    } args;
}
