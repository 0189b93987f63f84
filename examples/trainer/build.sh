# Stands in for `cargo build --release` when this tree is built with the
# nixpkgs-free test flake: it needs only /bin/sh and coreutils, and it checks
# the libtorch wiring the way torch-sys would (LIBTORCH/lib, the headers).
set -eu

variant=${FDL_LIBTORCH_VARIANT:-}
if [ -n "${LIBTORCH:-}" ]; then
    [ -d "$LIBTORCH/lib" ] || { echo "build.sh: LIBTORCH=$LIBTORCH has no lib/" >&2; exit 1; }
    [ -d "$LIBTORCH_INCLUDE/include" ] || { echo "build.sh: LIBTORCH_INCLUDE=$LIBTORCH_INCLUDE has no include/" >&2; exit 1; }
fi

# `train --smoke` loads what the binary links and stops: libtorch from the
# store, and for a CUDA build the driver's libcuda.so.1 from the driver
# directory, the one place a Nix-built program looks for it (nixpkgs'
# addDriverRunpath). A missing one is reported as the loader reports it, so
# fdl-prepare's smoke run reads it as a real binary's.
cat > train <<SCRIPT
#!/bin/sh
if [ "\${1:-}" = --smoke ]; then
    missing() {
        echo "\$0: error while loading shared libraries: \$1: cannot open shared object file: No such file or directory" >&2
        exit 127
    }
    if [ -n "${LIBTORCH:-}" ]; then
        [ -r "${LIBTORCH:-}/lib/libtorch.so" ] || missing libtorch.so
    fi
    case "${variant}" in
    cu*) [ -e /run/opengl-driver/lib/libcuda.so.1 ] || missing libcuda.so.1 ;;
    esac
    echo "example trainer: smoke: libtorch '${variant:-none}' and what it links load"
    exit 0
fi
echo "example trainer: built against libtorch '${variant:-none}' at ${LIBTORCH:-nowhere}"
echo "example trainer: args: \$*"
echo "example trainer: cwd: \$(pwd)"
SCRIPT
chmod +x train
