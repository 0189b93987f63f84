# Evaluate nix/module.nix with nixpkgs' real module system and lib, against
# minimal stand-ins for the parts of NixOS and nixpkgs it touches, and return
# what a test needs to check as JSON.
#
# Real: lib.evalModules, lib.types, every lib function the module calls, the
# option merging and priorities (mkDefault, mkIf), the module itself.
# Stand-ins (nixpkgs proper needs Nix >= 2.18 to evaluate, this box has 2.8):
#   - systemd.services: the NixOS option names the module uses, with NixOS's
#     types and merge rules for unit options, no freeform escape hatch (an
#     option NixOS does not have is an error here too), PATH computed from
#     `path` as NixOS does, and the unit file rendered in NixOS's layout;
#   - pkgs.formats.toml: nixpkgs' TOML value type, rendered by a small TOML
#     writer below (nixpkgs runs remarshal's json2toml instead);
#   - packages: attrsets with outPath under `fakeRoot`, so a test can put real
#     executables there and run the unit's command lines as they are.
#
#   nix-instantiate --read-write-mode --eval --strict --json tests/module_eval.nix \
#     --argstr libPath "$NIXPKGS_LIB" --argstr configuration ./host.nix --argstr fakeRoot /tmp/x
{
  libPath,
  configuration,
  fakeRoot,
  systemdVersion ? "256.8",
  system ? "x86_64-linux",
  # "configuration": the evaluated configuration; "check": the cases of
  # nix/module-check.nix, with `configuration` added to each.
  output ? "configuration",
}:

