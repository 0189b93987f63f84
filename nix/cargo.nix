# What a cargo build of the training source needs to know before anything
# is built, read from the source tree alone: builtins only, no nixpkgs. Both
# toolchains use it (nix/training.nix, tests/flake/toolchain.nix), so the
# refusals below are the same with or without nixpkgs, and the tests that
# meet them run here.
#
# A floDl source is rarely one crate at the root: a workspace member, or a
# crate with `../` path dependencies beside its siblings (floDl's ddp-bench
# has `flodl = { path = "../flodl" }`). So the build sees the whole tree,
# `cwd` picks the crate, and Cargo.lock is taken where cargo keeps it: in
# `cwd` or the nearest directory above it (the workspace root), never above
# the source root.
{ src, cwd }:
let
  inherit (builtins)
    attrNames
    compareVersions
    concatStringsSep
    dirOf
    filter
    fromTOML
    head
    isAttrs
    isString
    match
    pathExists
    readFile
    split
    toJSON
    ;

  fail = msg: throw "fdl-prepare flake: ${msg}";
  quote = toJSON;

  # "./crates/train/" and "crates/train" are the same directory.
  normalize =
    p:
    let
      parts = filter (c: isString c && c != "" && c != ".") (split "/" p);
    in
    if parts == [ ] then "." else concatStringsSep "/" parts;

  here = normalize cwd;

  # `cwd`, then each directory above it, up to the source root.
  ancestors = d: [ d ] ++ (if d == "." then [ ] else ancestors (dirOf d));
  at = d: if d == "." then "${src}" else "${src}/${d}";
  # For messages and shell words: a path relative to the source root.
  under = d: name: if d == "." then name else "${d}/${name}";

  manifestPath = "${at here}/Cargo.toml";
  manifest =
    if pathExists manifestPath then
      fromTOML (readFile manifestPath)
    else
      fail "the training source has no Cargo.toml in `cwd` = ${quote here}: set `cwd` (in .fdl-run.yml or [join.source]) to the crate that builds `bin`, or give a `build` line for a source that is not a cargo project";

  lockDirs = filter (d: pathExists "${at d}/Cargo.lock") (ancestors here);
  lockDir =
    if lockDirs == [ ] then
      fail "the training source has no Cargo.lock in `cwd` = ${quote here} or any directory above it: commit Cargo.lock (run `cargo generate-lockfile` in the crate or workspace root and add it to the source), so every box builds the same dependencies offline"
    else
      head lockDirs;

  rootManifest =
    let
      p = "${at lockDir}/Cargo.toml";
    in
    if lockDir != here && pathExists p then fromTOML (readFile p) else manifest;

  package = manifest.package or { };
  workspacePackage = (rootManifest.workspace or { }).package or { };
  # `version.workspace = true` and friends come from the workspace root.
  field =
    name:
    let
      v = package.${name} or null;
    in
    if isAttrs v && (v.workspace or false) then workspacePackage.${name} or null else v;

  # rustup's lookup: rust-toolchain.toml (or the older rust-toolchain) in
  # `cwd` or a directory above it.
  toolchainFiles = filter pathExists (
    builtins.concatMap (d: [
      "${at d}/rust-toolchain.toml"
      "${at d}/rust-toolchain"
    ]) (ancestors here)
  );
  toolchainChannel =
    if toolchainFiles == [ ] then
      null
    else
      let
        text = readFile (head toolchainFiles);
        parsed =
          if match "[[:space:]]*\\[.*" text != null then
            fromTOML text
          else
            { toolchain.channel = text; };
        channel = (parsed.toolchain or { }).channel or null;
      in
      if isString channel then head (filter isString (split "[[:space:]]" channel)) else null;

  versionOk = v: isString v && match "[0-9]+(\\.[0-9]+){0,2}" v != null;
