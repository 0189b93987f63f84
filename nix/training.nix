# The training binary, built by cargo through nixpkgs' rustPlatform against
# one libtorch, the way floDl's crates expect to be built (nix/CONTRACT.md,
# "floDl's build contract"). Called by nix/contract.nix with the recipe
# already checked. What can be decided without nixpkgs (where Cargo.lock is,
# the refusals, the environment and the roots) lives in nix/cargo.nix and
# nix/training-env.nix, which the test flake's real builds share.
{
  lib,
  rustPlatform,
  rustc,
  autoAddDriverRunpath,
}:
{
  src,
  cwd,
  build,
  bin,
  libtorch,
  variant,
  cuda ? null,
  ...
}:
let
  crate = import ./cargo.nix { inherit src cwd; };

  # A CUDA variant's libtorch (nix/libtorch-wheel.nix) brings its CUDA:
  # the `cuda` output is a CUDA_HOME (every header floDl's shim includes,
  # lib64/ with the link names), `out` holds the libraries the binary loads.
  cudaParts =
    if cuda == null then
      null
    else
      {
        version = cuda;
        include = "${libtorch.cuda}/include";
        lib64 = "${libtorch.cuda}/lib64";
        lib = "${libtorch.out}/nvidia/cuda_runtime/lib";
        nccl = "${libtorch.out}/nvidia/nccl/lib";
      };

  env =
    if libtorch == null then
      null
    else
      import ./training-env.nix {
        inherit libtorch;
        cuda = cudaParts;
      };
  features = if env == null then [ ] else env.features;

  # A bare name is looked up where cargo leaves release binaries (the
  # workspace's target/, with and without an explicit --target); a path is
  # taken relative to `cwd`. Both relative to the source root, where the
  # install phase runs. Shell words: each part is quoted, the `*` between
  # them left to the shell.
  isPath = lib.hasInfix "/" bin;
  searched = if isPath then [ "${crate.cwd}/${bin}" ] else crate.binCandidates bin;
  shellGlob = c: lib.concatStringsSep "*" (map lib.escapeShellArg (lib.splitString "*" c));
  candidates = if isPath then map lib.escapeShellArg searched else map shellGlob searched;

  inSubdir = crate.cwd != ".";
  lockInSubdir = crate.lockDir != ".";
in
# A build line decides its own features; cargo's default build turns on `cuda`.
assert crate.check {
  rustc = rustc.version;
  cuda = cuda != null && build == null;
};
rustPlatform.buildRustPackage (
  {
    pname = "${crate.pname}-${if variant == null then "notorch" else variant}";
    inherit (crate) version;
    # The whole tree: `cwd` may be a workspace member, or a crate whose path
    # dependencies (`../flodl`) live beside it.
    inherit src;

    # Every crate by the hash Cargo.lock records; a source with git
    # dependencies is refused at evaluation (nix/cargo.nix).
    cargoLock = {
      inherit (crate) lockFile;
    };

    # The training code's own tests are the publisher's business, and they
    # would run on a box that has no GPU visible to the build.
    doCheck = false;

    buildFeatures = features;

    preBuild = lib.optionalString (env != null) env.roots;

    # Install the recipe's binary only: a workspace may build helpers the run
    # never starts, and a missing `bin` must fail here, loudly, not at launch.
    installPhase = ''
      runHook preInstall
      found=
      for f in ${lib.concatStringsSep " " candidates}; do
        if [ -f "$f" ] && [ -x "$f" ]; then found=$f; break; fi
      done
      if [ -z "$found" ]; then
        echo ${
          lib.escapeShellArg "fdl-prepare: the build produced no executable `${bin}` (looked in ${lib.concatStringsSep ", " searched});"
        } >&2
        echo "fdl-prepare: set \`bin\` in .fdl-run.toml or source.bin to a binary this build makes" >&2
        exit 1
      fi
      install -Dm755 "$found" "$out/bin/"${lib.escapeShellArg (baseNameOf bin)}
      runHook postInstall
    '';
  }
  // lib.optionalAttrs inSubdir { buildAndTestSubdir = crate.cwd; }
  # cargoSetupHook compares the vendored lock with the source's, found here.
  // lib.optionalAttrs lockInSubdir { cargoRoot = crate.lockDir; }
  // lib.optionalAttrs (env != null) { inherit (env) env; }
  // lib.optionalAttrs (cuda != null) {
    # The driver directory on the RUNPATH after the build, where
    # libcuda.so.1 and the libnvidia-ml.so.1 floDl dlopens are found. The
    # CUDA libraries themselves carry it already (nix/libtorch-wheel.py).
    nativeBuildInputs = [ autoAddDriverRunpath ];
  }
  # A recipe with its own build line replaces cargo's default build, in
  # `cwd`; the vendored, offline cargo config from cargoSetupHook and the
  # environment above are already in place.
  // lib.optionalAttrs (build != null) {
    buildPhase = ''
      runHook preBuild
      (
        cd ${lib.escapeShellArg crate.cwd}
        ${build}
      )
      runHook postBuild
    '';
  }
)
