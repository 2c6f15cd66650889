#!/usr/bin/env bash
# Download the pinned mlx-lm sdist from PyPI, check its sha256 and unpack it into DEST as a git
# repository whose first commit (tag `upstream`) is the pristine source.
#   scripts/series/vendor.sh [DEST] [VERSION]
# With VERSION other than the pin, no hash is known: the file is taken as PyPI serves it.
set -euo pipefail
cd "$(dirname "$0")/../.."
. vendor/mlx-lm.pin
dest=${1:-vendor/mlx-lm}
want=${2:-$version}
cache=vendor/.cache
mkdir -p "$cache"
sdist="$cache/mlx_lm-$want.tar.gz"
if [ ! -f "$sdist" ]; then
    echo "vendor: downloading mlx-lm==$want from PyPI" >&2
    python3 -m pip download -q --no-deps --no-binary :all: \
        -d "$cache" "mlx-lm==$want" >&2 || { echo "vendor: could not download mlx-lm==$want" >&2; exit 1; }
    [ -f "$sdist" ] || { echo "vendor: download did not produce $sdist" >&2; exit 1; }
fi
if [ "$want" = "$version" ]; then
    got=$(sha256sum "$sdist" | cut -d' ' -f1)
    if [ "$got" != "$sha256" ]; then
        echo "vendor: sha256 mismatch for $sdist" >&2
        echo "  expected $sha256 (vendor/mlx-lm.pin)" >&2
        echo "  got      $got" >&2
        rm -f "$sdist"
        exit 1
    fi
fi
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
tar --no-same-owner -xzf "$sdist" -C "$tmp"
src="$tmp/mlx_lm-$want"
[ -d "$src/mlx_lm" ] && [ -d "$src/tests" ] || { echo "vendor: $sdist lacks mlx_lm/ or tests/" >&2; exit 1; }
rm -rf "$dest"
mkdir -p "$(dirname "$dest")"
mv "$src" "$dest"
# the sdist's generated egg-info would shadow the editable install's metadata
rm -rf "$dest"/mlx_lm.egg-info
git -C "$dest" init -q -b main
# what installing the tree generates is not part of any patch
printf '*.egg-info/\n__pycache__/\nbuild/\n' >> "$dest/.git/info/exclude"
git -C "$dest" config user.name "omlx-cache vendor"
git -C "$dest" config user.email "vendor@omlx-cache.invalid"
git -C "$dest" add -A
git -C "$dest" commit -q -m "mlx-lm $want (pristine sdist)"
git -C "$dest" tag upstream
echo "vendor: $dest is mlx-lm $want, tagged upstream" >&2
