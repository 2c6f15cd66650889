"""``python -m omlx_cache COMMAND ...``: fit, eval, bench, generate, models,
loadbench."""

import importlib
import sys

COMMANDS = {
    "fit": "omlx_cache.fit",
    "eval": "omlx_cache.eval",
    "bench": "omlx_cache.bench",
    "generate": "omlx_cache.generate",
    "models": "omlx_cache.models",
    "loadbench": "omlx_cache.loadbench",
}


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in COMMANDS:
        sys.exit(f"usage: python -m omlx_cache {{{','.join(COMMANDS)}}} ...")
    return importlib.import_module(COMMANDS[argv[0]]).main(argv[1:])


if __name__ == "__main__":
    main()
