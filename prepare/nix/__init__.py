"""Nix, as fdl-prepare calls it: the one wrapper around the `nix` command
(`runner`), its internal-json log read as it arrives (`log`), why a call
failed and whether retrying could help (`diagnosis`), the flake and source
URLs checked before any call (`urls`), and the box's binary caches
(`caches`)."""
