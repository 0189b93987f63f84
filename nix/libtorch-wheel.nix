# One libtorch derivation from PyTorch's wheels (nix/wheels.nix), shared by
# the production flake and the nixpkgs-free test flake: what differs is only
# the tools, injected by absolute path (nixpkgs' bash, python3 and patchelf;
# the test flake's host /bin/sh, /usr/bin/python3 and /usr/bin/patchelf).
# Builtins only, so the test flake builds these very lines.
#
# The wheels are fetched with Nix's builtin:fetchurl, by URL and sha256,
# under the wheel's own file name: `nix-store --add-fixed sha256 FILE` of a
# file pip downloaded gives the very same store path (scripts/setup seeds a
# store that way, with no network for Nix).
{
  system,
  # { sh; python; patchelf; path; }: programs by absolute path, and PATH.
  tools,
}:
let
  inherit (builtins)
    baseNameOf
    concatStringsSep
    replaceStrings
    ;

  pins = import ./wheels.nix;

  driverDir = "/run/opengl-driver/lib";

  fetchWheel =
    wheel:
    derivation {
      name = replaceStrings [ "%2B" ] [ "+" ] (baseNameOf wheel.url);
      builder = "builtin:fetchurl";
      system = "builtin";
      inherit (wheel) url;
      outputHashMode = "flat";
      outputHashAlgo = "sha256";
      outputHash = wheel.sha256;
      preferLocalBuild = true;
    };

  # `pin`: { version; cuda; archs; wheels = { <system> = [ { url; sha256; } … ]; }; }
  # with the torch wheel first. Outputs: `out` (lib/, nvidia/*/lib,
  # build-version, .arch), `dev` (include/, share/cmake), and for a CUDA
  # build `cuda` (a CUDA_HOME: include/, lib64/): nix/libtorch-wheel.py.
  build =
    label: pin:
    let
      cuda = pin.cuda != null;
      wheels =
        pin.wheels.${system}
          or (throw "fdl-prepare flake: libtorch ${label} has no wheel pinned for ${system} (nix/wheels.nix); pick another variant or pin one");
    in
    derivation {
      name = "libtorch-${pin.version}-${label}";
      inherit system label driverDir;
      inherit (pin) version;
      cudaVersion = if cuda then pin.cuda else "none";
      archs = concatStringsSep " " pin.archs;
      wheels = map fetchWheel wheels;
      unpack = ./libtorch-wheel.py;
      inherit (tools) python;
      patchelf = if cuda then tools.patchelf else "";
      builder = tools.sh;
      args = [
        "-c"
        ''exec "$python" -I -S "$unpack"''
      ];
      outputs = [
        "out"
        "dev"
      ]
      ++ (if cuda then [ "cuda" ] else [ ]);
      PATH = tools.path;
    };
in
{
  inherit pins fetchWheel build;
}
