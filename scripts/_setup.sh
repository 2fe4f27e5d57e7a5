# Sourced by scripts/demo and scripts/test: make .venv ready, then return.
# Creates the virtual environment if missing and installs freplicate with its
# dev extras and the pinned CPU build of torch (pip takes it from local disk;
# an unpinned torch would pull a multi-GB CUDA build). Re-installs only when
# pyproject.toml changed since the last install.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
venv="$root/.venv"
TORCH_PIN="torch==2.13.0"
if [ ! -x "$venv/bin/python" ]; then
  echo "freplicate: creating the virtual environment in .venv" >&2
  python3 -m venv "$venv"
fi
stamp="$venv/.freplicate-installed"
want="$(cat pyproject.toml scripts/_setup.sh | sha256sum | cut -d' ' -f1)"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  echo "freplicate: installing $TORCH_PIN and freplicate[dev] into .venv" >&2
  "$venv/bin/python" -m pip install --quiet --disable-pip-version-check "$TORCH_PIN" -e ".[dev]"
  echo "$want" > "$stamp"
fi
export PATH="$venv/bin:$PATH"
export PYTHONUNBUFFERED=1
