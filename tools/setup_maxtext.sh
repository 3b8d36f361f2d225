#!/usr/bin/env bash
# Set up Google's MaxText (snapshot e591f30) on CPU for tools/maxtext_side_by_side.py.
# Idempotent: each step is skipped when its result already exists.
# Usage: bash tools/setup_maxtext.sh BARE_GIT_DIR
#   BARE_GIT_DIR: a bare clone of AI-Hypercomputer/maxtext holding commit e591f30; cloned there
#   from GitHub first when the directory does not exist.
# Writes the source tree to $MAXTEXT_SRC (default ~/maxtext-src) and a Python 3.12 venv with
# MaxText's decoupled (no Google Cloud) requirements to $MAXTEXT_VENV (default ~/maxtext-venv);
# its last line is `export MAXTEXT_SRC=... MAXTEXT_VENV=...`, so
#   eval "$(bash tools/setup_maxtext.sh maxtext.git | tail -n 1)"
# leaves both set for tools/maxtext_side_by_side.py.
set -euo pipefail
GIT_DIR_IN=${1:?usage: bash tools/setup_maxtext.sh BARE_GIT_DIR (a bare git clone of AI-Hypercomputer/maxtext holding e591f30)}
REV=e591f30
SRC=${MAXTEXT_SRC:-$HOME/maxtext-src}
VENV=${MAXTEXT_VENV:-$HOME/maxtext-venv}
REQ=src/dependencies/requirements/generated_requirements/decoupled-requirements.txt

# 1. Source tree. `git archive` alone fails on 7 blobs absent from the snapshot (tokenizers and golden
#    logits that training on synthetic data does not need), so those paths are excluded.
if [ ! -f "$SRC/pyproject.toml" ]; then
  [ -e "$GIT_DIR_IN" ] || git clone --bare https://github.com/AI-Hypercomputer/maxtext "$GIT_DIR_IN"
  git --git-dir="$GIT_DIR_IN" cat-file -e "$REV^{commit}" || { echo "no commit $REV in $GIT_DIR_IN" >&2; exit 1; }
  excl=()
  while read -r _ type obj path; do
    if [ "$type" = blob ] && ! git --git-dir="$GIT_DIR_IN" cat-file -e "$obj" 2>/dev/null; then excl+=(":(exclude)$path"); fi
  done < <(git --git-dir="$GIT_DIR_IN" ls-tree -r "$REV")
  echo "exporting $REV to $SRC (skipping ${#excl[@]} missing blobs)" >&2
  tmp=$(mktemp -d "${SRC%/*}/.maxtext-src.XXXX")
  git --git-dir="$GIT_DIR_IN" archive "$REV" -- . "${excl[@]}" 2>/dev/null | tar -x -C "$tmp"
  [ -f "$tmp/pyproject.toml" ] || { echo "export failed" >&2; rm -rf "$tmp"; exit 1; }
  rm -rf "$SRC"; mv "$tmp" "$SRC"
fi

# 2. Python >= 3.12: python3.12 on PATH if it runs, else the newest pyenv 3.12.x.
if python3.12 -c '' 2>/dev/null; then PY=$(command -v python3.12)
else PY=$(ls -d "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.12.*/bin/python3.12 2>/dev/null | sort -V | tail -n 1); fi
[ -x "${PY:-}" ] || { echo "no python3.12 found" >&2; exit 1; }

# 3. Venv with the decoupled (no Google Cloud) requirements at their lowest pins, then MaxText editable.
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
[ -x "$VENV/bin/uv" ] || "$VENV/bin/pip" install -q uv
cd "$SRC"
if [ ! -f "$VENV/.maxtext-deps-done" ]; then
  "$VENV/bin/uv" pip install --python "$VENV/bin/python" --resolution=lowest -r "$REQ"
  touch "$VENV/.maxtext-deps-done"
fi
if ! "$VENV/bin/uv" pip show --python "$VENV/bin/python" maxtext >/dev/null 2>&1; then
  "$VENV/bin/uv" pip install --python "$VENV/bin/python" --no-deps -e .
fi

echo "export MAXTEXT_SRC=$SRC MAXTEXT_VENV=$VENV"
