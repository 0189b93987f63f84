# The flake contract (nix/CONTRACT.md) as one function, shared by the
# production flake and the nixpkgs-free test flake: what differs between them
# is only the injected toolchain, so the tests exercise this very file.
#
# Returns the set published as `legacyPackages.<system>.fdl`.
#
# Every check here reads metadata and recipe.json only. A refusal must come
# from evaluation, before a single byte of libtorch is fetched: that is what
# lets the runner call a bad recipe permanent instead of discovering it after
# a multi-gigabyte download.
{
  system,
  # { wheelTools; buildTraining; ... } (nix/nixpkgs.nix, tests/flake/toolchain.nix)
  toolchain,
  # the training source tree (flake = false input)
  source,
  # a directory holding recipe.json (flake = false input)
  recipe,
  # toolchain -> { <label> = { cuda; archs; package; }; } (a ROCm build:
  # { vendor = "amd"; rocm; gfx; cuda = null; archs = [ ]; package; }): how a
  # downstream flake adds (or replaces) variants without editing this
  # repository.
  extraVariants ? (_toolchain: { }),
}:
let
  inherit (builtins)
    all
    attrNames
    concatStringsSep
    elem
    fromJSON
    hashString
    hasAttr
    isAttrs
    isList
    isString
    mapAttrs
    match
    pathExists
    readFile
    toJSON
    typeOf
    ;

  contract = 2;

  fail = msg: throw "fdl-prepare flake: ${msg}";

  quote = toJSON;

  declared = import ./libtorch.nix { inherit system toolchain; } // extraVariants toolchain;

  labels = concatStringsSep ", " (attrNames declared);

  # Labels travel on command lines and into attribute paths; archs are
  # compared numerically by the runner ("8.6", "9.0+PTX"); gfx targets by
  # name, optionally with target features ("gfx90a:xnack-"). Generic targets
  # (gfx11-generic) are refused: the runner would have to know which cards
  # each covers.
  labelOk = label: match "[A-Za-z0-9][A-Za-z0-9_.-]*" label != null;
  archOk = a: isString a && match "[0-9]+\\.[0-9]+(\\+PTX)?" a != null;
  gfxOk = g: isString g && match "gfx[0-9a-f]+(:[a-z-]+[+-])*" g != null;

  # A flake from before vendors existed declares none: a CUDA version then
  # means NVIDIA, and no version a CPU build.
  vendorOf = v: v.vendor or (if (v.cuda or null) != null then "nvidia" else null);

  checkVariant =
    label: v:
    if !(labelOk label) then
      fail "variant label ${quote label} is not a plain name (letters, digits, '.', '_', '-')"
    else if !(isAttrs v) then
      fail "variant ${quote label} must be an attrset { cuda; archs; package; }, got a ${typeOf v}"
    else if !(v ? cuda) || !(v.cuda == null || isString v.cuda) then
      fail "variant ${quote label}: `cuda` must be a version string like \"12.8\" or null for a CPU or ROCm build"
    else if !(v ? archs) || !(isList v.archs) || !(all archOk v.archs) then
      fail "variant ${quote label}: `archs` must be a list of compute capabilities like \"8.6\" or \"9.0+PTX\""
    else if !(elem (vendorOf v) [ "nvidia" "amd" null ]) then
      fail "variant ${quote label}: `vendor` must be \"nvidia\", \"amd\" or null (a CPU build), got ${quote v.vendor}"
    else if vendorOf v == null && v.cuda != null then
      fail "variant ${quote label}: vendor null is a CPU build, which has `cuda = null`; a CUDA build is vendor \"nvidia\""
    else if vendorOf v == "nvidia" && v.cuda == null then
      fail "variant ${quote label}: vendor \"nvidia\" needs `cuda`, the CUDA version it is built for"
    else if vendorOf v == "amd" && (v.cuda != null || v.archs != [ ]) then
      fail "variant ${quote label}: a ROCm build (vendor \"amd\") has `cuda = null` and `archs = [ ]`; its targets go in `gfx`"
    else if vendorOf v == "amd" && !((v ? rocm) && isString v.rocm) then
      fail "variant ${quote label}: a ROCm build (vendor \"amd\") needs `rocm`, the ROCm version it is built for, like \"7.0\""
    else if
      vendorOf v == "amd" && !((v ? gfx) && isList v.gfx && v.gfx != [ ] && all gfxOk v.gfx)
    then
      fail "variant ${quote label}: a ROCm build (vendor \"amd\") needs `gfx`, the targets it ships kernels for, like [ \"gfx942\" \"gfx1100\" ] (no generic targets)"
    else if vendorOf v != "amd" && (v.gfx or [ ]) != [ ] then
      fail "variant ${quote label}: `gfx` is for ROCm builds; set vendor = \"amd\" or drop it"
    else
      {
        inherit label;
        inherit (v) cuda archs;
      }
      # Only a variant that declares its vendor says so: the metadata of
      # every variant from before vendors existed reads as it always did.
      // (
        if v ? vendor then
          {
            inherit (v) vendor;
            gfx = v.gfx or [ ];
            rocm = v.rocm or null;
          }
        else
          { }
      );

  variants = mapAttrs checkVariant declared;

  libtorch = mapAttrs (
    label: v: if v ? package then v.package else fail "variant ${quote label} has no `package`"
  ) declared;

  # A path inside the source tree, as the run manifest spells it. Absolute
  # paths and `..` would escape the pinned tree, so they are refused.
  relativeOk = p: match "/.*" p == null && match "(.*/)?\\.\\.(/.*)?" p == null;
  # floDl's `bin` is relative to `cwd` and may climb out of it (a workspace
  # member's `../target/release/NAME`), never out of the source root.
  binOk =
    dir: p:
    let
      parts = builtins.filter (c: builtins.isString c && c != "" && c != ".") (builtins.split "/" "${dir}/${p}");
      depth = builtins.foldl' (d: c: if d < 0 then d else if c == ".." then d - 1 else d + 1) 0 parts;
    in
    match "/.*" p == null && depth > 0;

  recipeFile = "${recipe}/recipe.json";

  rawRecipe =
    if !(pathExists recipeFile) then
      fail "the `recipe` input has no recipe.json; fdl-prepare writes one and passes `--override-input recipe path:<dir>` (by hand: put recipe.json in a directory and pass that)"
    else
      let
        r = fromJSON (readFile recipeFile);
      in
      if isAttrs r then r else fail "recipe.json must hold a JSON object, got a ${typeOf r}";

  checkedRecipe =
    let
      r = rawRecipe;
      bin = r.bin or null;
      cwd = if (r.cwd or null) == null || r.cwd == "" then "." else r.cwd;
      build = r.build or null;
      variant = r.libtorch or null;
    in
    if (r.contract or null) != contract then
      fail "recipe.json speaks contract ${quote (r.contract or null)}, this flake speaks contract ${toString contract}: upgrade fdl-prepare or point `flake` at a matching flake"
    else if bin == null || bin == "" then
      fail "recipe.json has no `bin`: set `bin` in the run manifest (.fdl-run.yml) or `bin` under [join.source]"
    else if !(isString cwd) || !(relativeOk cwd) then
      fail "recipe.json `cwd` = ${quote cwd} must be a directory relative to the source root, without `..`"
    else if !(isString bin) || !(binOk cwd bin) then
      fail "recipe.json `bin` = ${quote bin} must be a path relative to `cwd` that stays inside the training source (`target/release/NAME`, or `../target/release/NAME` for a workspace member)"
    else if !(pathExists "${source}/${cwd}") then
      fail "recipe.json `cwd` = ${quote cwd} does not exist in the training source; fix `cwd` in .fdl-run.yml or [join.source]"
    else if !(build == null || isString build) then
      fail "recipe.json `build` must be a shell line or null, got a ${typeOf build}"
    else if !(variant == null || isString variant) then
      fail "recipe.json `libtorch` must be a variant label or null, got a ${typeOf variant}"
    else if variant != null && !(hasAttr variant declared) then
      fail "unknown libtorch variant ${quote variant}; this flake has: ${labels}; set `libtorch` (--libtorch) to one of them"
    else
      {
        inherit contract bin cwd build;
        libtorch = variant;
      };

  # The source the training build sees: the tree without floDl's run files.
  # A publish builds, pushes, and only then writes .fdl-run.sha256 and
  # .fdl-run.yml (the manifest last: the commit point); if they were part of
  # `src`, writing them would change the derivation every box evaluates, and
  # each box would build what the publish had just pushed. Only the root's
  # go: files of those names deeper in the tree are the source's own.
  # The name is how the runner tells a failed training build (it names this
  # copy) from a failed build of the flake's own (prepare/nix/diagnosis.py).
  # The run files (floDl's manifest and its digest sidecar) are not inputs
  # of any build: writing them at publish changes no derivation.
  manifestNames = [
    ".fdl-run.yml"
    ".fdl-run.sha256"
  ];
  manifests = map (n: "${toString source}/${n}") manifestNames;
  trainingSource = builtins.path {
    path = source;
    name = "fdl-training-source";
    filter = path: _type: !(builtins.elem path manifests);
  };

  training =
    let
      r = checkedRecipe;
    in
    toolchain.buildTraining {
      inherit system;
      src = trainingSource;
      # The dependency derivation's tree is cut from the same source, less
      # the same manifest (nix/cargo-split.nix).
      originalSource = source;
      omit = manifestNames;
      inherit (r) cwd build bin;
      variant = r.libtorch;
      libtorch = if r.libtorch == null then null else libtorch.${r.libtorch};
      # The variant's CUDA version ("12.8") or null: a CUDA build turns on
      # the crate's `cuda` feature and gets CUDA_HOME and NCCL.
      cuda = if r.libtorch == null then null else variants.${r.libtorch}.cuda;
    };

  # The training build's dependencies (nix/cargo-split.nix), built apart
  # from the run's own crates: the runner builds and roots them with the
  # binary, so the next change of the source finds them in the store, and
  # `fdl-prepare publish` pushes them. A source that is not built in two
  # (no Cargo.lock) has none: the training derivation stands in.
  trainingDeps = if (training.deps or null) != null then training.deps else training;
in
{
  inherit
    contract
    variants
    libtorch
    training
    trainingDeps
    ;
  # `libtorch` and `training` again, under the digest of the contract and
  # the variants' metadata: the attribute exists only while they are
  # exactly those the runner chose from. A re-dial after the flake changed
  # chooses from the variants it recorded and builds `ifVariants.<digest>.…`;
  # if the new flake's differ, that evaluation fails before anything is
  # built, and the runner evaluates them as usual.
  ifVariants.${hashString "sha256" (toJSON { inherit contract variants; })} = {
    inherit libtorch training trainingDeps;
  };
  # The recipe as the flake understood it, defaults filled in: lets the runner
  # (and an operator) see what a build will use without building it.
  recipe = checkedRecipe;
}
