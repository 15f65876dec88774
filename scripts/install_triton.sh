#!/usr/bin/env bash
# Install the Triton pieces into the project's venv: tritonserver (bundled in the
# nvidia-pytriton wheel) + its Python-backend stub, tritonclient, and perf_analyzer.
#
#   scripts/install_triton.sh            (VENV=.venv by default; `make setup` calls it)
#
# perf_analyzer ships in the PyPI wheel `perf-analyzer`, built for glibc >= 2.38. On an older
# system (Debian 12 has 2.36) the binary runs under the loader and libc/libstdc++ of Debian
# trixie, unpacked (dpkg -x) into build/glibc-trixie/ from this machine's own Debian mirror
# with a private apt configuration; the system is not touched. Either way build/bin/perf_analyzer
# is the command to use.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${VENV:-$ROOT/.venv}"
PY="$VENV/bin/python"
BUILD="$ROOT/build"
PA_VERSION="${PA_VERSION:-2.60.0}"
mkdir -p "$BUILD/bin"
cd "$ROOT"

warn() { echo "[install_triton] WARNING: $*" >&2; }

echo "== Triton server, Python backend and clients"
# Offline machines (the lent GPU host) may carry the wheels in ./.whl; a failed install is a
# warning when the pieces are already importable.
PIP_EXTRA=()
[ -d "$ROOT/.whl" ] && PIP_EXTRA=(--find-links "$ROOT/.whl")
if ! "$PY" -m pip install -q "${PIP_EXTRA[@]}" -r "$ROOT/requirements-triton.txt"; then
  "$PY" -c "import pytriton, tritonclient" 2>/dev/null \
    && warn "pip install -r requirements-triton.txt failed; using what is installed" \
    || { echo "cannot install the Triton pieces (requirements-triton.txt)" >&2; exit 1; }
fi
"$PY" -c "import numpy, sys; sys.exit(0 if int(numpy.__version__.split('.')[0]) < 2 else 1)" || {
  echo "numpy >= 2 in the venv: the Python-backend stub would return EMPTY tensors; pinning numpy<2"
  "$PY" -m pip install -q "numpy<2"
}
"$PY" -m triton_glue.launch check

echo "== perf_analyzer $PA_VERSION"
glibc_ok() { "$PY" - <<'PY'
import os, sys
v = os.confstr("CS_GNU_LIBC_VERSION").split()[-1]
sys.exit(0 if tuple(map(int, v.split(".")[:2])) >= (2, 38) else 1)
PY
}
PA_DIR="$BUILD/perf_analyzer"
if [ ! -x "$PA_DIR/perf_analyzer/bin/perf_analyzer" ]; then
  tmp="$(mktemp -d)"
  if ! "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
      --platform manylinux_2_38_x86_64 --platform manylinux_2_39_x86_64 "${PIP_EXTRA[@]}" \
      -d "$tmp" "perf-analyzer==$PA_VERSION"; then
    warn "perf-analyzer==$PA_VERSION could not be fetched: make perf and the perf test will skip"
    exit 0
  fi
  rm -rf "$PA_DIR" && mkdir -p "$PA_DIR"
  "$PY" -m zipfile -e "$tmp"/perf_analyzer-*.whl "$PA_DIR"
  chmod +x "$PA_DIR/perf_analyzer/bin/perf_analyzer"
  rm -rf "$tmp"
fi
PA_BIN="$PA_DIR/perf_analyzer/bin/perf_analyzer"

if glibc_ok; then
  cat > "$BUILD/bin/perf_analyzer" <<SH
#!/usr/bin/env bash
exec "$PA_BIN" "\$@"
SH
else
  GL="$BUILD/glibc-trixie"
  fetch_glibc() {
    echo "   glibc < 2.38 here: fetching Debian trixie's libc6/libstdc++6 into $GL"
    # this machine's Debian mirror (deb822 or one-line format), trixie suite
    local uri
    uri="$(awk '/^URIs:/{print $2; exit}' /etc/apt/sources.list.d/*.sources 2>/dev/null || true)"
    [ -n "$uri" ] || uri="$(awk '$1=="deb"{for(i=2;i<=NF;i++) if($i ~ /^[a-z]+:\/\//){print $i; exit}}' /etc/apt/sources.list 2>/dev/null || true)"
    [ -n "$uri" ] || { warn "no Debian mirror configured in /etc/apt"; return 1; }
    local A="$BUILD/apt-trixie"
    rm -rf "$A/debs"; mkdir -p "$A/lists/partial" "$A/cache/archives/partial" "$A/debs"
    echo "deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] $uri trixie main" > "$A/sources.list"
    local APT=(-o Dir::Etc::SourceList="$A/sources.list" -o Dir::Etc::SourceParts=/dev/null
               -o Dir::State::Lists="$A/lists" -o Dir::Cache="$A/cache" -o Debug::NoLocking=1
               -o APT::Architecture=amd64 -o APT::Architectures=amd64)
    apt-get "${APT[@]}" -qq update || return 1
    (cd "$A/debs" && apt-get "${APT[@]}" -qq download libc6 libstdc++6 libgcc-s1 2>&1 | grep -v unsandboxed) || true
    ls "$A"/debs/libc6_*.deb "$A"/debs/libstdc++6_*.deb >/dev/null 2>&1 || return 1
    rm -rf "$GL" && mkdir -p "$GL"
    for d in "$A"/debs/*.deb; do dpkg -x "$d" "$GL" || return 1; done
  }
  if [ ! -e "$GL/lib/x86_64-linux-gnu/ld-linux-x86-64.so.2" ] && [ ! -e "$GL/usr/lib/x86_64-linux-gnu/ld-linux-x86-64.so.2" ]; then
    fetch_glibc || { warn "could not fetch Debian trixie's libc6: make perf and the perf test will skip"; rm -f "$BUILD/bin/perf_analyzer"; exit 0; }
  fi
  LD="$GL/usr/lib/x86_64-linux-gnu/ld-linux-x86-64.so.2"
  [ -e "$LD" ] || LD="$GL/lib/x86_64-linux-gnu/ld-linux-x86-64.so.2"
  LIBS="$GL/usr/lib/x86_64-linux-gnu:$GL/lib/x86_64-linux-gnu:/lib/x86_64-linux-gnu:/usr/lib/x86_64-linux-gnu"
  cat > "$BUILD/bin/perf_analyzer" <<SH
#!/usr/bin/env bash
# perf_analyzer (glibc >= 2.38) under Debian trixie's loader; see scripts/install_triton.sh
exec "$LD" --library-path "$LIBS" "$PA_BIN" "\$@"
SH
fi
chmod +x "$BUILD/bin/perf_analyzer"
"$BUILD/bin/perf_analyzer" --version 2>/dev/null | head -1 || "$BUILD/bin/perf_analyzer" --help 2>&1 | head -2
echo "perf_analyzer: $BUILD/bin/perf_analyzer"
