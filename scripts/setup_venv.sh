#!/usr/bin/env bash
# Create .venv/ for this repo, idempotently.  Called by `make setup` (which owns .venv/.stamp).
#
# * If the system python already has a CUDA build of torch (the lent GPU machines, where
#   nothing can be downloaded), the venv is created with --system-site-packages and torch
#   is NOT installed; other requirements are installed only when not already satisfied,
#   from ./.whl/ (wheels carried to the machine) if present.  Any that still cannot be
#   installed are reported as warnings, not errors.
# * Otherwise: a plain venv and `pip install -r requirements.txt` (CPU torch comes from
#   the local wheel directory that pip is configured with on the CPU machines).
#
# The repo root is put on the venv's sys.path with a .pth file, so `import backend_lib`
# works from anywhere, including Triton's Python-backend stub started with this venv.
#
# Environment: PYTHON (default python3), VENV (default .venv),
#              REQ_FILES (default "requirements.txt", space separated).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
ROOT=$(pwd)
PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv}
REQ_FILES=${REQ_FILES:-requirements.txt}

log() { echo "[setup_venv] $*" >&2; }

if "$PYTHON" -c 'import sys, torch; sys.exit(0 if torch.version.cuda else 1)' >/dev/null 2>&1; then
    MODE=system-cuda
    SYS_SITE=true
else
    MODE=pip
    SYS_SITE=false
fi
log "mode: $MODE (system python: $("$PYTHON" -c 'import sys; print(sys.executable, sys.version.split()[0])'))"

# Recreate the venv only if it is broken or was made in the other mode.
if [[ -x "$VENV/bin/python" ]] && "$VENV/bin/python" -c 'import sys' >/dev/null 2>&1; then
    have=$(sed -n 's/^include-system-site-packages *= *//p' "$VENV/pyvenv.cfg" 2>/dev/null || true)
    if [[ "$have" != "$SYS_SITE" ]]; then
        log "$VENV has include-system-site-packages=$have, want $SYS_SITE: recreating"
        rm -rf "$VENV"
    fi
elif [[ -e "$VENV" ]]; then
    log "$VENV is not a working venv: recreating"
    rm -rf "$VENV"
fi
if [[ ! -e "$VENV" ]]; then
    if [[ $MODE == system-cuda ]]; then
        "$PYTHON" -m venv --system-site-packages "$VENV"
    else
        "$PYTHON" -m venv "$VENV"
    fi
fi
VPY="$VENV/bin/python"

if [[ $MODE == system-cuda ]]; then
    # The "system" python may itself be a venv (the H200 image: /opt/torch/.venv).  A venv
    # made from it with --system-site-packages sees the *base* interpreter's packages, not
    # the outer venv's torch, so list the outer site-packages in a .pth file (appended to
    # sys.path after our own site-packages, so what we install here still wins).
    outer=$("$PYTHON" -c 'import os, site, sys
if sys.prefix != sys.base_prefix:
    print("\n".join(p for p in site.getsitepackages() if os.path.isdir(p)))')
    vsite=$("$VPY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    if [[ -n "$outer" ]]; then
        printf '%s\n' "$outer" > "$vsite/_system_site.pth"
        log "system python is a venv: added its site-packages via $vsite/_system_site.pth"
    else
        rm -f "$vsite/_system_site.pth"
    fi
    "$VPY" -c 'import torch' || { log "ERROR: torch from the system python is not importable in $VENV"; exit 1; }
fi

pip_args=(--disable-pip-version-check)
[[ -d .whl ]] && pip_args+=(--find-links "$ROOT/.whl")

if [[ $MODE == pip ]]; then
    for f in $REQ_FILES; do
        log "pip install -r $f"
        "$VPY" -m pip install "${pip_args[@]}" -r "$f"
    done
else
    # Requirement lines not yet satisfied, torch excluded (the system CUDA build is used).
    missing=$("$VPY" - $REQ_FILES <<'PY'
import re, sys
from importlib import metadata
try:
    from packaging.requirements import Requirement
except ImportError:
    from pip._vendor.packaging.requirements import Requirement
for path in sys.argv[1:]:
    for line in open(path):
        line = line.split("#", 1)[0].strip()
        if not line or line.startswith("-"):
            continue
        req = Requirement(line)
        if req.name.lower() in ("torch", "pytorch-triton", "triton"):
            continue
        if req.marker is not None and not req.marker.evaluate():
            continue
        try:
            ok = req.specifier.contains(metadata.version(req.name), prereleases=True)
        except metadata.PackageNotFoundError:
            ok = False
        if not ok:
            print(line)
PY
)
    if [[ -n "$missing" ]]; then
        while IFS= read -r req; do
            log "installing $req"
            if ! "$VPY" -m pip install "${pip_args[@]}" "$req"; then
                log "WARNING: could not install '$req'; using what the system python has"
            fi
        done <<<"$missing"
    fi
fi

# Repo root on sys.path (backend_lib, bench, client importable; Triton stub included).
site=$("$VPY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
echo "$ROOT" > "$site/_llm_repo_root.pth"

"$VPY" - <<'PY'
import importlib
for name in ("torch", "numpy", "transformers", "tokenizers", "safetensors", "pytest"):
    try:
        m = importlib.import_module(name)
        extra = f" cuda={m.version.cuda}" if name == "torch" else ""
        print(f"[setup_venv]   {name} {getattr(m, '__version__', '?')}{extra}")
    except Exception as e:  # report, do not fail: the stamp logic below decides
        print(f"[setup_venv]   {name} MISSING ({e.__class__.__name__})")
PY

# What was done, for people; the Makefile owns .venv/.stamp (written after every step).
{ echo "mode=$MODE"; echo "python=$("$VPY" -c 'import sys; print(sys.version.split()[0])')";
  echo "requirements_sha256=$(cat $REQ_FILES | sha256sum | cut -c1-16)"; } > "$VENV/.setup_info"
log "done: $VENV ($MODE)"