in
rec {
  cwd = here;
  inherit lockDir;
  # Without a Cargo.lock there is nothing to build apart (a build line's
  # own project): no dependency derivation.
  hasLock = lockDirs != [ ];
  lockFile = "${at lockDir}/Cargo.lock";
  lockFileRel = under lockDir "Cargo.lock";

  hasPackage = manifest ? package;
  pname = if isString (package.name or null) then package.name else "fdl-training";
  version = if isString (field "version") then field "version" else "0";
  features = attrNames (manifest.features or { });

  # What a recipe without a build line runs: floDl's DEFAULT_BUILD
  # (flodl-cli's source.rs). No feature is chosen for the crate: a line
  # that wants the vendor's says `--features "$FDL_GPU_FEATURE"`, as the
  # line `fdl publish` derives does.
  defaultBuild = "cargo build --release";

  # floDl's `bin` (flodl-cli's source.rs): a path relative to `cwd`, which
  # may climb out of it (`../target/release/NAME`: a workspace member's
  # binary is in the workspace's target/) but never out of the source root.
  # Returned relative to the source root, where the install runs.
  binPath =
    bin:
    let
      parts = filter (c: isString c && c != "" && c != ".") (split "/" "${here}/${bin}");
      step =
        acc: part:
        if part != ".." then
          acc ++ [ part ]
        else if acc == [ ] then
          fail "`bin` = ${quote bin} with `cwd` = ${quote here} leads out of the training source: name the binary by a path inside the tree, relative to `cwd` (floDl's `target/release/NAME`, or `../target/release/NAME` for a workspace member)"
        else
          builtins.genList (builtins.elemAt acc) (builtins.length acc - 1);
      kept = builtins.foldl' step [ ] parts;
    in
    if kept == [ ] then
      fail "`bin` = ${quote bin} names the source root itself: name the binary, e.g. `target/release/NAME`"
    else
      concatStringsSep "/" kept;

  # Where to look for `bin`: the path as floDl resolves it; for a bare name
  # (earlier releases of this project took one) also cargo's release
  # directory, the workspace's and the crate's own.
  binCandidates =
    bin:
    [ (binPath bin) ]
    ++ (
      if match ".*/.*" bin != null then
        [ ]
      else
        map (d: under d "target/release/${bin}") (
          # A source built by its own line may have no Cargo.lock at all.
          (if lockDirs == [ ] then [ ] else [ (head lockDirs) ]) ++ [ here ]
        )
    );

  # Packages Cargo.lock fetches from git, as "name version (url)", the URL
  # without any user or token in it. A git dependency has no hash in
  # Cargo.lock that a fixed-output fetch could check, and fetching it at
  # evaluation (builtins.fetchGit) would run git as root, with whatever
  # credentials root has, against a URL the training source chose.
  gitDependencies =
    let
      lock = fromTOML (readFile lockFile);
      isGit = p: isString (p.source or null) && match "git\\+.*" p.source != null;
      shown =
        url:
        let
          parts = match "([a-z+]+://)([^/@]*@)?(.*)" url;
        in
        if parts == null then url else "${head parts}${builtins.elemAt parts 2}";
    in
    map (p: "${p.name} ${p.version} (${shown p.source})") (filter isGit (lock.package or [ ]));

  # Refuses, at evaluation, a source that asks for a newer Rust than
  # `rustc` (the toolchain's version string), and git dependencies. Features
  # are the build line's business, as in floDl: `--features "$FDL_GPU_FEATURE"`
  # where the publisher wrote it, the crate's own defaults where not. Returns true
  # otherwise.
  check =
    {
      rustc ? null,
    }:
    let
      rustVersion = field "rust-version";
      channel = toolchainChannel;
    in
    if gitDependencies != [ ] then
      fail "the training source's Cargo.lock has git dependencies: ${concatStringsSep ", " gitDependencies}; the flake fetches crates only by a hash Cargo.lock records, which a git dependency lacks: publish it to a registry, or vendor it into the source as a path dependency"
    else if
      rustc != null && isString rustVersion && versionOk rustVersion && compareVersions rustc rustVersion < 0
    then
      fail "the crate ${quote pname} declares rust-version = ${quote rustVersion}, and this flake builds with rustc ${rustc}: lower rust-version, or point `flake` at a flake whose nixpkgs has a newer Rust"
    else if
      rustc != null && channel != null && versionOk channel && compareVersions rustc channel < 0
    then
      fail "the training source's rust-toolchain file asks for Rust ${channel}, and this flake builds with rustc ${rustc} (toolchain files are read, not installed: a flake cannot fetch a toolchain without --impure): lower the channel, or point `flake` at a flake whose nixpkgs has a newer Rust"
    else if rustc != null && channel != null && match "(nightly|beta).*" channel != null then
      fail "the training source's rust-toolchain file asks for Rust ${quote channel}, and this flake builds with the stable rustc ${rustc}: pin a stable version (channel = \"1.88\" or later) or drop the file"
    else
      true;
}
