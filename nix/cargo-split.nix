# The training build in two derivations (nix/CONTRACT.md, "Dependencies
# apart from the crate"): the dependencies, built from a tree that holds only
# what they depend on, and the run's own crates on top of their target/.
# Builtins only, so the production toolchain (nix/training.nix) and the test
# flake's (tests/flake/toolchain.nix) run the very same split, and the test
# flake's real builds prove what production does.
#
# The idea is crane's (buildDepsOnly, mkDummySrc, inheritCargoArtifacts):
# the dependency derivation's source is the tree's cargo files with every
# target of the run's own crates replaced by a stub, so a one-line change in
# the run's code leaves that derivation, and its store path, as they were.
# It is written here rather than taken from crane because the test flake has
# no network to fetch crane with, and a split the tests cannot build would be
# a split nobody has seen work.
#
# The run's own crates: every package whose Cargo.toml lies in the source
# outside a vendored directory (a workspace member, a path dependency beside
# it). Everything Cargo.lock names from a registry or git, and a vendored
# directory (one holding .cargo-checksum.json, as `cargo vendor` and
# Debian's registry lay them out), is the dependencies'.
{
  # the training source (the flake's `source` input, unfiltered)
  source,
  # nix/cargo.nix's answer for that source
  crate,
  # names at the source root the build must never see (the run manifest)
  omit ? [ ],
}:
let
  inherit (builtins)
    attrNames
    baseNameOf
    concatLists
    concatMap
    concatStringsSep
    dirOf
    elem
    filter
    fromTOML
    isAttrs
    isList
    isString
    length
    map
    match
    pathExists
    readDir
    readFile
    replaceStrings
    stringLength
    substring
    ;

  root = toString source;
  shellQuote = s: "'" + replaceStrings [ "'" ] [ "'\\''" ] s + "'";

  rel = path: if path == root then "." else substring (stringLength root + 1) (-1) path;
  under = d: name: if d == "." then name else "${d}/${name}";
  at = d: if d == "." then root else "${root}/${d}";

  vendored = d: pathExists "${at d}/.cargo-checksum.json";
  # A file or directory inside a vendored crate: some directory above it
  # (or it, for a directory) holds .cargo-checksum.json.
  inVendored =
    d:
    if d == "." then
      false
    else
      vendored d || inVendored (let p = dirOf d; in if p == "" then "." else p);

  # Cargo's own output: never an input of either derivation.
  targetDir = under crate.lockDir "target";
  # Only the workspace's own target/: a vendored crate may well have a
  # module directory of that name (cc's src/target/).
  skipDir = d: baseNameOf d == ".git" || d == targetDir;

  # Directories holding a Cargo.toml of the run's own, found by walking the
  # tree (not the vendored crates, not target/, not .git).
  ownDirs =
    let
      walk =
        d:
        let
          entries = readDir (at d);
          subdirs = filter (n: entries.${n} == "directory") (attrNames entries);
          here = if entries ? "Cargo.toml" then [ d ] else [ ];
        in
        if vendored d then
          [ ]
        else
          here ++ concatMap (n: let c = under d n; in if skipDir c then [ ] else walk c) subdirs;
    in
    walk ".";

  exists = d: p: pathExists "${at d}/${p}";

  # Every target file of one of the run's packages that cargo would read:
  # the stubs stand in for them, so the manifest still parses and resolves.
  targetsOf =
    d:
    let
      toml = fromTOML (readFile "${at d}/Cargo.toml");
      pkg = toml.package or null;
      listed =
        kind: defaultDir:
        concatMap (
          t:
          if isString (t.path or null) then
            [ t.path ]
          else if isString (t.name or null) then
            filter (exists d) [
              "${defaultDir}/${t.name}.rs"
              "${defaultDir}/${t.name}/main.rs"
            ]
          else
            [ ]
        ) (if isList (toml.${kind} or null) then toml.${kind} else [ ]);
      binDir = if exists d "src/bin" then readDir "${at d}/src/bin" else { };
      autoBins = concatMap (
        n:
        if binDir.${n} == "regular" && match ".*\\.rs" n != null then
          [ "src/bin/${n}" ]
        else if binDir.${n} == "directory" && exists d "src/bin/${n}/main.rs" then
          [ "src/bin/${n}/main.rs" ]
        else
          [ ]
      ) (attrNames binDir);
      build =
        if pkg != null && isString (pkg.build or null) then
          [ pkg.build ]
        else if pkg != null && (pkg.build or true) != false && exists d "build.rs" then
          [ "build.rs" ]
        else
          [ ];
      lib =
        if isAttrs (toml.lib or null) && isString (toml.lib.path or null) then
          [ toml.lib.path ]
        else
          filter (exists d) [ "src/lib.rs" ];
    in
    if pkg == null then
      [ ]
    else
      map (p: under d p) (
        lib
        ++ filter (exists d) [ "src/main.rs" ]
        ++ autoBins
        ++ build
        ++ listed "bin" "src/bin"
        ++ listed "example" "examples"
        ++ listed "test" "tests"
        ++ listed "bench" "benches"
      );

  # The library file names of the run's own crates (`lib<name>-<hash>.rlib`):
  # rustc refuses to write one through a link into the store, so those are
  # copied, never linked.
  ownLibs = concatMap (
    d:
    let
      toml = fromTOML (readFile "${at d}/Cargo.toml");
      name =
        if isAttrs (toml.lib or null) && isString (toml.lib.name or null) then
          toml.lib.name
        else
          replaceStrings [ "-" ] [ "_" ] (toml.package.name or "");
    in
    if (toml.package or null) == null || name == "" then [ ] else [ "lib${name}-*" ]
  ) ownDirs;
  # find(1) tests: a dependency's library in deps/, none of the run's own.
  linked =
    "\\( -path '*/deps/*.rlib' -o -path '*/deps/*.rmeta' \\)"
    + concatStringsSep "" (map (n: " ! -name ${shellQuote n}") ownLibs);

  # Relative to the source root, without duplicates.
  stubs =
    let
      all = concatMap targetsOf ownDirs;
    in
    builtins.foldl' (acc: p: if elem p acc then acc else acc ++ [ p ]) [ ] all;

  keepFile =
    path:
    let
      r = rel path;
      name = baseNameOf r;
      parent = baseNameOf (dirOf r);
    in
    !(elem r omit)
    && (
      elem name [
        "Cargo.toml"
        "Cargo.lock"
        "rust-toolchain"
        "rust-toolchain.toml"
      ]
      || (
        parent == ".cargo"
        && elem name [
          "config"
          "config.toml"
        ]
      )
      || inVendored (let p = dirOf r; in if p == "" then "." else p)
    );
