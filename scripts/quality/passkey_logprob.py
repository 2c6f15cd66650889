"""Passkey trials of stored ``omlx_cache.eval`` runs, paired with the reference's.

    python scripts/quality/passkey_logprob.py docs/data/passkey48-bf16-smollm2-chunk512.json

For each file, scheme and context: the keys found, keys lost and gained against
the file's first scheme (McNemar p), and the mean paired difference of the key's
log-probability with its standard error (``eval.paired_outcomes``). Runs stored
before the eval added that difference get it here from their trials.
Runs that kept whether each greedy answer holds the key (``found``) add those
counts, paired the same way.
``--against OTHER`` pairs each scheme with the same scheme in another run on
the same prompts (same seed), e.g. two code paths::

    python scripts/quality/passkey_logprob.py --against docs/data/cq4-rule-gemma3-seed0.json \\
        docs/data/gemma3-8k-global-layers-seed0.json
"""

import argparse
import json

from omlx_cache.eval import mcnemar, paired_outcomes


def rows(report: dict, against: dict | None = None):
    """(scheme, context, found, trials, paired outcomes, in answer) for each
    scheme after the first (the reference) and each context of its passkey
    trials; with ``against``, for each scheme also there, paired with it
    there. ``in answer`` is the trials whose greedy answer holds the key and
    their ``mcnemar`` counts, or None for runs stored before the eval kept
    that."""
    first, *schemes = report["results"]
    if against is not None:
        schemes = report["results"]
        others = {r["kv"]: r for r in against["results"]}
    for result in schemes:
        reference = first if against is None else others.get(result["kv"])
        if reference is None:
            continue
        for context, trials in result.get("passkey", {}).items():
            runs = trials["runs"]
            theirs = reference["passkey"][context]["runs"]
            if [t["key"] for t in theirs] != [t["key"] for t in runs]:
                raise SystemExit(f"{result['kv']} at {context}: not the same prompts")
            vs = paired_outcomes(theirs, runs)
            found = sum(t["correct"] for t in runs)
            in_answer = None
            if all("found" in t for t in runs + theirs):
                in_answer = (
                    sum(t["found"] for t in runs),
                    mcnemar(theirs, runs, "found"),
                )
            yield result["kv"], context, found, len(runs), vs, in_answer


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("files", nargs="+", help="omlx_cache.eval JSON files")
    parser.add_argument(
        "--against", metavar="FILE", help="pair each scheme with its run in FILE"
    )
    args = parser.parse_args()
    against = None
    if args.against:
        with open(args.against) as f:
            against = json.load(f)
    for path in args.files:
        with open(path) as f:
            report = json.load(f)
        vs_what = f", against {args.against}" if against else ""
        print(f"\n{path} (passkey step {report.get('passkey_chunk')}{vs_what})")
        print(
            "| KV | context | found | lost / gained | p | Δ log-prob (± se) "
            "| in answer (lost / gained, p) |"
        )
        print("|---|---|---|---|---|---|---|")
        for kv, context, found, trials, vs, in_answer in rows(report, against):
            delta = vs.get("logprob_delta")
            shift = (
                "" if delta is None else f"{delta:+.3f} ± {vs['logprob_delta_se']:.3f}"
            )
            answered = ""
            if in_answer is not None:
                n, a = in_answer
                answered = f"{n}/{trials} ({a['lost']} / {a['gained']}, {a['p']:.3f})"
            print(
                f"| {kv} | {context} | {found}/{trials} | {vs['lost']} / {vs['gained']} "
                f"| {vs['p']:.3f} | {shift} | {answered} |"
            )


if __name__ == "__main__":
    main()
