# The training binary, built by cargo through nixpkgs' rustPlatform against
# one libtorch. Called by nix/contract.nix with the recipe already checked.
{ lib, rustPlatform }:
{
  src,
  cwd,
  build,
  bin,
  libtorch,
  variant,
  ...
}:
let
  root = if cwd == "." then "${src}" else "${src}/${cwd}";

  cargoToml = builtins.fromTOML (builtins.readFile "${root}/Cargo.toml");
  package = cargoToml.package or { };
  # A workspace root has no [package]; a member may inherit its version
  # from the workspace (`version.workspace = true`). Neither stops a build.
  pname = if builtins.isString (package.name or null) then package.name else "fdl-training";
  version = if builtins.isString (package.version or null) then package.version else "0";

  binName = baseNameOf bin;

  # A bare name is looked up where cargo leaves release binaries (with and
  # without an explicit --target); a path is taken relative to `cwd`. Shell
  # words: the name is quoted, the `*` is left to the shell.
  quotedBin = lib.escapeShellArg bin;
  searched =
    if lib.hasInfix "/" bin then
      [ bin ]
    else
      [
        "target/release/${bin}"
        "target/*/release/${bin}"
      ];
  candidates =
    if lib.hasInfix "/" bin then
      [ quotedBin ]
    else
      [
        "target/release/${quotedBin}"
        "target/*/release/${quotedBin}"
      ];
in
rustPlatform.buildRustPackage (
  {
    pname = "${pname}-${if variant == null then "notorch" else variant}";
    inherit version;
    src = root;

    # Git dependencies are fetched by the commit Cargo.lock names, so no
    # per-repository hash table has to live in this flake.
    cargoLock = {
      lockFile = "${root}/Cargo.lock";
      allowBuiltinFetchGit = true;
    };

    # The training code's own tests are the publisher's business, and they
    # would run on a box that has no GPU visible to the build.
    doCheck = false;

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
          lib.escapeShellArg "fdl-prepare: the build produced no executable `${bin}` (looked in ${lib.concatStringsSep ", " searched} under `${cwd}`);"
        } >&2
        echo "fdl-prepare: set \`bin\` in .fdl-run.toml or source.bin to a binary this build makes" >&2
        exit 1
      fi
      install -Dm755 "$found" "$out/bin/"${lib.escapeShellArg binName}
      runHook postInstall
    '';
  }
  # torch-sys appends /lib and /include to these itself.
  // lib.optionalAttrs (libtorch != null) {
    LIBTORCH = "${libtorch.out}";
    LIBTORCH_LIB = "${libtorch.out}";
    LIBTORCH_INCLUDE = "${libtorch.dev}";
  }
  # A recipe with its own build line replaces cargo's default build; the
  # vendored, offline cargo config from cargoSetupHook is already in place.
  // lib.optionalAttrs (build != null) {
    buildPhase = ''
      runHook preBuild
      ${build}
      runHook postBuild
    '';
  }
)