in
{
  inherit stubs targetDir;

  # What the dependencies depend on, and nothing else: the cargo files of the
  # whole tree and the vendored crates. Named apart from the training source
  # itself, which the runner recognises in a failed build by its name
  # (fdl-training-source): a failed dependency build is the source's too.
  depsSource = builtins.path {
    path = source;
    name = "fdl-training-source-deps";
    filter = path: type: if type == "directory" then !(skipDir (rel path)) else keepFile path;
  };

  # Shell, run at the source root of the dependency tree: a stub for every
  # target of the run's own crates. `fn main` serves binaries and build
  # scripts; a library compiles it as dead code.
  writeStubs = concatStringsSep "\n" (
    map (p: ''
      mkdir -p ${shellQuote (dirOf p)}
      printf '%s\n' '#![allow(dead_code)]' 'fn main() {}' > ${shellQuote p}
    '') stubs
  );

  # Shell, in the dependency derivation after the build, at the source root:
  # cargo's target directory becomes the output. The .cargo-lock files are
  # cargo's locks of a build in progress, meaningless in the store.
  #
  # The stubs' own binaries go: they are the run's, rebuilt on top anyway,
  # and each is as large as the real one (a copy in deps/, another uplifted
  # beside it). A registry crate never leaves an extensionless file in
  # deps/ (its artefacts are .rlib, .rmeta, .so, .d), a binary target does.
  saveTarget = ''
    if [ -d ${shellQuote targetDir} ]; then
      mkdir -p "$out"
      cp -R ${shellQuote targetDir} "$out/target"
      find "$out/target" -name .cargo-lock -type f -delete
      find "$out/target" -mindepth 2 -maxdepth 3 -type f -path '*/deps/*' ! -name '*.*' -delete
      for profile in "$out/target"/*/ "$out/target"/*/*/; do
        [ -d "$profile/.fingerprint" ] || continue
        find "$profile" -mindepth 1 -maxdepth 1 -type f ! -name '*.*' -delete
      done
    else
      mkdir -p "$out/target"
    fi
  '';

  # Shell, in the crate's derivation before the build, at the source root of
  # a writable copy of the source, with $fdlDeps the dependency output.
  #
  # Cargo decides what is fresh by mtime for the run's own crates and by
  # version for registry ones. The store gives every file mtime 1, the
  # restored artefacts included: so the whole tree is set to mtime 1 too
  # (a vendored crate then looks exactly as old as its artefacts and its
  # build script is not rerun), and then every stubbed file is touched, so
  # that each of the run's own crates is newer than its stub's artefacts and
  # is rebuilt. Without the touch, cargo would link the stubs.
  #
  # The dependencies' libraries in deps/ are linked, not copied, as crane
  # does: cargo never writes to a fresh one. The rest is copied: the run's
  # own libraries (rustc refuses to write one through a link), build
  # scripts' outputs and fingerprints are written again.
  restoreTarget = ''
    find . -path ./${shellQuote targetDir} -prune -o -exec touch -h -d @1 {} +
    mkdir -p ${shellQuote targetDir}
    (
      cd "$fdlDeps/target"
      find . -type d -exec mkdir -p "$OLDPWD"/${shellQuote targetDir}/{} \;
      find . -type f ${linked} -exec ln -s "$fdlDeps/target/{}" "$OLDPWD"/${shellQuote targetDir}/{} \;
      find . -type f ! \( ${linked} \) -exec cp --preserve=timestamps {} "$OLDPWD"/${shellQuote targetDir}/{} \;
    )
    chmod -R u+w ${shellQuote targetDir}
  ''
  + concatStringsSep "\n" (map (p: "touch ${shellQuote p}") stubs)
  + "\n";

  count = length stubs;
}
