# The `settings.join` options of nix/module.nix, built from nix/fields.json:
# the field table of prepare/config/fields.py, exported by
# `python -m prepare.config.fields_json > nix/fields.json` (tests/test_module.py
# fails when the committed file is stale). Every type here is the table's, so
# the module cannot accept a key or a value type fdl-prepare does not take,
# nor refuse one it does: no option type is written twice.
#
# The options are strict: a key the table does not have is an evaluation
# error naming the option (`The option ... does not exist`), as is a value of
# another type. The CLI's own checks (URL pins, paths, ranges it cannot say
# in a type) still run at the unit's first start.
{
  lib,
  # Per key ("ssh.identity_file"): { description, example } for the NixOS
  # manual, where the CLI's help text would speak of flags.
  docs ? { },
  # Per sub-table ("ssh"): the description of its option.
  tables ? { },
  # The keys the table leaves untyped, which the module declares itself.
  own ? [ ],
  file ? ./fields.json,
}:
let
  inherit (lib) types mkOption;

  exported = builtins.fromJSON (builtins.readFile file);

  # A type tree (prepare/config/fields_json.py): a name is a path into lib.types,
  # a list applies its first element to the rest, numbers as they are.
  typeOf =
    tree:
    if builtins.isString tree then
      lib.attrByPath (lib.splitString "." tree) (throw "nix/fields.json: `${tree}' is not in lib.types") types
    else
      lib.foldl (
        f: arg: f (if builtins.isInt arg || builtins.isFloat arg then arg else typeOf arg)
      ) (typeOf (builtins.head tree)) (builtins.tail tree);

  nullable = f: builtins.isList f.type && builtins.head f.type == "nullOr";

  option =
    f:
    let
      doc = docs.${f.key} or { };
      example = doc.example or f.example;
    in
    mkOption (
      {
        type = typeOf f.type;
        # Unset (null) leaves the key out of the file, so fdl-prepare's own
        # default applies: the module never restates one.
        default = if nullable f then null else f.default;
        description = doc.description or f.description;
      }
      // lib.optionalAttrs (example != null) { inherit example; }
    );

  typed = builtins.filter (f: f.type != null) exported.fields;
  untyped = map (f: f.key) (builtins.filter (f: f.type == null) exported.fields);
  keys = map (f: f.key) exported.fields;

  optionsOf =
    table:
    builtins.listToAttrs (
      map (f: lib.nameValuePair f.name (option f)) (builtins.filter (f: f.table == table) typed)
    );

  join =
    optionsOf ""
    // lib.genAttrs exported.tables (
      table:
      mkOption {
        type = types.submodule { options = optionsOf table; };
        default = { };
        description = tables.${table} or "The `[join.${table}]` table.";
      }
    );

  # Said at evaluation, so a table and a module that disagree cannot ship.
  problems =
    map (
      k:
      "the field table leaves join.${k} untyped, and nix/module.nix neither declares it nor says why not: give the Field a `nix` type in prepare/config/fields.py and regenerate nix/fields.json"
    ) (lib.subtractLists own untyped)
    ++ map (
      k: "nix/module.nix declares join.${k} itself, but the field table types it: drop the module's own option"
    ) (lib.subtractLists untyped own)
    ++ map (
      k: "nix/module.nix documents join.${k}, which the field table does not have: drop or rename its docs"
    ) (lib.subtractLists keys (builtins.attrNames docs))
    ++ map (
      t: "nix/module.nix describes a [join.${t}] table the field table does not have"
    ) (lib.subtractLists exported.tables (builtins.attrNames tables));
in
{
  options =
    if problems == [ ] then
      join
    else
      throw "services.fdl-prepare: nix/fields.json and nix/module.nix disagree:\n- ${lib.concatStringsSep "\n- " problems}";
  inherit typeOf;
  fields = exported.fields;
}
