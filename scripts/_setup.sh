# Sourced by scripts/demo and scripts/test: make .venv ready, then return.
# Creates the virtual environment if missing and installs freplicate with its
# dev extras and the pinned CPU build of torch (pip takes it from local disk;
# an unpinned torch would pull a multi-GB CUDA build), and transformers (the
# llama extra: examples/llama_train.py) with --no-deps, its import's own
# requirements named one by one, so that it can never bring another torch.
# Re-installs only when pyproject.toml or this file changed since the last install.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
venv="$root/.venv"
TORCH_PIN="torch==2.13.0"
# transformers' Requires-Dist (5.25.0's METADATA) less kernels (Hugging Face hub kernels) and typer
# (its CLI), which `import transformers` and LlamaForCausalLM do without; none of these needs torch
TRANSFORMERS_PIN="transformers==5.25.0"
TRANSFORMERS_NEEDS=("huggingface-hub>=2.4.0,<3.0" "tokenizers>=0.23.1,<0.24.0" "safetensors>=0.8.0"
  "regex>=2025.10.22" "pyyaml>=5.1" "packaging>=20.0" "numpy>=1.17" "tqdm>=4.60")
if [ ! -x "$venv/bin/python" ]; then
  echo "freplicate: creating the virtual environment in .venv" >&2
  python3 -m venv "$venv"
fi
stamp="$venv/.freplicate-installed"
want="$(cat pyproject.toml scripts/_setup.sh | sha256sum | cut -d' ' -f1)"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  echo "freplicate: installing $TORCH_PIN, freplicate[dev] and $TRANSFORMERS_PIN into .venv" >&2
  "$venv/bin/python" -m pip install --quiet --disable-pip-version-check "$TORCH_PIN" -e ".[dev]" \
    "${TRANSFORMERS_NEEDS[@]}"
  "$venv/bin/python" -m pip install --quiet --disable-pip-version-check --no-deps "$TRANSFORMERS_PIN"
  echo "$want" > "$stamp"
fi
export PATH="$venv/bin:$PATH"
export PYTHONUNBUFFERED=1
