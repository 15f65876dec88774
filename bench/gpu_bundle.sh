#!/usr/bin/env bash
# Build .gpu_triton/, the Triton bundle that bench/serve.sh carries to the lent GPU machine
# (no network there, no Triton; Ubuntu, glibc 2.39, python 3.12):
#
#   tritonserver.tar.xz          pytriton/tritonserver/{bin/tritonserver, backends/python/
#                                {libtriton_python.so, triton_python_backend_utils.py, the cp312
#                                triton_python_backend_stub}}, the nvidia_pytriton.libs those
#                                need (stripped), and libpython/libpython3.12.so.1.0 (a fallback,
#                                used only when the machine has none)
#   numpy-1.26.4-cp312.tar.xz    numpy < 2 for the stub (with numpy >= 2 it returns EMPTY tensors)
#   perf_analyzer-2.60.0-*.whl   perf_analyzer (glibc >= 2.38)
#
#   bash bench/gpu_bundle.sh [DEST]      (DEST defaults to ./.gpu_triton; ~2 min on 2 cores)
#
# Sources: the nvidia-pytriton 0.7.0 wheel installed in the venv (VENV, default .venv), PyPI
# through pip for numpy and perf-analyzer, and a libpython3.12.so.1.0 from LIBPYTHON312 or the
# first python3.12 found (pyenv or PATH). The bundle must stay well under the device's 64 MiB
# carry limit (with the work tree): the script prints its size.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DEST="$(mkdir -p "${1:-$ROOT/.gpu_triton}" && cd "${1:-$ROOT/.gpu_triton}" && pwd)"
VENV="${VENV:-$ROOT/.venv}"
PY="$VENV/bin/python"
NUMPY_VERSION=1.26.4
PA_VERSION=2.60.0
W="$(mktemp -d)"
trap 'rm -rf "$W"' EXIT
log() { echo "[gpu_bundle] $*"; }

SITE="$("$PY" -c 'import pytriton, pathlib; print(pathlib.Path(pytriton.__file__).parent.parent)')"
TS="$SITE/pytriton/tritonserver"
LIBS="$SITE/nvidia_pytriton.libs"
[ -x "$TS/bin/tritonserver" ] || { echo "no tritonserver in $TS (pip install nvidia-pytriton==0.7.0)" >&2; exit 1; }

# ---- tritonserver + Python backend + cp312 stub + the bundled libraries they load -----------
S="$W/stage"
mkdir -p "$S/pytriton/tritonserver/bin" "$S/pytriton/tritonserver/backends/python" "$S/nvidia_pytriton.libs" "$S/libpython"
cp "$TS/bin/tritonserver" "$S/pytriton/tritonserver/bin/"
cp "$TS/backends/python/libtriton_python.so" "$TS/backends/python/triton_python_backend_utils.py" \
   "$TS/python_backend_stubs/3.12/triton_python_backend_stub" "$S/pytriton/tritonserver/backends/python/"
# the closure of NEEDED entries that the wheel's libs directory provides (hashed names)
todo=("$S/pytriton/tritonserver/bin/tritonserver" "$S/pytriton/tritonserver/backends/python/libtriton_python.so"
      "$S/pytriton/tritonserver/backends/python/triton_python_backend_stub")
declare -A seen=()
while [ ${#todo[@]} -gt 0 ]; do
  f="${todo[0]}"; todo=("${todo[@]:1}")
  for n in $(readelf -d "$f" | awk '/NEEDED/{gsub(/[][]/, "", $5); print $5}'); do
    if [ -e "$LIBS/$n" ] && [ -z "${seen[$n]:-}" ]; then
      seen[$n]=1
      cp "$LIBS/$n" "$S/nvidia_pytriton.libs/"
      todo+=("$S/nvidia_pytriton.libs/$n")
    fi
  done
done
log "${#seen[@]} libraries from nvidia_pytriton.libs"

LIBPY="${LIBPYTHON312:-}"
if [ -z "$LIBPY" ]; then
  for py in "$HOME"/.pyenv/versions/3.12*/bin/python3.12 "$(command -v python3.12 || true)"; do
    [ -x "$py" ] || continue
    d="$("$py" -c 'import sysconfig; print(sysconfig.get_config_var("LIBDIR"))')"
    [ -e "$d/libpython3.12.so.1.0" ] && { LIBPY="$d/libpython3.12.so.1.0"; break; }
  done
fi
if [ -n "$LIBPY" ]; then
  cp -L "$LIBPY" "$S/libpython/libpython3.12.so.1.0"
else
  log "WARNING: no libpython3.12.so.1.0 found (set LIBPYTHON312): the bundle relies on the machine's"
fi
# strip the binaries (the wheel's are not); the stub and libs keep their dynamic symbols
find "$S" -type f \( -name '*.so*' -o -name tritonserver -o -name triton_python_backend_stub \) -exec strip --strip-unneeded {} +
log "staged $(du -sh "$S" | cut -f1); compressing"
tar -C "$S" -cf - . | xz -T2 -9 > "$DEST/tritonserver.tar.xz"

# ---- numpy < 2 for the stub, unpacked into a site directory ----------------------------------
mkdir -p "$W/dl" "$W/np"
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$W/dl" "numpy==$NUMPY_VERSION"
"$PY" -m zipfile -e "$W"/dl/numpy-*.whl "$W/np"
rm -rf "$W/np"/numpy/*/tests "$W/np"/numpy/tests
tar -C "$W/np" -cf - . | xz -T2 -9 > "$DEST/numpy-$NUMPY_VERSION-cp312.tar.xz"

# ---- perf_analyzer -------------------------------------------------------------------------
rm -f "$DEST"/perf_analyzer-*.whl
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --platform manylinux_2_38_x86_64 --platform manylinux_2_39_x86_64 -d "$DEST" "perf-analyzer==$PA_VERSION"

ls -la "$DEST"
log "bundle: $(du -sh "$DEST" | cut -f1) in $DEST"
