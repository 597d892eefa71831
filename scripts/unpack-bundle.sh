#!/usr/bin/env bash
# Unpacks BUNDLE/bundle.tar.xz (made by scripts/gpu-bundle.sh) into BUNDLE/run, with xz if the
# machine has it, else with Python's lzma (the GPU machine's image has python3).
#   bash scripts/unpack-bundle.sh [BUNDLE]     (default gpu-bundle)
set -euo pipefail
bundle="${1:-gpu-bundle}"
archive="$bundle/bundle.tar.xz"
[[ -f $archive ]] || { echo "no bundle at $archive (run scripts/gpu-bundle.sh)" >&2; exit 2; }
mkdir -p "$bundle/run"
# Several scripts of one device call unpack the same bundle (~280 MB, seconds each): once is
# enough while the archive is the one unpacked last.
stamp="$(stat -c '%s %Y' "$archive")"
[[ "$(cat "$bundle/run/.unpacked-from" 2>/dev/null)" == "$stamp" ]] && exit 0
if command -v xz >/dev/null; then
  tar -C "$bundle/run" -xJf "$archive"
else
  python3 -c 'import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2])' "$archive" "$bundle/run"
fi
echo "$stamp" > "$bundle/run/.unpacked-from"
