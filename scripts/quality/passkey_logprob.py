"""Passkey trials of stored ``omlx_cache.eval`` runs, paired with the reference's.

    python scripts/quality/passkey_logprob.py docs/data/passkey48-bf16-smollm2-chunk512.json

For each file, scheme and context: the keys found, keys lost and gained against
the file's first scheme (McNemar p), and the mean paired difference of the key's
log-probability with its standard error (``eval.paired_outcomes``). Runs stored
before the eval added that difference get it here from their trials.
Runs that kept whether each greedy answer holds the key (``found``) add those
counts, paired the same way, and so do trials that predict the key's digit
tokens (``digits``: retrieval, whatever the tokens around the key); for runs
stored before trials kept that, ``--model DIR`` scores it with the model's
tokenizer from the predicted tokens.
``--against OTHER`` pairs each scheme with the same scheme in another run on
the same prompts (same seed), e.g. two code paths::

    python scripts/quality/passkey_logprob.py --against docs/data/cq4-rule-gemma3-seed0.json \\
        docs/data/gemma3-8k-global-layers-seed0.json
"""

import argparse
import json
from pathlib import Path

from omlx_cache.eval import digits_retrieved, mcnemar, paired_outcomes


def counted(runs, theirs, outcome):
    """(count, ``mcnemar`` against ``theirs``) of ``outcome``, or None where a
    trial lacks it."""
    if not all(outcome in t for t in runs + theirs):
        return None
    return sum(t[outcome] for t in runs), mcnemar(theirs, runs, outcome)


def score_digits(report: dict, tokenizer):
    for result in report["results"]:
        for trials in result.get("passkey", {}).values():
            for t in trials["runs"]:
                t.setdefault("digits", digits_retrieved(tokenizer, t))


def rows(report: dict, against: dict | None = None):
    """(scheme, context, found, trials, paired outcomes, in answer, digits) for
    each scheme after the first (the reference) and each context of its
    passkey trials; with ``against``, for each scheme also there, paired with
    it there. ``in answer`` and ``digits`` are the trials whose greedy answer
    holds the key, or that predict its digit tokens, with their ``mcnemar``
    counts, or None for runs stored before the eval kept them."""
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
            in_answer = counted(runs, theirs, "found")
            digits = counted(runs, theirs, "digits")
            yield result["kv"], context, found, len(runs), vs, in_answer, digits


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("files", nargs="+", help="omlx_cache.eval JSON files")
    parser.add_argument(
        "--against", metavar="FILE", help="pair each scheme with its run in FILE"
    )
    parser.add_argument(
        "--model", metavar="DIR", help="score digits with this model's tokenizer"
    )
    args = parser.parse_args()
    tokenizer = None
    if args.model:
        from mlx_lm.tokenizer_utils import load as load_tokenizer

        tokenizer = load_tokenizer(Path(args.model))
    reports = {}
    for path in [args.against, *args.files]:
        if path:
            with open(path) as f:
                reports[path] = json.load(f)
            if tokenizer is not None:
                score_digits(reports[path], tokenizer)
    against = reports.get(args.against)
    for path in args.files:
        report = reports[path]
        vs_what = f", against {args.against}" if against else ""
        print(f"\n{path} (passkey step {report.get('passkey_chunk')}{vs_what})")
        print(
            "| KV | context | found | lost / gained | p | Δ log-prob (± se) "
            "| in answer (lost / gained, p) | digits (lost / gained, p) |"
        )
        print("|---|---|---|---|---|---|---|---|")
        for kv, context, found, trials, vs, *counts in rows(report, against):
            delta = vs.get("logprob_delta")
            shift = (
                "" if delta is None else f"{delta:+.3f} ± {vs['logprob_delta_se']:.3f}"
            )
            cells = []
            for count in counts:
                cell = ""
                if count is not None:
                    n, a = count
                    cell = f"{n}/{trials} ({a['lost']} / {a['gained']}, {a['p']:.3f})"
                cells.append(cell)
            print(
                f"| {kv} | {context} | {found}/{trials} | {vs['lost']} / {vs['gained']} "
                f"| {vs['p']:.3f} | {shift} | {' | '.join(cells)} |"
            )


if __name__ == "__main__":
    main()
