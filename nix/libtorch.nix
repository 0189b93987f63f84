# The libtorch variants a box can ask for, as a function of the toolchain.
#
# Each variant is a plain attrset: `cuda` and `archs` are literals written here,
# next to the derivation, and never read from it. That is the whole point of
# the split: the runner refuses a variant that ships no kernel for an offered
# card by *evaluating* `fdl.variants`, which must not instantiate, let alone
# download, gigabytes of libtorch. Nix is lazy per attribute, so `package`
# stays an unforced thunk while `cuda` and `archs` are read.
#
# The toolchain only has to provide `libtorch-bin` shaped like nixpkgs' one
# (a derivation with `out` and `dev` outputs and `.override { cudaSupport; }`).
# The production flake passes nixpkgs' package; the test flake passes small
# /bin/sh-built stand-ins with the same shape, so the labels and arch lists the
# tests check are these very lines.
{ libtorch-bin, ... }:
{
  cpu = {
    cuda = null;
    archs = [ ];
    package = libtorch-bin;
  };

  # libtorch 2.7.0 + CUDA 12.8 as PyTorch builds it: kernels for these
  # compute capabilities. Pascal (6.x) and Volta (7.0) are not among them; a
  # fleet with such cards adds a cu126 variant (nix/CONTRACT.md, "Adding a
  # variant") rather than finding out at the first kernel launch.
  cu128 = {
    cuda = "12.8";
    archs = [ "7.5" "8.0" "8.6" "9.0" "10.0" "12.0" ];
    package = libtorch-bin.override { cudaSupport = true; };
  };

  # No ROCm variant here: PyTorch publishes its libtorch ROCm archives
  # without checksums, and a fixed-output derivation needs a hash taken from
  # a source one can cite, not one computed from a download nobody vouches
  # for. A fleet with AMD GPUs adds one as nix/CONTRACT.md ("Adding a
  # variant") shows, with vendor = "amd", rocm and gfx.
}