let
  lib = import libPath;
  inherit (lib)
    mkOption
    types
    concatStrings
    concatStringsSep
    concatMapStringsSep
    mapAttrsToList
    filterAttrs
    ;

  fakePackage = name: version: {
    type = "derivation";
    inherit name version;
    pname = name;
    outPath = "${fakeRoot}/${name}";
    outputs = [ "out" ];
    meta = { };
  };

  # TOML writer. JSON string escapes are all valid TOML basic-string escapes,
  # so strings go through toJSON; tables come after a table's plain keys.
  toTOML =
    value:
    let
      key = k: if builtins.match "[A-Za-z0-9_-]+" k != null then k else builtins.toJSON k;
      inline =
        v:
        if builtins.isString v then
          builtins.toJSON v
        else if builtins.isBool v then
          (if v then "true" else "false")
        else if builtins.isInt v then
          toString v
        else if builtins.isFloat v then
          builtins.toJSON v
        else if builtins.isPath v then
          builtins.toJSON (toString v)
        else if builtins.isList v then
          "[" + concatMapStringsSep ", " inline v + "]"
        else if builtins.isAttrs v then
          "{ " + concatStringsSep ", " (mapAttrsToList (k: x: "${key k} = ${inline x}") v) + " }"
        else
          throw "TOML cannot encode a ${builtins.typeOf v}";
      table =
        path: attrs:
        let
          plain = filterAttrs (_: v: !builtins.isAttrs v) attrs;
          tables = filterAttrs (_: builtins.isAttrs) attrs;
          header = if path == [ ] then "" else "[${concatMapStringsSep "." key path}]\n";
        in
        header
        + concatStrings (mapAttrsToList (k: v: "${key k} = ${inline v}\n") plain)
        + concatStrings (mapAttrsToList (k: v: "\n" + table (path ++ [ k ]) v) tables);
    in
    lib.removePrefix "\n" (table [ ] value);

  pkgs = rec {
    stdenv.hostPlatform.system = system;
    writeText = name: text: builtins.toFile name text;
    # The shell the unit's scripts are run with (ExecStart names it, so the
    # script files need no executable bit, which builtins.toFile cannot set).
    runtimeShell = "${bash}/bin/bash";
    formats.toml =
      { }:
      {
        # nixpkgs' pkgs-lib/formats.nix type for TOML values.
        type =
          let
            valueType =
              types.oneOf [
                types.bool
                types.int
                types.float
                types.str
                types.path
                (types.attrsOf valueType)
                (types.listOf valueType)
              ]
              // {
                description = "TOML value";
              };
          in
          valueType;
        generate = name: value: writeText name (toTOML value);
      };
    nix = fakePackage "nix" "2.28.3";
    sshfs-fuse = fakePackage "sshfs" "3.7.3";
    fuse = fakePackage "fuse" "2.9.9";
    fuse3 = fakePackage "fuse3" "3.16.2";
    openssh = fakePackage "openssh" "10.0p2";
    git = fakePackage "git" "2.49.0";
    coreutils = fakePackage "coreutils" "9.7";
    findutils = fakePackage "findutils" "4.10.0";
    gnugrep = fakePackage "gnugrep" "3.11";
    gnused = fakePackage "gnused" "4.9";
    bash = fakePackage "bash" "5.2p37";
    util-linux = fakePackage "util-linux" "2.41";
  };

  self = {
    outPath = "${fakeRoot}/flake-source";
    narHash = "sha256-47DEQpj8HBSa+/TImW+5JCeuQeRkm5NMpJWZG3hSuFU=";
    packages.${system}.default = fakePackage "fdl-prepare" "0.1.0";
  };

  # NixOS's unit option type: lists concatenate, anything else must agree.
  unitOption = lib.mkOptionType {
    name = "systemd option";
    merge =
      loc: defs:
      if lib.any (d: builtins.isList d.value) defs then
        lib.concatMap (d: lib.toList d.value) defs
      else
        lib.mergeEqualOption loc defs;
  };

  listOfUnits = mkOption {
    type = types.listOf types.str;
    default = [ ];
  };

  serviceModule =
    { config, options, ... }:
    {
      options = {
        description = mkOption {
          type = types.singleLineStr;
          default = "";
        };
        documentation = mkOption {
          type = types.listOf types.str;
          default = [ ];
        };
        wants = listOfUnits;
        requires = listOfUnits;
        after = listOfUnits;
        before = listOfUnits;
        wantedBy = listOfUnits;
        requiredBy = listOfUnits;
        path = mkOption {
          type = types.listOf (types.either types.package types.str);
          default = [ ];
        };
        environment = mkOption {
          type = types.attrsOf (types.nullOr (types.oneOf [ types.str types.path types.package ]));
          default = { };
        };
        restartTriggers = mkOption {
          type = types.listOf types.unspecified;
          default = [ ];
        };
        restartIfChanged = mkOption {
          type = types.bool;
          default = true;
        };
        stopIfChanged = mkOption {
          type = types.bool;
          default = true;
        };
        startLimitIntervalSec = mkOption { type = types.int; };
        unitConfig = mkOption {
          type = types.attrsOf unitOption;
          default = { };
        };
        serviceConfig = mkOption {
          type = types.attrsOf unitOption;
          default = { };
        };
      };
      config = {
        # NixOS's default service PATH entries, after the unit's own.
        path = lib.mkAfter [
          pkgs.coreutils
          pkgs.findutils
          pkgs.gnugrep
          pkgs.gnused
          nixos.config.systemd.package
        ];
        environment.PATH = lib.mkIf (config.path != [ ]) "${lib.makeBinPath config.path}:${lib.makeSearchPathOutput "bin" "sbin" config.path}";
        unitConfig =
          lib.optionalAttrs (config.requires != [ ]) { Requires = toString config.requires; }
          // lib.optionalAttrs (config.wants != [ ]) { Wants = toString config.wants; }
          // lib.optionalAttrs (config.after != [ ]) { After = toString config.after; }
          // lib.optionalAttrs (config.before != [ ]) { Before = toString config.before; }
          // lib.optionalAttrs (config.restartTriggers != [ ]) {
            X-Restart-Triggers = builtins.toFile "X-Restart-Triggers" (toString config.restartTriggers);
          }
          // lib.optionalAttrs (config.description != "") { Description = config.description; }
          // lib.optionalAttrs (config.documentation != [ ]) { Documentation = toString config.documentation; }
          // lib.optionalAttrs options.startLimitIntervalSec.isDefined {
            StartLimitIntervalSec = toString config.startLimitIntervalSec;
          };
      };
    };

  standIns = {
    options = {
      assertions = mkOption {
        type = types.listOf types.unspecified;
        default = [ ];
      };
      warnings = mkOption {
        type = types.listOf types.str;
        default = [ ];
      };
      nix.package = mkOption {
        type = types.package;
        default = pkgs.nix;
      };
      systemd.package = mkOption {
        type = types.package;
        default = fakePackage "systemd" systemdVersion;
      };
      systemd.services = mkOption {
        type = types.attrsOf (types.submodule serviceModule);
        default = { };
      };
    };
  };

  evalConfig =
    modules:
    lib.evalModules {
      modules = [
        standIns
        (import ../nix/module.nix self)
      ]
      ++ modules;
      specialArgs = { inherit pkgs; };
    };

  nixos = evalConfig [ (/. + configuration) ];

  cfg = nixos.config;

  # The unit file in the layout NixOS writes (nixos/lib/systemd-lib.nix).
  toOption = x: if x == true then "true" else if x == false then "false" else toString x;
  section =
    attrs:
    concatStrings (
      lib.concatLists (
        mapAttrsToList (n: v: map (x: "${n}=${toOption x}\n") (lib.toList v)) attrs
      )
    );
  unitText =
    svc:
    "[Unit]\n"
    + section svc.unitConfig
    + "\n[Service]\n"
    + concatStrings (
      mapAttrsToList (n: v: lib.optionalString (v != null) "Environment=${builtins.toJSON "${n}=${v}"}\n") svc.environment
    )
    + lib.optionalString (!svc.restartIfChanged) "X-RestartIfChanged=false\n"
    + lib.optionalString (!svc.stopIfChanged) "X-StopIfChanged=false\n"
    + section svc.serviceConfig
    + lib.optionalString (svc.wantedBy != [ ]) "\n[Install]\nWantedBy=${concatStringsSep " " svc.wantedBy}\n";

  render = svc: {
    inherit (svc)
      description
      wants
      requires
      after
      before
      wantedBy
      requiredBy
      environment
      restartIfChanged
      stopIfChanged
      unitConfig
      serviceConfig
      ;
    path = map toString svc.path;
    unitText = unitText svc;
  };

  # nix/module-check.nix, the flake's evaluation check, run here against
  # the stand-ins: `force` does what building NixOS's toplevel does with a
  # configuration, evaluating every unit and throwing on a failed assertion.
  moduleCheck = import ../nix/module-check.nix {
    inherit lib;
    evalConfig = modules: evalConfig ([ (/. + configuration) ] ++ modules);
    force =
      evaluated:
      let
        failed = lib.filter (a: !a.assertion) evaluated.config.assertions;
      in
      if failed != [ ] then
        throw "Failed assertions:\n- ${concatMapStringsSep "\n- " (a: a.message) failed}"
      else
        builtins.deepSeq (lib.mapAttrs (_: unitText) evaluated.config.systemd.services) true;
  };
in
if output == "check" then
  { inherit (moduleCheck) typical results; }
else
  {
    failedAssertions = map (a: a.message) (lib.filter (a: !a.assertion) cfg.assertions);
    inherit (cfg) warnings;
    systemdVersion = cfg.systemd.package.version;
    services = lib.mapAttrs (_: render) cfg.systemd.services;
    settings = cfg.services.fdl-prepare.settings;
    # What the NixOS manual would render for each option.
    options = map (o: {
      inherit (o) name description type;
      default = o.default.text or null;
    }) (lib.filter (o: o.visible && !o.internal) (lib.optionAttrSetToDocList nixos.options.services.fdl-prepare));
  }
