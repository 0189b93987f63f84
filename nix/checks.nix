# The repository's gates as a flake check (`nix flake check`): ruff (lint and
# format), mypy --strict on the package, and nixfmt on the Nix files. The
# same gates run in CI through scripts/check; this is the Nix-native door to
# them for a box or a CI that has current nixpkgs. Nothing here builds or
# runs the suite, which needs root, a real Nix and loopback services that a
# build sandbox does not have.
{
  runCommand,
  python3,
  ruff,
  nixfmt-rfc-style,
  src,
}:
let
  python = python3.withPackages (
    ps: with ps; [
      mypy
      nvidia-ml-py
      pyyaml
      types-pyyaml
      sh
      rich
      pytest
    ]
  );
in
runCommand "fdl-prepare-gates"
  {
    nativeBuildInputs = [
      python
      ruff
      nixfmt-rfc-style
    ];
  }
  ''
    cp -r ${src} src
    chmod -R u+w src
    cd src
    ruff check .
    ruff format --check .
    mypy --strict prepare
    nixfmt --check flake.nix nix/*.nix
    touch $out
  ''
