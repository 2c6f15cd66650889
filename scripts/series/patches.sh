#!/usr/bin/env bash
# The patch-series workflow over vendor/mlx-lm (a git repository: tag `upstream` = pristine sdist,
# then one commit per patch).
#   scripts/series/patches.sh apply          pristine + every patch in patches/series, one commit each
#   scripts/series/patches.sh unapply        back to pristine
#   scripts/series/patches.sh refresh        rewrite patches/ and patches/series from the commits
#   scripts/series/patches.sh check VERSION  try the series on another mlx-lm release
set -euo pipefail
cd "$(dirname "$0")/../.."
tree=vendor/mlx-lm
series=patches/series

patch_names() {
    [ -f "$series" ] || return 0
    sed -e 's/#.*//' -e 's/[[:space:]]*$//' "$series" | grep -v '^$' || true
}

ensure_vendor() {
    if ! git -C "$tree" rev-parse -q --verify upstream >/dev/null 2>&1; then
        scripts/series/vendor.sh "$tree"
    fi
}

reset_pristine() {
    git -C "$1" reset -q --hard upstream
    git -C "$1" clean -q -fdx -e '*.egg-info' -e '__pycache__'
}

# apply_series DIR: am each patch; on failure reset DIR to pristine, name the patch, return 1.
apply_series() {
    local dir=$1 name
    for name in $(patch_names); do
        [ -f "patches/$name" ] || { echo "patches: patches/$name is listed in $series but missing" >&2; reset_pristine "$dir"; return 1; }
        if ! git -C "$dir" am -q --keep-cr --committer-date-is-author-date "$PWD/patches/$name" >/dev/null 2>&1; then
            git -C "$dir" am --abort >/dev/null 2>&1 || true
            reset_pristine "$dir"
            echo "patches: $name does not apply; $dir left pristine" >&2
            return 1
        fi
        echo "patches: applied $name" >&2
    done
}

cmd_apply() {
    ensure_vendor
    reset_pristine "$tree"
    apply_series "$tree"
    echo "patches: $tree = upstream + $(patch_names | wc -l | tr -d ' ') patch(es)" >&2
}

cmd_unapply() {
    ensure_vendor
    reset_pristine "$tree"
    echo "patches: $tree is pristine" >&2
}

cmd_refresh() {
    ensure_vendor
    [ -z "$(git -C "$tree" status --porcelain --untracked-files=no)" ] ||
        { echo "patches: $tree has uncommitted changes; commit them first (one commit per patch)" >&2; exit 1; }
    local out
    out=$(mktemp -d)
    git -C "$tree" format-patch -q --no-signature --zero-commit -N -o "$out" upstream
    rm -f patches/*.patch
    : > "$series"
    for f in "$out"/*.patch; do
        [ -e "$f" ] || continue
        cp "$f" patches/
        basename "$f" >> "$series"
    done
    rm -rf "$out"
    echo "patches: wrote $(patch_names | wc -l | tr -d ' ') patch(es) to patches/" >&2
}

cmd_check() {
    local version=${1:?usage: scripts/series/patches.sh check VERSION}
    local dir=vendor/check/mlx-lm-$version name ok=0 bad=0
    scripts/series/vendor.sh "$dir" "$version"
    for name in $(patch_names); do
        if git -C "$dir" am -q --keep-cr "$PWD/patches/$name" >/dev/null 2>&1; then
            printf '  applies   %s\n' "$name"; ok=$((ok + 1))
        else
            git -C "$dir" am --abort >/dev/null 2>&1 || true
            printf '  FAILS     %s\n' "$name"; bad=$((bad + 1))
            # later patches may depend on this one: try them on top of what applied so far
        fi
    done
    echo "mlx-lm $version: $ok patch(es) apply cleanly, $bad do not"
}

case "${1:-}" in
    apply) cmd_apply ;;
    unapply) cmd_unapply ;;
    refresh) cmd_refresh ;;
    check) shift; cmd_check "$@" ;;
    *) echo "usage: scripts/series/patches.sh apply|unapply|refresh|check VERSION" >&2; exit 2 ;;
esac
