"""Passkey trials of stored ``omlx_cache.eval`` runs, paired with the reference's.

    python scripts/quality/passkey_logprob.py docs/data/passkey48-bf16-smollm2-chunk512.json

For each file, scheme and context: the keys found, keys lost and gained against
the file's first scheme (McNemar p), and the mean paired difference of the key's
log-probability with its standard error (``eval.paired_outcomes``). Runs stored
before the eval added that difference get it here from their trials.
"""

import argparse
import json

from omlx_cache.eval import paired_outcomes


def rows(report: dict):
    """(scheme, context, found, trials, paired outcomes) for each scheme after
    the first (the reference) and each context of its passkey trials."""
    reference, *schemes = report["results"]
    for result in schemes:
        for context, trials in result.get("passkey", {}).items():
            runs = trials["runs"]
            vs = paired_outcomes(reference["passkey"][context]["runs"], runs)
            found = sum(t["correct"] for t in runs)
            yield result["kv"], context, found, len(runs), vs


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("files", nargs="+", help="omlx_cache.eval JSON files")
    args = parser.parse_args()
    for path in args.files:
        with open(path) as f:
            report = json.load(f)
        print(f"\n{path} (passkey step {report.get('passkey_chunk')})")
        print("| KV | context | found | lost / gained | p | Δ log-prob (± se) |")
        print("|---|---|---|---|---|---|")
        for kv, context, found, trials, vs in rows(report):
            delta = vs.get("logprob_delta")
            shift = (
                "" if delta is None else f"{delta:+.3f} ± {vs['logprob_delta_se']:.3f}"
            )
            print(
                f"| {kv} | {context} | {found}/{trials} | {vs['lost']} / {vs['gained']} "
                f"| {vs['p']:.3f} | {shift} |"
            )


if __name__ == "__main__":
    main()
