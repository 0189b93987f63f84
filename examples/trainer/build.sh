# Stands in for `cargo build --release` when this tree is built with the
# nixpkgs-free test flake: it needs only /bin/sh and coreutils, and it checks
# the libtorch wiring the way torch-sys would (LIBTORCH/lib, the headers).
set -eu

variant=${FDL_LIBTORCH_VARIANT:-}
if [ -n "${LIBTORCH:-}" ]; then
    [ -d "$LIBTORCH/lib" ] || { echo "build.sh: LIBTORCH=$LIBTORCH has no lib/" >&2; exit 1; }
    [ -d "$LIBTORCH_INCLUDE/include" ] || { echo "build.sh: LIBTORCH_INCLUDE=$LIBTORCH_INCLUDE has no include/" >&2; exit 1; }
fi

cat > train <<SCRIPT
#!/bin/sh
echo "example trainer: built against libtorch '${variant:-none}' at ${LIBTORCH:-nowhere}"
echo "example trainer: args: \$*"
echo "example trainer: cwd: \$(pwd)"
SCRIPT
chmod +x train
