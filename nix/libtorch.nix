# The libtorch variants a box can ask for, as a function of the system and
# the toolchain.
#
# Each variant is a plain attrset: `cuda` and `archs` are literals from
# nix/wheels.nix, next to the pins, and never read from a derivation. That is
# the whole point of the split: the runner refuses a variant that ships no
# kernel for an offered card by *evaluating* `fdl.variants`, which must not
# instantiate, let alone download, gigabytes of libtorch. Nix is lazy per
# attribute, so `package` stays an unforced thunk while `cuda` and `archs`
# are read. The build itself checks `archs` against the kernels the wheel
# carries (nix/libtorch-wheel.py), so the literal cannot drift from it.
#
# The toolchain provides `wheelTools` (nix/libtorch-wheel.nix), and may
# replace a variant's pin (`libtorchPins`: the test flake's CPU wheel, the one
# its hosts can fetch) or its package (`libtorchStandIns`: the test flake's
# small stand-ins), all read lazily, so the variants evaluate without
# importing nixpkgs.
{ system, toolchain }:
let
  wheel = import ./libtorch-wheel.nix {
    inherit system;
    tools = toolchain.wheelTools;
  };
  pins = builtins.mapAttrs (_: v: v // { version = v.version or wheel.pins.version; }) (
    wheel.pins.variants // (toolchain.libtorchPins or { })
  );
  standIns = toolchain.libtorchStandIns or { };
in
# No cu126 and no ROCm variant: nix/wheels.nix and nix/CONTRACT.md ("Adding a
# variant") say what each takes.
builtins.mapAttrs (label: pin: {
  inherit (pin) cuda archs;
  package = standIns.${label} or (wheel.build label pin);
}) pins
