#!/usr/bin/env bash
# Prints the path of a Python 3.12 interpreter, or explains what is missing and exits 1.
# The default python3 on these machines is often another minor version, so look in the usual places.
set -u
candidates=()
[ -n "${PYTHON:-}" ] && candidates+=("$PYTHON")
candidates+=(python3.12)
for d in "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.12*/bin /usr/local/bin /usr/bin /opt/python/3.12*/bin; do
  [ -x "$d/python3.12" ] && candidates+=("$d/python3.12")
done
command -v uv >/dev/null 2>&1 && p=$(uv python find 3.12 2>/dev/null) && candidates+=("$p")
candidates+=(python3)
for c in "${candidates[@]}"; do
  exe=$(command -v "$c" 2>/dev/null) || continue
  if "$exe" -c 'import sys, venv; sys.exit(0 if sys.version_info[:2] == (3, 12) else 1)' 2>/dev/null; then
    echo "$exe"; exit 0
  fi
done
echo "error: k3jax needs Python 3.12 (the version the GPU machines run) and none was found." >&2
echo "Looked for: \$PYTHON, python3.12 on PATH, pyenv versions, /usr/bin, /usr/local/bin, 'uv python find 3.12'." >&2
echo "Install it (e.g. 'apt-get install python3.12 python3.12-venv', 'pyenv install 3.12', or 'uv python install 3.12') or set PYTHON=/path/to/python3.12." >&2
exit 1
