# The module's evaluation check (`nix flake check`: checks.<system>.module).
#
# A typical box's configuration must evaluate; a misspelt key, a value of
# the wrong type, and a key the module decides itself must each fail the
# evaluation, as they would fail `nixos-rebuild build`; the old name
# `before` must still be taken, with a warning. The cases are the same
# whoever evaluates them: the flake passes nixpkgs' nixosSystem, and
# tests/module_eval.nix passes lib.evalModules over its stand-ins (this box's
# Nix cannot evaluate current nixpkgs), so the logic here runs in the suite.
{
  lib,
  # A list of modules -> an evaluated configuration ({ config, ... }), with
  # the fdl-prepare module already in it.
  evalConfig,
  # An evaluated configuration -> a value whose evaluation throws when the
  # configuration would not build (for NixOS: the system's drvPath, which
  # evaluates every unit and checks the assertions).
  force,
}:
let
  typical = {
    services.fdl-prepare = {
      enable = true;
      gatedUnits = [ "fdl-join.service" ];
      settings.join = {
        data_source = "sshfs://data@storage.example:/srv/datasets/imagenet";
        libtorch = "auto";
        devices = [
          0
          1
        ];
        expect_gpus = 2;
        build_timeout = 7200;
        ssh = {
          identity_file = "/var/lib/fdl-prepare/id_ed25519";
          port = 22;
        };
        source.from = "git+https://git.example/train.git?ref=main";
        nix.substituters = [ "https://cache.example.org" ];
      };
    };
  };

  evaluates = modules: (builtins.tryEval (builtins.deepSeq (force (evalConfig modules)) true)).success;

  cases = [
    {
      name = "a typical box's configuration evaluates";
      ok = evaluates [ typical ];
    }
    {
      name = "a misspelt key in settings.join fails evaluation";
      ok = !evaluates [
        typical
        { services.fdl-prepare.settings.join.libtroch = "cpu"; }
      ];
    }
    {
      name = "a misspelt key in a sub-table fails evaluation";
      ok = !evaluates [
        typical
        { services.fdl-prepare.settings.join.ssh.prot = 22; }
      ];
    }
    {
      name = "a misspelt table beside join fails evaluation";
      ok = !evaluates [
        typical
        { services.fdl-prepare.settings.jion.libtorch = "cpu"; }
      ];
    }
    {
      name = "a value of the wrong type fails evaluation";
      ok = !evaluates [
        typical
        { services.fdl-prepare.settings.join.cpu_only = "yes"; }
      ];
    }
    {
      name = "a timeout outside the field table's range fails evaluation";
      ok = !evaluates [
        typical
        { services.fdl-prepare.settings.join.smoke_timeout = 0.5; }
      ];
    }
    {
      name = "a key the unit decides (state_dir) fails evaluation";
      ok = !evaluates [
        typical
        { services.fdl-prepare.settings.join.state_dir = "/srv/roots"; }
      ];
    }
    {
      name = "the old name `before` is still taken, with a warning";
      ok =
        let
          evaluated = evalConfig [
            {
              services.fdl-prepare = {
                enable = true;
                before = [ "fdl-join.service" ];
              };
            }
          ];
        in
        evaluates [
          {
            services.fdl-prepare = {
              enable = true;
              before = [ "fdl-join.service" ];
            };
          }
        ]
        && evaluated.config.services.fdl-prepare.gatedUnits == [ "fdl-join.service" ]
        && lib.any (lib.hasInfix "services.fdl-prepare.before") evaluated.config.warnings;
    }
  ];
in
{
  # Forced on its own by the flake, so that its error, if any, is shown.
  typical = force (evalConfig [ typical ]);
  results = map (c: { inherit (c) name ok; }) cases;
  failed = map (c: c.name) (builtins.filter (c: !c.ok) cases);
}
