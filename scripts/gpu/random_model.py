"""A model directory at a bench preset's shape: random weights, a real tokenizer.

For serving benchmarks on the GPU machine (no hub, no real weights there):
``mlx_lm.server --model DIR`` loads it as any converted model. The vocabulary
is the tokenizer's, so the embedding differs from the preset's; the blocks
(attention, KV heads, head dim, MLP) are the preset's.

    python3 scripts/gpu/random_model.py --preset llama3-8b \\
        --tokenizer models/SmolLM2-135M-Instruct --out /tmp/llama3-8b-random
"""

import argparse
import json
import shutil
from pathlib import Path

import mlx.core as mx
from mlx_lm.utils import save_config, save_model

from omlx_cache import bench
from omlx_cache.bench.models import LLAMA_DEFAULTS

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="llama3-8b", choices=sorted(bench.PRESETS))
    parser.add_argument("--tokenizer", required=True, help="a model directory")
    parser.add_argument("--out", required=True)
    opts = parser.parse_args(argv)
    source, out = Path(opts.tokenizer), Path(opts.out)
    vocab = len(json.loads((source / "tokenizer.json").read_text())["model"]["vocab"])
    added = json.loads((source / "tokenizer.json").read_text()).get("added_tokens", [])
    vocab = max([vocab - 1, *(t["id"] for t in added)]) + 1
    preset = bench.PRESETS[opts.preset]
    preset = {**preset, "config": {**preset["config"], "vocab_size": vocab}}
    dtype = preset.get("dtype", "float16")
    model = bench.build_model(preset, getattr(mx, dtype))
    save_model(out, model)
    config = {**LLAMA_DEFAULTS, **preset["config"], "torch_dtype": dtype}
    if preset["weights"] is not None:
        group_size, bits = preset["weights"]
        config["quantization"] = {"group_size": group_size, "bits": bits}
    save_config(config, out / "config.json")
    for name in TOKENIZER_FILES:
        if (source / name).exists():
            shutil.copy(source / name, out / name)
    print(f"{out}: {opts.preset} blocks, vocabulary {vocab}, random weights")


if __name__ == "__main__":
    main()
