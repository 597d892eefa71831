#!/usr/bin/env bash
# Installs the pinned CUDA 13.0 compiler set and CUTLASS 4.2.0 headers from PyPI into the
# project-local, git-ignored folder .toolchain/, plus libclang (for bindgen) from apt if missing.
# Idempotent: a second run with the same pins does nothing. build.rs never downloads anything;
# this script is the one place that does.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
dest="$root/.toolchain"
pins=(
  nvidia-cuda-nvcc==13.0.88
  nvidia-cuda-crt==13.0.88
  nvidia-nvvm==13.0.88
  nvidia-cuda-runtime==13.0.96
  nvidia-cuda-cccl==13.0.85
  nvidia-cutlass==4.2.0.0
)
stamp="$dest/.installed-$(printf '%s\n' "${pins[@]}" | sha256sum | cut -c1-16)"

log() { printf 'bootstrap: %s\n' "$*" >&2; }

install_wheels() {
  if [[ -f "$stamp" ]]; then
    log "CUDA 13.0 + CUTLASS 4.2 already in $dest"
    return
  fi
  local python
  python="$(command -v python3 || command -v python)" || { log "python3 is required"; exit 1; }
  # NOTE: pip --target into an existing folder silently skips the shared nvidia/ namespace
  # package, so always install into a fresh folder and move it into place.
  local staging="$dest.partial"
  rm -rf "$staging"
  log "installing ${pins[*]} into $dest"
  "$python" -m pip install --quiet --disable-pip-version-check --no-deps --target "$staging" "${pins[@]}"
  rm -rf "$dest"
  mv "$staging" "$dest"
  touch "$stamp"
}

have_libclang() {
  [[ -n "${LIBCLANG_PATH:-}" ]] && return 0
  # NOTE: libclang-cpp.so is a different library; bindgen needs libclang.so(.N) itself.
  ldconfig -p 2>/dev/null | grep -qE 'libclang(-[0-9.]+)?\.so' && return 0
  compgen -G '/usr/lib/llvm-*/lib/libclang.so*' >/dev/null
}

install_libclang() {
  if have_libclang; then return; fi
  log "libclang not found (bindgen needs it); installing libclang1-14 with apt"
  local sudo=""
  [[ "$(id -u)" -ne 0 ]] && sudo="sudo"
  $sudo apt-get update -qq >/dev/null
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq libclang1-14 >/dev/null
}

install_wheels
install_libclang
nvcc="$dest/nvidia/cu13/bin/nvcc"
[[ -x "$nvcc" ]] || { log "expected $nvcc after install"; exit 1; }
log "ready: $("$nvcc" --version | tail -n 2 | head -n 1)"
