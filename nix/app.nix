# The front end as a package: `nix run .#prepare` (and `.#default`).
#
# `flakeRef` is this flake's own store path as a flake URL, so a box that runs
# the app builds against exactly the flake that shipped it unless the operator
# names another (`flake` in the config, or FDL_PREPARE_FLAKE in the unit).
# `rev` is the flake's revision (`self.rev`, `self.dirtyRev` for a tree with
# uncommitted changes, else "unknown"), which `fdl-prepare --version` names.
{
  lib,
  python3Packages,
  nix,
  sshfs,
  fuse,
  fuse3,
  openssh,
  git,
  src,
  flakeRef,
  rev ? "unknown",
}:
let
  pyproject = builtins.fromTOML (builtins.readFile (src + "/pyproject.toml"));

  # Only what the Python build reads: editing tests or nix/ must not rebuild
  # the app (its wrapper still changes with the flake, which is the point).
  appSrc = lib.fileset.toSource {
    root = src;
    fileset = lib.fileset.unions [
      (src + "/pyproject.toml")
      (src + "/prepare")
      (lib.fileset.maybeMissing (src + "/README.md"))
    ];
  };
in
python3Packages.buildPythonApplication {
  pname = "fdl-prepare";
  inherit (pyproject.project) version;
  pyproject = true;
  src = appSrc;

  # The revision, as a module of the package (prepare.cli.app.revision
  # reads it; a pip install has none and says "rev unknown"): part of the
  # code that runs, not an environment variable a caller could set. The app
  # is rebuilt with every change to the flake anyway (flakeRef above), so
  # this costs no build it did not already pay for.
  postPatch = ''
    printf 'REVISION = %s\n' ${lib.escapeShellArg (builtins.toJSON rev)} > prepare/_revision.py
  '';

  build-system = [ python3Packages.setuptools ];
  # rich: the live progress display on a terminal (the `live` extra).
  dependencies = with python3Packages; [
    nvidia-ml-py
    pyyaml
    rich
  ];

  # nix and the fuse helpers go last on PATH: a host's own nix matches its
  # daemon, and on NixOS the setuid fusermount wrappers in /run/wrappers/bin
  # must win over the plain binaries, or an unprivileged unmount fails.
  # sshfs, ssh and git come first, so mounts and fetches behave the same on
  # every box whatever the distribution ships.
  makeWrapperArgs = [
    "--prefix"
    "PATH"
    ":"
    (lib.makeBinPath [
      sshfs
      openssh
      git
    ])
    "--suffix"
    "PATH"
    ":"
    (lib.makeBinPath [
      nix
      fuse3
      fuse
    ])
    "--set-default"
    "FDL_PREPARE_FLAKE"
    flakeRef
  ];

  # Every subpackage: one that setuptools left out of the wheel fails here.
  pythonImportsCheck = [
    "prepare"
    "prepare.build"
    "prepare.cli"
    "prepare.config"
    "prepare.data"
    "prepare.gpu"
    "prepare.host"
    "prepare.nix"
    "prepare.publish"
  ];

  meta = {
    description = pyproject.project.description;
    mainProgram = "fdl-prepare";
    platforms = lib.platforms.linux;
  };
}
