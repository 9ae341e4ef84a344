#!/usr/bin/env bash
# What a user who does not clone gets: `python -m build` makes the sdist and the wheel (from
# the sdist, as pip would), the wheel alone goes into a new venv, and everything below runs
# from outside the checkout with a fresh data folder and a fresh kernel cache: --version,
# --help, a bundled model installed by `kvchat models install`, `kvchat plan`, the C++
# kernels compiled from the installed sources, `kvchat ask` answering over the sample
# document inside the package, and the app started by Textual's pilot.
#
#   tests/package/check.sh [PYTHON [KERNELS]]
#
# PYTHON has `build` (make test passes .venv's). KERNELS keeps the kernels this check builds
# for the test suite, which loads them from there (the same sources name the same build
# wherever they are installed); it may hold other levels' builds, never this machine's own:
# both of kvchat's kernels must report their build here, from the wheel's sources.
set -euo pipefail
checkout=$(cd "$(dirname "$0")/../.." && pwd)
python=${1:-python3}
work=$(mktemp -d "${TMPDIR:-/tmp}/kvchat-package-XXXXXX")
trap 'rm -rf "$work"' EXIT
kernels=${2:-$work/kernels}
kernels=$(mkdir -p "$kernels" && cd "$kernels" && pwd)
step() { printf '\n== package check: %s\n' "$*"; }

step "python -m build"
"$python" -m build --outdir "$work/dist" "$checkout" >"$work/build.log" 2>&1 ||
    { cat "$work/build.log"; exit 1; }
ls "$work/dist"
"$python" "$checkout/tests/package/wheel_files.py" "$checkout" "$work"/dist/kvchat-*.whl

step "a new venv with torch 2.13.0 and the wheel alone"
python3 -m venv "$work/venv"
venv="$work/venv/bin"
# --no-compile: Python compiles what it imports on first use; compiling all of torch ahead
# takes longer than the rest of the install.
"$venv/pip" install --quiet --no-compile torch==2.13.0
"$venv/pip" install --quiet --no-compile "$work"/dist/kvchat-*.whl

cd "$work"  # nothing of the checkout is on the path from here on
export KVCHAT_HOME="$work/home" TORCH_EXTENSIONS_DIR="$kernels"
unset KVCHAT_MODEL PYTHONPATH
step "kvchat --version, --help"
"$venv/kvchat" --version
"$venv/kvchat" --help >/dev/null
step "kvchat models install smollm2-135m"
"$venv/kvchat" models install smollm2-135m
step "kvchat plan --model smollm2-135m (the C++ kernels build first, from the installed sources)"
"$venv/kvchat" plan --model smollm2-135m 2>"$work/plan.err" || { cat "$work/plan.err" >&2; exit 1; }
cat "$work/plan.err" >&2
built=$(grep -c "^kvchat: built the C++ kernels" "$work/plan.err" || true)
if [ "$built" != 2 ]; then
    echo "check.sh: $built of the 2 kernels built from the wheel; $kernels held them before?" >&2
    exit 1
fi
sample=$("$venv/python" -c \
    "from importlib import resources; print(resources.files('kvchat.core') / 'data/sample.txt')")
step "kvchat ask over $sample"
"$venv/kvchat" ask --model smollm2-135m --set generation.max_new_tokens=24 \
    --prompt-file "$sample" "When was the lighthouse built?"
ls "$TORCH_EXTENSIONS_DIR"
step "the app, driven by Textual's pilot"
"$venv/python" "$checkout/tests/package/app_smoke.py" smollm2-135m
step "passed"
