#!/usr/bin/env bash
# Create .venv (if missing) and install everything from requirements.txt, the MLX build for this
# platform, the patched vendor/mlx-lm and our package, both editable.
#   MLX_BACKEND=cpu|cuda13|cuda12|metal   (default: cpu on Linux, metal on macOS)
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${VENV:-.venv}
py=${PYTHON:-python3}
[ -x "$venv/bin/python" ] || "$py" -m venv "$venv"
pip=("$venv/bin/python" -m pip -q --disable-pip-version-check)
mlx_version=$(sed -n 's/^mlx==//p' requirements.txt)
backend=${MLX_BACKEND:-}
if [ -z "$backend" ]; then
    if [ "$(uname -s)" = Darwin ]; then backend=metal; else backend=cpu; fi
fi
case "$backend" in
    metal) mlx_req="mlx==$mlx_version" ;;
    cpu | cuda12 | cuda13) mlx_req="mlx[$backend]==$mlx_version" ;;
    *) echo "env: MLX_BACKEND must be cpu, cuda12, cuda13 or metal (got '$backend')" >&2; exit 2 ;;
esac
# The mlx-cpu wheel bundles the reference BLAS (a 511-token SmolLM2 forward: 60-80 s); Debian's
# OpenBLAS, preloaded by the Makefile's eval/bench/serve targets, does it in 4 s. Best effort.
if [ "$backend" = cpu ] && [ ! -e /usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 ] \
    && command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
    (apt-get install -y -q libopenblas0-pthread >/dev/null 2>&1 ||
        { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q libopenblas0-pthread >/dev/null 2>&1; }) ||
        echo "env: could not install libopenblas0-pthread (optional: faster CPU runs)" >&2
fi
stamp="$venv/.omlx-installed"
want="$(cat requirements.txt pyproject.toml vendor/mlx-lm.pin) $mlx_req"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
    echo "env: installing into $venv ($mlx_req and requirements.txt)" >&2
    "${pip[@]}" install --upgrade pip
    grep -v '^mlx==' requirements.txt > "$venv/requirements.txt"
    "${pip[@]}" install "$mlx_req" -r "$venv/requirements.txt"
    printf '%s' "$want" > "$stamp.tmp"
fi
# mlx-lm takes its version from setuptools-scm; our vendor git has no version tags
SETUPTOOLS_SCM_PRETEND_VERSION_FOR_MLX_LM=$(sed -n 's/^version=//p' vendor/mlx-lm.pin) \
    "${pip[@]}" install --no-deps -e vendor/mlx-lm
"${pip[@]}" install --no-deps -e .
[ -f "$stamp.tmp" ] && mv "$stamp.tmp" "$stamp"
"$venv/bin/python" -c "import mlx.core as mx, mlx_lm, omlx_cache; print('env: mlx', mx.__version__, mx.default_device(), '| mlx_lm', mlx_lm.__version__)"
