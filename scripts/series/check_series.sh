#!/usr/bin/env bash
# Bisectability: apply each prefix of patches/series to a fresh pristine copy and run upstream's
# suite against it (the prefix's own mlx_lm, put first on PYTHONPATH), with the deselect list.
#   scripts/series/check_series.sh [K]     only the prefix of K patches
set -uo pipefail
cd "$(dirname "$0")/../.."
root=$PWD
mapfile -t names < <(sed -e 's/#.*//' -e 's/[[:space:]]*$//' patches/series | grep -v '^$')
deselect=()
while read -r item; do deselect+=(--deselect "$item"); done \
    < <(sed -e 's/#.*//' -e 's/[[:space:]]*$//' tests/upstream-deselect.txt | grep -v '^$')
export HF_HUB_OFFLINE=1 HF_HUB_CACHE="$root/models/hub" TOKENIZERS_PARALLELISM=false
status=0
for k in $(seq "${1:-1}" "${1:-${#names[@]}}"); do
    dir=vendor/check/series-$k
    scripts/series/vendor.sh "$dir" >/dev/null 2>&1 || { echo "check-series: could not vendor $dir"; exit 1; }
    for name in "${names[@]:0:$k}"; do
        git -C "$dir" am -q --keep-cr "$root/patches/$name" || { echo "prefix $k: $name does not apply"; status=1; continue 2; }
    done
    summary=$(cd "$dir" && PYTHONPATH="$root/$dir" "$root/.venv/bin/python" -m pytest -q -p no:cacheprovider \
        --rootdir . tests "${deselect[@]}" 2>&1 | tail -n 1)
    echo "prefix $k (${names[$((k - 1))]}): $summary"
    case "$summary" in *failed*|*error*) status=1 ;; esac
    rm -rf "$dir"
done
exit $status
