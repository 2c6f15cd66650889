#!/usr/bin/env bash
# The patch-series workflow over vendor/mlx-lm (a git repository: tag `upstream` = pristine sdist,
# then one commit per patch).
#   scripts/series/patches.sh apply          pristine + every patch in patches/series, one commit each
#   scripts/series/patches.sh unapply        back to pristine
#   scripts/series/patches.sh refresh        rewrite patches/ and patches/series from the commits
#   scripts/series/patches.sh check VERSION  try the series on another mlx-lm release
#   scripts/series/patches.sh pr N [CLONE]   patch N as a pull request (build/pr/NNNN/, branch pr/NNNN)
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
    # the gate for moving the pin: every patch must apply
    [ "$bad" -eq 0 ]
}

# cmd_pr N [CLONE]: patch N as a pull request. Patches build on the earlier ones, so what is sent
# is patches 1..N stacked on pristine upstream:
#   build/pr/NNNN/series.mbox   patches 1..N, for `git am` on upstream's tree at the pinned release
#   build/pr/NNNN/NNNN-*.patch  patch N alone
#   build/pr/NNNN/title.txt, body.md   the PR text: patch N's commit message, with what it builds on
#   branch pr/NNNN in vendor/mlx-lm    upstream + patches 1..N (the checkout there is not touched)
# With CLONE (a clone of ml-explore/mlx-lm), the branch pr/NNNN is made there too, from tag
# v<version> (or $BASE), ready to push.
cmd_pr() {
    local n=${1:-} clone=${2:-}
    local -a names
    mapfile -t names < <(patch_names)
    if ! [[ $n =~ ^[0-9]+$ ]] || ((10#$n < 1 || 10#$n > ${#names[@]})); then
        echo "patches: usage: make pr N (N = 1..${#names[@]}, the patch's number in $series), got '$n'" >&2
        exit 2
    fi
    n=$((10#$n))
    ensure_vendor
    . vendor/mlx-lm.pin
    local id out branch name scratch alone subject
    id=$(printf '%04d' "$n")
    out=build/pr/$id
    branch=pr/$id
    name=${names[n - 1]}
    rm -rf "$out"
    mkdir -p "$out"
    for p in "${names[@]:0:n}"; do cat "patches/$p"; done > "$out/series.mbox"
    cp "patches/$name" "$out/"
    scratch=$(mktemp -d)
    git -C "$tree" worktree add -q --detach "$scratch/tree" upstream
    if ! git -C "$scratch/tree" am -q --keep-cr --committer-date-is-author-date "$PWD/$out/series.mbox" >/dev/null 2>&1; then
        git -C "$tree" worktree remove --force "$scratch/tree"; rm -rf "$scratch"
        echo "patches: patches 1..$n do not apply to upstream mlx-lm $version (make apply names the patch)" >&2
        exit 1
    fi
    git -C "$tree" branch -f "$branch" "$(git -C "$scratch/tree" rev-parse HEAD)"
    subject=$(git -C "$scratch/tree" log -1 --format=%s)
    # does patch N apply alone to pristine upstream? (text only: its tests may still need the others)
    git -C "$scratch/tree" reset -q --hard upstream
    if git -C "$scratch/tree" am -q --keep-cr "$PWD/patches/$name" >/dev/null 2>&1; then alone=yes; else
        git -C "$scratch/tree" am --abort >/dev/null 2>&1 || true; alone=no; fi
    git -C "$tree" worktree remove --force "$scratch/tree"
    rm -rf "$scratch"
    printf '%s\n' "$subject" > "$out/title.txt"
    {
        if ((n > 1)); then
            echo "**Builds on** the earlier patches of this series, which go first (one PR each):"
            echo
            local k
            for ((k = 1; k < n; k++)); do
                printf -- '- %04d %s\n' "$k" "$(git -C "$tree" log -1 --format=%s "$branch~$((n - k))")"
            done
            echo
            echo "Until they are merged this branch carries them as its first $((n - 1)) commit(s):"
            echo "review the last commit. It applies alone to mlx-lm $version: $alone."
            echo
        fi
        git -C "$tree" log -1 --format=%b "$branch"
    } > "$out/body.md"
    echo "patches: PR for $name (upstream mlx-lm $version + patches 1..$n)"
    echo "  $out/series.mbox       git am this onto mlx-lm v$version"
    echo "  $out/title.txt, body.md  the PR's title and text"
    echo "  branch $branch in $tree"
    if [ -n "$clone" ]; then
        local base=${BASE:-v$version}
        git -C "$clone" checkout -q -B "$branch" "$base" ||
            { echo "patches: could not make $branch from $base in $clone" >&2; exit 1; }
        if ! git -C "$clone" am -q --keep-cr "$PWD/$out/series.mbox"; then
            git -C "$clone" am --abort >/dev/null 2>&1 || true
            echo "patches: patches 1..$n do not apply to $base in $clone" >&2
            exit 1
        fi
        echo "  branch $branch in $clone (from $base): git -C $clone push <your fork> $branch"
    fi
}

case "${1:-}" in
    apply) cmd_apply ;;
    unapply) cmd_unapply ;;
    refresh) cmd_refresh ;;
    check) shift; cmd_check "$@" ;;
    pr) shift; cmd_pr "$@" ;;
    *) echo "usage: scripts/series/patches.sh apply|unapply|refresh|check VERSION|pr N [CLONE]" >&2; exit 2 ;;
esac
