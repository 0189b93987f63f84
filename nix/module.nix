# services.fdl-prepare: prepare a GPU worker box under systemd's restart loop.
#
# The flake wires this as `nixosModules.default = import ./nix/module.nix self;`,
# so `self` is the flake: its package is the default front end and its own store
# path is the default flake the front end builds from.
#
# The unit is the whole retry policy; fdl-prepare itself never loops. It exits
# 0 (prepared), 75 (transient: the far side of a mount is down, nothing is
# published yet, a build failed) or 78 (permanent: no GPU, a spec that does not
# parse). systemd retries the first with a growing delay and stops on the
# second, so a box that can never train fails loudly once instead of
# hot-looping, and a box waiting on a controller keeps trying forever.
self:
{
  config,
  lib,
  pkgs,
  ...
}:

let
  inherit (lib)
    mkEnableOption
    mkOption
    mkIf
    mkDefault
    types
    literalExpression
    ;

  cfg = config.services.fdl-prepare;
  join = cfg.settings.join;

  settingsFormat = pkgs.formats.toml { };

  # TOML has no null: an unset typed option must vanish from the file rather
  # than reach the renderer, and a table left empty by that is dropped too so
  # the file holds exactly what the operator set.
  prune =
    value:
    if builtins.isAttrs value then
      lib.filterAttrs (_: v: !(builtins.isAttrs v && v == { })) (
        lib.mapAttrs (_: prune) (lib.filterAttrs (_: v: v != null) value)
      )
    else
      value;

  # The store path of this file changes with every settings change, and it is
  # on ExecStart, so a changed setting always yields a changed unit.
  configFile = settingsFormat.generate "fdl-prepare.toml" (prune cfg.settings);

  # Exit statuses of fdl-prepare (prepare/cli.py). 78 is a permanent failure;
  # 2 is a usage error, which for a generated command line means the module
  # and the package disagree about flags: retrying cannot fix either.
  exitPermanent = 78;
  exitUsage = 2;
  # A bug in fdl-prepare (an exception that is not a Fail), reported with its
  # traceback: retrying repeats it.
  exitSoftware = 70;

  # Capabilities nothing in a preparation uses: the clock, reboot, audit,
  # MAC, BPF, ptrace, raw I/O, memory locking, privileged ports.
  droppedCapabilities = [
    "CAP_SYS_TIME"
    "CAP_SYS_BOOT"
    "CAP_SYS_PACCT"
    "CAP_SYS_TTY_CONFIG"
    "CAP_WAKE_ALARM"
    "CAP_LINUX_IMMUTABLE"
    "CAP_AUDIT_CONTROL"
    "CAP_AUDIT_READ"
    "CAP_AUDIT_WRITE"
    "CAP_MAC_ADMIN"
    "CAP_MAC_OVERRIDE"
    "CAP_SYSLOG"
    "CAP_BLOCK_SUSPEND"
    "CAP_LEASE"
    "CAP_BPF"
    "CAP_PERFMON"
    "CAP_SYS_PTRACE"
    "CAP_SYS_RAWIO"
    "CAP_IPC_LOCK"
    "CAP_NET_BIND_SERVICE"
    "CAP_NET_BROADCAST"
    "CAP_NET_RAW"
  ];

  systemdAtLeast = v: lib.versionAtLeast (lib.getVersion config.systemd.package) v;

  prepare = config.systemd.services.fdl-prepare;

  # Gated units that a target wants, and which targets.
  gatedWantedBy = lib.filterAttrs (_: targets: targets != [ ]) (
    lib.genAttrs (builtins.filter (lib.hasSuffix ".service") cfg.gatedUnits) (
      u: (config.systemd.services.${lib.removeSuffix ".service" u} or { wantedBy = [ ]; }).wantedBy
    )
  );

  isSshfs = join.data_source != null && lib.hasPrefix "sshfs://" join.data_source;
  sshOptions = if join.ssh.options == null then [ ] else join.ssh.options;
  # OpenSSH keywords are case-insensitive and take `=` or a space.
  hasIdentityOption = lib.any (o: builtins.match "[[:space:]]*[Ii][Dd][Ee][Nn][Tt][Ii][Tt][Yy][Ff][Ii][Ll][Ee][[:space:]=].*" o != null) sshOptions;

  flakeDefault = "path:${self}" + lib.optionalString (self ? narHash) "?narHash=${self.narHash}";

  # The module's prose for the NixOS manual, per key of the field table:
  # the CLI's help text (the default description) speaks of flags. Types,
  # defaults and the keys themselves come from the table (nix/fields.nix).
  fieldDocs = {
    data_source = {
      description = ''
        Dataset source root, `sshfs://[user@]host[:port]/abs/path`, mounted
        read-only at `data_path`. A far side that is down is a transient
        failure: the unit retries until it comes up.
      '';
      example = "sshfs://data@storage.example:/srv/datasets/imagenet";
    };
    data_path = {
      description = ''
        Absolute dataset root: where `data_source` is mounted (default
        /flodl/data), or, with no `data_source`, a root provisioning already
        placed, which must be a listable directory.
      '';
      example = "/flodl/data";
    };
    libtorch = {
      description = ''
        libtorch variant: `auto` (chosen from this box's cards and driver), or
        a label the flake provides (`cpu`, `cu126`, `cu128`, `rocm7.0`, ...);
        floDl's spellings (`12.6`, `12.8`, `rocm70`, `7.0`, `rocm71`, `7.1`)
        name the same builds. Null builds no libtorch.
      '';
      example = "auto";
    };
    devices = {
      description = "GPU indices this box offers, numbered as floDl's `devices` are: CUDA's ordinals for NVIDIA (the cards CUDA_VISIBLE_DEVICES leaves, in its order), ROCm's for AMD. Null offers every visible one.";
      example = [
        0
        1
      ];
    };
    expect_gpus.description = ''
      How many healthy GPUs this box must offer, after the masks. Fewer
      (a card fallen off the bus, a sick card, one masked out) is a
      permanent failure naming each missing or sick index, so the unit
      stops instead of joining a run short of cards; a card whose NVLink
      fabric is still being set up makes it retry instead.
    '';
    user = {
      description = ''
        The training user: the account `fdl join` and its ranks (floDl's data
        plane) run as. The unit runs as root, so without it step 3 proves
        root's dataset cache (/root/.flodl/data) and stage while training
        reads and writes the training user's. Set, step 3 proves that user's
        cache (`~/.flodl/data` under its home in the password database,
        created owned by it) and the stage as that user, never following a
        link it planted, and the smoke run runs as it instead of
        `smoke_user`. Root, a user the box does not have, and a Nix build
        user (nixbld) stop the unit. Null: root's directories, as before.
      '';
      example = "fdl-train";
    };
    smoke_user = {
      description = ''
        The unprivileged user the smoke run of the built binary runs as
        (the unit runs as root; the binary is the training source's code).
        It gets that user's primary group, the `render` and `video` groups
        for the GPUs, no capabilities and a clean environment. A user that
        does not exist, is root or is one of Nix's build users stops the
        unit. Null: `dynamic`, a uid of the run's own (60600-60699, none
        the box uses, held for the run).
      '';
      example = "nobody";
    };
    cpu_only.description = ''
      Skip the GPU gate (CPU-only workers, demos). Only the `cpu` libtorch
      variant is then allowed.
    '';
    list_timeout.description = ''
      Seconds a listing of the dataset root may take before the mount counts
      as dead (transient). Null: 10.
    '';
    build_timeout.description = ''
      Seconds a build may run before it is abandoned (transient). Null: no
      limit of fdl-prepare's own.
    '';
    smoke_timeout.description = ''
      Seconds the smoke run may take before it is stopped (transient).
      Null: 60.
    '';
    refresh.description = ''
      Evaluate and build on every attempt as if nothing were known from
      earlier ones (the warm-path record is ignored): for chasing a problem,
      not for a fleet, where it makes every start cold.
    '';
    "source.from" = {
      description = ''
        The training source: floDl's `file:///abs/path` (a directory on the
        box) or `rsync://[user@]host[:port]:/abs/path` (pulled over ssh with
        the ssh block), both copied with rsync into the state directory;
        floDl's `git+https|ssh|file://...#<tag|branch|sha>`; or a flake URL. A
        git source needs a ref: a floating default branch is not a pin.
      '';
      example = "git+https://git.example/train.git?ref=main";
    };
    "source.cwd" = {
      description = "Directory inside the source the build and the run use.";
      example = ".";
    };
    "source.build" = {
      description = "Build line for the source.";
      example = "cargo build --release";
    };
    "source.bin" = {
      description = "The training binary the build installs.";
      example = "train";
    };
    "source.smoke".description = ''
      Arguments for one run of the built binary before the box counts as
      prepared (the box's own: floDl's run manifest has no smoke). A binary the
      loader cannot start (a library it cannot find, such as the
      driver's libcuda.so.1) stops the unit; a timeout or another
      failure is retried. Empty or null runs nothing.
    '';
    "ssh.target" = {
      description = ''
        ssh host of the controller tunnel (the join loop dials it); a
        `data_source` on this host takes `ssh.user` and `ssh.port` as its
        defaults.
      '';
      example = "controller.example";
    };
    "ssh.port".description = "ssh port on `ssh.target`, and of a `data_source` on that host that names none.";
    "ssh.user" = {
      description = "ssh user on `ssh.target`, and of a `data_source` on that host that names none.";
      example = "worker";
    };
    # A string, not a path: a Nix path literal would copy the private key
    # into the world-readable store (the type refuses one).
    "ssh.identity_file" = {
      description = ''
        Private key for ssh and the sshfs mount, as an absolute path outside
        the Nix store (provision it with agenix, sops-nix or by hand). The
        unit runs with BatchMode=yes: a key with a passphrase fails instead
        of waiting for a prompt nobody answers.
      '';
      example = "/var/lib/fdl-prepare/id_ed25519";
    };
    "ssh.options" = {
      description = ''
        ssh `-o` options, placed first on every ssh/sshfs command line:
        OpenSSH keeps the first value it sees, so these win.
      '';
      example = [ "StrictHostKeyChecking=accept-new" ];
    };
    # What a box trusts comes from here, never from a flake's nixConfig:
    # both lists reach every nix call as options, added to nix.conf's own.
    "nix.substituters".description = ''
      Binary caches (store URLs) that `fdl-prepare publish --to` fills:
      the box substitutes the published libtorch and training binary
      from them instead of building. A cache that cannot be reached is
      a note, and the box builds. The unit runs as root, so the daemon
      takes them; a non-root user needs them in the daemon's
      `trusted-substituters` (`nix.settings.trusted-substituters`), or
      preparation stops (exit 78).
    '';
    "nix.trusted_public_keys".description = ''
      Public keys (`name:base64`) the published paths are signed with.
      A path signed by none of them (or of nix.conf's) is not
      substituted: the box builds it itself and says why. Never put the
      secret signing key here.
    '';
  };

  tableDocs = {
    ssh = "The `[join.ssh]` table.";
    nix = "The `[join.nix]` table: binary caches and the keys their paths must be signed with.";
    source = ''
      The box's own recipe (`[join.source]`). A run manifest published in
      the source tree outranks every field it sets.
    '';
  };

  # The keys of the field table the module does not take from it. `flake`
  # is declared here so that the module's own `flake` option can give it
  # its default; the other two are decided by the unit and the system, and
  # a value for them is refused by an assertion that says so (a typed
  # option would let it through, an undeclared one would say only "does not
  # exist").
  refusedKeys = {
    state_dir = ''
      the unit's StateDirectory= decides it (/var/lib/fdl-prepare, passed as $STATE_DIRECTORY), where the GC roots of
      what a run uses must live. Remove it; to move the directory, set
      systemd.services.fdl-prepare.serviceConfig.StateDirectory'';
    driver_dir = ''
      on NixOS the system keeps the driver directory (/run/opengl-driver/lib, from hardware.graphics and the
      NVIDIA driver options) and fdl-prepare leaves it alone. Remove it'';
  };
  ownOptions = {
    flake = mkOption {
      type = types.nullOr types.nonEmptyStr;
      default = null;
      description = ''
        The flake providing the libtorch variants and the training build
        (`[join] flake`). Default: `services.fdl-prepare.flake`, which it
        outranks.
      '';
    };
  }
  // lib.mapAttrs (
    _: why:
    mkOption {
      type = types.nullOr types.anything;
      default = null;
      visible = false;
      description = "Refused: ${why}.";
    }
  ) refusedKeys;

  joinFields = import ./fields.nix {
    inherit lib;
    docs = fieldDocs;
    tables = tableDocs;
    own = builtins.attrNames ownOptions;
  };

  # No freeformType anywhere: the rendered file is fdl-prepare's alone, and
  # it reads only [join], so a key or a table it does not know is either a
  # typo the CLI would refuse only at the first start, or (outside [join])
  # text nothing reads. Both are evaluation errors instead.
  joinSubmodule = types.submodule { options = joinFields.options // ownOptions; };

  # switch-to-configuration holds this lock for as long as it runs (and
  # refuses to start while another holds it), so a start that finds it held
  # is part of a switch. The boot's activation does not take it.
  switchLock = "/run/nixos/switch-to-configuration.lock";

  systemctl = lib.getExe' config.systemd.package "systemctl";
  flock = lib.getExe' pkgs.util-linux "flock";

  # Run by fdl-prepare-after-switch.service, the transient unit a start
  # during a switch leaves behind: once the switch has released its lock
  # (and so no longer looks at the units), restart preparation with what
  # the switch installed. Nothing of that attempt, not even a transient
  # failure, can then count against the switch.
  afterSwitchScript = pkgs.writeText "fdl-prepare-after-switch.sh" ''
    ${flock} --shared "$1" true
    exec ${systemctl} restart --no-block fdl-prepare.service
  '';

  # fdl-prepare-start.service's ExecStart, given the switch's lock.
  startScript = pkgs.writeText "fdl-prepare-start.sh" ''
    lock=$1
    ${flock} --nonblock --shared --conflict-exit-code 3 "$lock" true 2>/dev/null
    if [ $? = 3 ]; then
      echo "fdl-prepare-start: a switch is in progress; fdl-prepare.service restarts once it has finished (fdl-prepare-after-switch.service)"
      # A second start in one switch finds the first one's unit still
      # waiting: the one restart after the switch covers both.
      ${lib.getExe' config.systemd.package "systemd-run"} --no-block --collect --quiet \
        --unit=fdl-prepare-after-switch \
        --description="Restart fdl-prepare.service once nixos-rebuild switch has finished" \
        -- ${pkgs.runtimeShell} ${afterSwitchScript} "$lock" \
        || exec ${systemctl} --quiet is-active fdl-prepare-after-switch.service
      exit 0
    fi
    # No switch: boot, or a start by hand. Wait for the first attempt, as
    # multi-user.target would if it wanted fdl-prepare.service itself. Its
    # failure is preparation's to report (a transient one fails this start
    # job while the unit retries): this unit failing too would only mark
    # the system degraded on every boot whose first attempt is retried.
    ${systemctl} start fdl-prepare.service \
      || echo "fdl-prepare-start: the first attempt did not prepare this box; fdl-prepare.service says why and retries what can be retried"
  '';
in
{
  # `before` said less than it did: the units named get Requires= on
  # preparation and are started by it, not only ordered after it.
  imports = [
    (lib.mkRenamedOptionModule
      [ "services" "fdl-prepare" "before" ]
      [ "services" "fdl-prepare" "gatedUnits" ]
    )
  ];

  options.services.fdl-prepare = {
    enable = mkEnableOption "fdl-prepare, which gets this box ready for training before it dials a controller";

    package = mkOption {
      type = types.package;
      default = self.packages.${pkgs.stdenv.hostPlatform.system}.default;
      defaultText = literalExpression "self.packages.\${pkgs.stdenv.hostPlatform.system}.default";
      description = "The fdl-prepare front end (its `bin/fdl-prepare` is run).";
    };

    flake = mkOption {
      type = types.nullOr types.str;
      default = flakeDefault;
      defaultText = literalExpression "\"path:\${self}?narHash=\${self.narHash}\"";
      example = "github:example/fleet";
      description = ''
        Flake providing the libtorch variants and the training build, written
        to `[join] flake` in the config file. The default is this flake's own
        store path, so a box builds with exactly the flake it was deployed
        from. Null leaves the choice to the front end.
      '';
    };

    settings = mkOption {
      type = types.submodule {
        options.join = mkOption {
          type = joinSubmodule;
          default = { };
          description = "The `[join]` table.";
        };
      };
      default = { };
      example = literalExpression ''
        {
          join = {
            data_source = "sshfs://data@storage.example:/srv/datasets/imagenet";
            libtorch = "auto";
            ssh.identity_file = "/var/lib/fdl-prepare/id_ed25519";
            source.from = "git+https://git.example/train.git?ref=main";
          };
        }
      '';
      description = ''
        fdl-prepare's config file as Nix, rendered to TOML and passed with
        `--config`. Unset (null) options are left out of the file. Every key
        is typed from fdl-prepare's own field table, so a key it does not know
        (`libtroch`) or a value of the wrong type fails the evaluation
        (`nixos-rebuild build`), naming the option; what a type cannot say (a
        URL's pin, a path that must exist) fdl-prepare checks at start
        (exit 78).
      '';
    };

    gatedUnits = mkOption {
      type = types.listOf types.str;
      default = [ ];
      example = [ "fdl-join.service" ];
      description = ''
        Units that must only run on a prepared box, typically the join unit
        that dials the controller, and that preparation starts. Formerly
        `before`, which is still taken, with a warning. Each unit named gets
        `After=` and `Requires=` on fdl-prepare.service (the module sets
        `before` and `requiredBy`), so:

        - starting it starts preparation first and waits for it;
        - a permanent failure fails its start ("Dependency failed");
        - when preparation is restarted (a settings change on
          `nixos-rebuild switch`), it is restarted after the new preparation.

        A transient failure also fails its pending start, and systemd does not
        start it again when a later retry succeeds (systemd issue #18856), so
        a successful preparation starts these units itself
        (`systemctl start --no-block`): they need no `wantedBy` of their own,
        and with `backgroundOnSwitch` should have none (a switch that starts
        one waits for preparation through it). A unit that only wants a
        prepared box when there is one should instead declare `after` and
        `wants` on fdl-prepare.service itself and stay out of this list.
      '';
    };

    backgroundOnSwitch = mkOption {
      type = types.bool;
      default = true;
      description = ''
        Keep `nixos-rebuild switch` (and deploy-rs, colmena: anything that
        runs switch-to-configuration) from waiting on preparation or failing
        because of it.

        On: at boot nothing changes: multi-user.target wants
        fdl-prepare-start.service, which starts fdl-prepare.service and
        waits for its first attempt, so boot is finished only once that
        attempt is (a transient failure is retried by fdl-prepare.service
        as always).
        During a switch that changes the settings, the package or the unit
        (or that deploys the module for the first time),
        fdl-prepare-start.service is restarted and sees the switch's lock
        held: it leaves fdl-prepare-after-switch.service waiting for the
        switch to end and returns at once; once the switch has released the
        lock, that unit restarts fdl-prepare.service, in the background. The
        switch lists fdl-prepare.service among the changed units it is "NOT
        restarting", returns without waiting for a cold build, and a
        transient failure of the new attempt is retried by the unit as
        always, after the switch, so it cannot fail it.
        fdl-prepare.service is not restarted by the switch itself
        (`restartIfChanged = false`) and not wanted by multi-user.target
        directly. With a switch-to-configuration that takes no lock (the
        old Perl one), the start waits for preparation as with this off.

        Off: fdl-prepare.service is wanted by multi-user.target and a changed
        unit is restarted by the switch itself, which waits for the attempt
        (minutes for a cold build) and counts a transient failure as a
        failed unit (exit 4), which deploy-rs and colmena take for a failed
        deployment.
      '';
    };

    sshAuthSock = mkOption {
      type = types.nullOr types.str;
      default = null;
      example = "/run/fdl-prepare/agent.sock";
      description = ''
        An ssh-agent socket the service may use (`SSH_AUTH_SOCK`), instead of
        `settings.join.ssh.identity_file`. A system service sees no user's
        agent unless it is named here.
      '';
    };
  };

  config = mkIf cfg.enable {
    services.fdl-prepare.settings.join.flake = mkIf (cfg.flake != null) (mkDefault cfg.flake);

    assertions = [
      {
        assertion = systemdAtLeast "244";
        message = ''
          services.fdl-prepare needs systemd 244 or later, which accepts Restart=on-failure on a
          Type=oneshot unit; systemd.package is ${lib.getVersion config.systemd.package}.
        '';
      }
      {
        assertion = !isSshfs || join.ssh.identity_file != null || hasIdentityOption || cfg.sshAuthSock != null;
        message = ''
          services.fdl-prepare.settings.join.data_source is an sshfs source (${toString join.data_source}),
          but the service has no way to authenticate: set
          services.fdl-prepare.settings.join.ssh.identity_file to a private key outside the Nix store,
          or services.fdl-prepare.sshAuthSock to an ssh-agent socket. The mount runs with BatchMode=yes,
          so it cannot ask for a password.
        '';
      }
      {
        assertion = !join.cpu_only || builtins.elem join.libtorch [ null "auto" "cpu" ];
        message = ''
          services.fdl-prepare.settings.join.cpu_only = true allows only the cpu libtorch variant,
          but services.fdl-prepare.settings.join.libtorch = "${toString join.libtorch}".
          Set services.fdl-prepare.settings.join.libtorch = "cpu" (or "auto"), or drop cpu_only.
        '';
      }
      {
        assertion = join.ssh.identity_file == null || (lib.hasPrefix "/" join.ssh.identity_file && !lib.hasPrefix builtins.storeDir join.ssh.identity_file);
        message = ''
          services.fdl-prepare.settings.join.ssh.identity_file = "${toString join.ssh.identity_file}" must be an
          absolute path outside ${builtins.storeDir} (the store is world-readable); provision the key with
          agenix or sops-nix, e.g. to /var/lib/fdl-prepare/id_ed25519.
        '';
      }
      {
        assertion = join.user == null || !(builtins.elem join.user [ "root" "" ]);
        message = ''
          services.fdl-prepare.settings.join.user = ${builtins.toJSON join.user}: the training user runs the
          training source's code and owns the dataset cache, and must never be root. Set it to the account
          `fdl join` runs as (e.g. users.users.fdl-train = { isSystemUser = true; group = "fdl-train";
          home = "/var/lib/fdl-train"; createHome = true; }), or leave it null.
        '';
      }
      {
        assertion = join.data_path == null || lib.hasPrefix "/" join.data_path;
        message = ''
          services.fdl-prepare.settings.join.data_path = "${toString join.data_path}" is not absolute;
          give the absolute dataset root, e.g. "/flodl/data".
        '';
      }
      {
        assertion = lib.all (u: builtins.match "[a-zA-Z0-9@%:_.\\-]+[.](service|socket|device|mount|automount|swap|target|path|timer|scope|slice)" u != null) cfg.gatedUnits;
        message = ''
          services.fdl-prepare.gatedUnits takes full unit names (e.g. "fdl-join.service"), got
          ${builtins.toJSON cfg.gatedUnits}.
        '';
      }
    ]
    ++ lib.mapAttrsToList (key: why: {
      assertion = join.${key} == null;
      message = ''
        services.fdl-prepare.settings.join.${key} = ${builtins.toJSON join.${key}} is not for the module to pass on:
        ${why}.
      '';
    }) refusedKeys;

    # A gated unit the switch itself starts (on its first deploy, or after
    # preparation failed) pulls preparation in through Requires= and waits
    # for it, and the switch with it: what backgroundOnSwitch is there to
    # avoid. Preparation starts these units itself once it succeeds.
    warnings = lib.optionals cfg.backgroundOnSwitch (
      map (
        u:
        "services.fdl-prepare.gatedUnits names ${u}, which ${lib.concatStringsSep " and " gatedWantedBy.${u}} wants: a nixos-rebuild switch that starts it waits for preparation through it. Leave it out of systemd.services.${lib.removeSuffix ".service" u}.wantedBy (or set that to lib.mkForce [ ]): a successful preparation starts it."
      ) (builtins.attrNames gatedWantedBy)
    );

    systemd.services.fdl-prepare = {
      description = "Prepare this box for training (GPU gate, dataset root, libtorch and training build)";
      # Fetching the source and mounting sshfs need the network up, not just
      # configured; every build goes through the daemon's socket.
      wants = [ "network-online.target" ];
      after = [
        "network-online.target"
        "nix-daemon.socket"
      ];
      before = cfg.gatedUnits;
      requiredBy = cfg.gatedUnits;
      # A box prepares at boot even with nothing depending on it, so it is
      # ready before anything dials. Targets order themselves after what they
      # want, so boot is "finished" only after the first attempt. In the
      # background mode fdl-prepare-start.service is what the target wants,
      # and it waits for this unit at boot.
      wantedBy = lib.optional (!cfg.backgroundOnSwitch) "multi-user.target";

      # nix must be the system's own (the daemon's protocol); fuse for
      # fusermount on the sshfs mountpoint, openssh under sshfs and git+ssh
      # fetches, git for git sources.
      path = [
        config.nix.package
        pkgs.sshfs-fuse
        pkgs.fuse3
        pkgs.fuse
        pkgs.openssh
        pkgs.git
      ];

      environment = lib.optionalAttrs (cfg.sshAuthSock != null) { SSH_AUTH_SOCK = cfg.sshAuthSock; };

      # ExecStart names the config file by store path, so any settings (or
      # package) change rewrites the unit. Without backgroundOnSwitch,
      # switch-to-configuration restarts a changed unit and waits for it;
      # with it, fdl-prepare-start.service (whose restart triggers are this
      # unit's settings) restarts it after the switch. stopIfChanged = false
      # makes it one `restart` after activation instead of
      # stop-before/start-after, so the gated units are restarted behind the
      # new preparation (Requires= propagates restarts) instead of left
      # stopped.
      restartIfChanged = !cfg.backgroundOnSwitch;
      stopIfChanged = false;

      unitConfig = {
        # Every auto-restart counts as a start; with the default limit (5 in
        # 10 s) systemd would eventually give up on a box that is only waiting
        # for its controller. 0 disables the limit.
        StartLimitIntervalSec = 0;
      };

      serviceConfig = {
        # oneshot + RemainAfterExit: the unit is "active" only once prepared,
        # so other units can order after that state. systemd accepts
        # Restart=on-failure for Type=oneshot since v244 (systemd PR #13754);
        # older releases refuse the unit.
        Type = "oneshot";
        RemainAfterExit = true;
        # The unit's status line (`systemctl status`): fdl-prepare sends
        # `STATUS=<step>: <what>` at each step through $NOTIFY_SOCKET, which
        # systemd sets only where NotifyAccess= lets something send. main:
        # fdl-prepare itself, never the builds or the binary it starts.
        NotifyAccess = "main";
        ExecStart = "${lib.getExe' cfg.package "fdl-prepare"} --config ${configFile}";
        ExecStartPost = mkIf (cfg.gatedUnits != [ ]) [
          "${systemctl} start --no-block -- ${lib.concatStringsSep " " cfg.gatedUnits}"
        ];

        # 75 (transient) and anything unexpected retry; 78 (permanent), 2
        # (usage) and 70 (a bug) stop the loop and leave the unit failed for a
        # person.
        Restart = "on-failure";
        RestartSec = mkDefault "10s";
        RestartPreventExitStatus = "${toString exitUsage} ${toString exitSoftware} ${toString exitPermanent}";

        # The start job has no timeout for a oneshot: a cold build may take
        # long, and fdl-prepare bounds stuck listings and builds itself.

        # root: FUSE mounts, the nix daemon's trusted user, and User= makes
        # systemd set HOME (the dataset cache lives under $HOME/.flodl).
        User = "root";
        # /var/lib/fdl-prepare, passed as $STATE_DIRECTORY: GC roots for the
        # built libtorch and training binary live here, so a garbage
        # collection never deletes what a run is using.
        StateDirectory = "fdl-prepare";
        StateDirectoryMode = "0750";

        # Sandboxing, as in systemd/fdl-prepare.service (docs/HARDENING.md,
        # "Hardened units"): nothing that gives the unit a mount namespace
        # (the sshfs mount must reach the host) and no device ACL
        # (/dev/nvidia*, /dev/kfd, /dev/dri, /dev/fuse stay reachable).
        NoNewPrivileges = true;
        ProtectHostname = true;
        RestrictRealtime = true;
        RestrictSUIDSGID = true;
        LockPersonality = true;
        SystemCallArchitectures = "native";
        RestrictAddressFamilies = [
          "AF_UNIX"
          "AF_INET"
          "AF_INET6"
          "AF_NETLINK"
        ];
        SystemCallFilter = [ "~@clock @cpu-emulation @debug @obsolete @raw-io @reboot @swap" ];
        # Kept: SYS_ADMIN (mounts, Nix's sandbox), SETUID/SETGID, KILL and
        # CHOWN (Nix's build users), SYS_CHROOT and NET_ADMIN (Nix's
        # sandbox), SYS_MODULE and MKNOD (nvidia-modprobe).
        CapabilityBoundingSet = [ "~${lib.concatStringsSep " " droppedCapabilities}" ];
      }
      # Exponential backoff arrived in systemd 254; older releases would log
      # "Unknown key" and keep the fixed RestartSec.
      // lib.optionalAttrs (systemdAtLeast "254") {
        RestartSteps = mkDefault 8;
        RestartMaxDelaySec = mkDefault "10min";
      };
    };

    systemd.services.fdl-prepare-start = mkIf cfg.backgroundOnSwitch {
      description = "Start fdl-prepare.service: at boot waiting for it, during nixos-rebuild switch after the switch";
      wantedBy = [ "multi-user.target" ];
      # What re-prepares the box: a change to any of these changes this unit,
      # which the switch restarts (at once: it only starts or schedules).
      restartTriggers = [
        prepare.serviceConfig.ExecStart
        (builtins.toJSON prepare.environment)
        (builtins.toJSON (prepare.serviceConfig.ExecStartPost or [ ]))
      ];
      restartIfChanged = true;
      stopIfChanged = false;
      serviceConfig = {
        # Active once the first attempt has ended (at boot) or a restart is
        # scheduled (in a switch), whatever preparation's result.
        Type = "oneshot";
        RemainAfterExit = true;
        ExecStart = "${pkgs.runtimeShell} ${startScript} ${switchLock}";
      };
    };
  };
}
