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
  runCommand,
  removeReferencesTo,
}:
{
  src,
  cwd,
  build,
  bin,
  libtorch,
  variant,
  cuda ? null,
  # the unfiltered source and the root names left out of `src`, for the
  # dependency tree (nix/cargo-split.nix)
  originalSource ? src,
  omit ? [ ],
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
        # The build root, a store path both halves of the build name alike.
        mkRoot =
          name: script:
          runCommand name {
            preferLocalBuild = true;
            allowSubstitutes = false;
          } script;
      };

  # floDl's build (flodl-cli's source.rs): the build line, or its default,
  # run in `cwd`; `bin` a path relative to `cwd`, which may climb to the
  # workspace root, never out of the source. Relative to the source root,
  # where the install phase runs; each candidate one quoted shell word.
  line = if build == null then crate.defaultBuild else build;
  searched = crate.binCandidates bin;
  candidates = map lib.escapeShellArg searched;

  lockInSubdir = crate.lockDir != ".";
  variantName = if variant == null then "notorch" else variant;

  # The dependencies apart from the run's own crates (nix/cargo-split.nix):
  # a derivation keyed by the cargo files, the lock, the toolchain, the
  # libtorch variant, the environment and the build line, never by the
  # run's code.
  split = import ./cargo-split.nix {
    source = originalSource;
    inherit crate omit;
  };
  # Every crate by the hash Cargo.lock records; a source with git
  # dependencies is refused before evaluation (prepare/build/crate.py) and
  # at it (nix/cargo.nix). The lock is read from the dependency tree, so
  # the vendored crates' derivation does not depend on the run's code
  # either; both halves share it.
  cargoLock = {
    lockFile = "${split.depsSource}/${crate.lockFileRel}";
  };

  # What both halves share: the lock's place and the environment (CUDA_HOME
  # and the CUDA libraries come with the variant's libtorch, in env).
  common =
    lib.optionalAttrs lockInSubdir { cargoRoot = crate.lockDir; }
    // lib.optionalAttrs (env != null) { inherit (env) env; };

  deps = rustPlatform.buildRustPackage (
    common
    // {
      pname = "${crate.pname}-deps-${variantName}";
      inherit (crate) version;
      inherit cargoLock;
      src = split.depsSource;
      doCheck = false;
      postPatch = split.writeStubs;
      preBuild = lib.optionalString (env != null) env.roots;
      # The line may fail on stubs (one that runs what it built, say): what
      # cargo built until then is kept, and the crate's build does the rest.
      buildPhase = ''
        runHook preBuild
        unset CARGO_TARGET_DIR CARGO_BUILD_TARGET
        export CARGO_NET_OFFLINE=true
        (
          cd ${lib.escapeShellArg crate.cwd}
          ${line}
        ) || echo "fdl-prepare: the build line exited $? on the dependency-only tree; keeping what it built" >&2
        runHook postBuild
      '';
      installPhase = split.saveTarget;
      dontFixup = true;
    }
  );
in
assert crate.check { rustc = rustc.version; };
rustPlatform.buildRustPackage (
  {
    pname = "${crate.pname}-${variantName}";
    inherit (crate) version;
    # The whole tree: `cwd` may be a workspace member, or a crate whose path
    # dependencies (`../flodl`) live beside it.
    inherit src;
    inherit cargoLock;

    # The training code's own tests are the publisher's business, and they
    # would run on a box that has no GPU visible to the build.
    doCheck = false;

    # The dependencies' target/ first, then only the run's own crates build.
    fdlDeps = deps;
    preBuild = lib.optionalString (env != null) env.roots + split.restoreTarget;
    passthru = {
      inherit deps;
      root = if env == null then null else env.root;
    };

    # The build line, or floDl's default, in `cwd`, as `fdl join` runs it on
    # a box: cargo's own target directory (nixpkgs' cargoBuildHook would put
    # it at the source root, under a --target triple, where a floDl `bin`
    # does not look), the vendored, offline cargo config from
    # cargoSetupHook found above `cwd`, the environment below. Offline for
    # any line, not only cargo's default: the dependencies are vendored.
    buildPhase = ''
      runHook preBuild
      unset CARGO_TARGET_DIR CARGO_BUILD_TARGET
      export CARGO_NET_OFFLINE=true
      (
        cd ${lib.escapeShellArg crate.cwd}
        ${line}
      )
      runHook postBuild
    '';

    # Install the recipe's binary only: a workspace may build helpers the run
    # never starts, and a missing `bin` must fail here, loudly, not at launch.
    installPhase = ''
      runHook preInstall
      found=
      for f in ${lib.concatStringsSep " " candidates}; do
        if [ -f "$f" ]; then found=$f; break; fi
      done
      if [ -z "$found" ]; then
        echo ${
          lib.escapeShellArg "fdl-prepare: the build produced no file `${bin}` relative to `cwd` = ${crate.cwd} (looked for ${lib.concatStringsSep ", " searched} in the source);"
        } >&2
        echo "fdl-prepare: publish a run whose \`bin\` is the path the build writes, relative to \`cwd\` (target/release/NAME; ../target/release/NAME for a workspace member)" >&2
        exit 1
      fi
      install -Dm755 "$found" "$out/bin/"${lib.escapeShellArg (baseNameOf bin)}
      ${lib.optionalString (env != null) "remove-references-to -t ${env.root} \"$out/bin/\"*"}
      runHook postInstall
    '';
  }
  # cargoSetupHook compares the vendored lock with the source's, found at
  # cargoRoot.
  // common
  // {
    # remove-references-to: the headers' paths in the binary must not keep
    # the build root (and libtorch's headers) in its closure
    # (nix/training-env.nix). The driver directory on the RUNPATH after the
    # build, where libcuda.so.1 and the libnvidia-ml.so.1 floDl dlopens are
    # found.
    nativeBuildInputs = [ removeReferencesTo ] ++ lib.optional (cuda != null) autoAddDriverRunpath;
  }
)
