"""The quantized KV cache with the model sharded over ranks (tensor parallelism).

mlx-lm shards a model's attention heads with ``model.shard(group)`` (loaded
with ``mlx_lm.utils.sharded_load``, launched with ``mlx.launch``): each rank
computes its share of the query and KV heads, and the output projection sums
the ranks' parts. A rank's KV caches see only its KV heads: each rank stores
``n_kv_heads / ranks`` heads of every layer, in its own pages, and nothing is
gathered. The caches take their head count from the keys they are given, so
every cache of the series works unchanged.

This module runs generation that way and compares it with one process:

    python -m omlx_cache.tensor_parallel model --out /tmp/tp-llama
    python -m omlx_cache.tensor_parallel run --model /tmp/tp-llama --out /tmp/one
    mlx.launch --backend ring -n 2 --python .venv/bin/python -- \\
        -m omlx_cache.tensor_parallel run --model /tmp/tp-llama --out /tmp/two
    python -m omlx_cache.tensor_parallel compare /tmp/one /tmp/two

(``scripts/distributed/tensor_parallel_check.py`` does all four), and computes the KV bytes
each rank holds from the cache layout:

    python -m omlx_cache.tensor_parallel layout --ranks 1,2,4,8
"""

import argparse
import json
import math
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten

from . import models
from .kv import kernels
from .kv.codecs import Affine
from .kv.spec import KVSpec
from .kv.store import KVStore

# A llama whose heads split over 2 or 4 ranks (SmolLM2's 9 query / 3 KV heads
# split over none), tiny, float32, with SmolLM2's tokenizer.
TP_LLAMA_CONFIG = {
    "model_type": "llama",
    "hidden_size": 128,
    "num_hidden_layers": 4,
    "intermediate_size": 256,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 64,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": True,
    "torch_dtype": "float32",
}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
DEFAULT_TOKENIZER = models.REPO_ROOT / "models" / "SmolLM2-135M-Instruct-f32"
# the (tied) embeddings' std: logits of std ~6, most probability on a few
# tokens as a trained model puts it, so that greedy choices are rarely near-ties
EMBEDDING_STD = 0.5

PROMPT = (
    "The quantized cache stores keys and values in pages, and with tensor "
    "parallelism every rank keeps only the heads it computes. A long context "
    "is exactly when a model is spread over several machines."
)
MAX_TOKENS = 12
# a window shorter than the prompt, so that the rotating caches wrap
WINDOW = 24
DEFAULT_CASES = (
    "fp16",
    "8,4",
    "4",
    "bits=4 rotate=none first=0",
    "bits=8,4 center=k",
    f"fp16@w{WINDOW}",
    f"8,4@w{WINDOW}",
    "batch fp16",
    "batch 8,4",
    "batch bits=8,4 center=k",
    f"batch fp16@w{WINDOW}",
    f"batch 4@w{WINDOW}",
)

# Sharding changes only the order of float32 sums (each rank's share of the
# output projections, then the all-reduce): fp16 KV's log-probabilities move
# by float32 rounding, amplified through the layers.
FP_TOLERANCE = 1e-3
# A quantized cache quantizes keys and values that moved by that rounding: the
# same codes, except where a value sits on a rounding boundary and its code
# moves by one step. That is a small part of the scheme's own error against
# fp16 KV (every element off by up to half a step); the test bounds it at
# this fraction of that error.
QUANTIZED_FRACTION = 0.25

GIB = 1 << 30


def log(message: str):
    print(f"[omlx_cache.tensor_parallel] {message}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------
# The model


def write_model(out_dir, tokenizer_dir=DEFAULT_TOKENIZER, seed: int = 0) -> Path:
    """A random-weight llama (``TP_LLAMA_CONFIG``, float32) saved as a model
    directory with the tokenizer files of ``tokenizer_dir``."""
    from mlx_lm.models import llama
    from mlx_lm.utils import save_config, save_model

    out_dir, tokenizer_dir = Path(out_dir), Path(tokenizer_dir)
    tokenizer_config = json.loads((tokenizer_dir / "config.json").read_text())
    config = dict(
        TP_LLAMA_CONFIG,
        vocab_size=tokenizer_config["vocab_size"],
        eos_token_id=tokenizer_config.get("eos_token_id"),
    )
    model = llama.Model(llama.ModelArgs.from_dict(config))
    rng = np.random.default_rng(seed)
    params = []
    for name, value in sorted(tree_flatten(model.parameters())):
        if name.endswith("norm.weight"):
            new = np.ones(value.shape)
        elif name.endswith("embed_tokens.weight"):
            new = rng.normal(0.0, EMBEDDING_STD, size=value.shape)
        else:
            new = rng.normal(0.0, value.shape[-1] ** -0.5, size=value.shape)
        params.append((name, mx.array(new.astype(np.float32))))
    model.update(tree_unflatten(params))
    out_dir.mkdir(parents=True, exist_ok=True)
    save_model(out_dir, model)
    save_config(config, config_path=out_dir / "config.json")
    for name in TOKENIZER_FILES:
        shutil.copy(tokenizer_dir / name, out_dir / name)
    return out_dir


# ---------------------------------------------------------------------------
# Cases: a scheme, optionally bounded (@wN), one sequence or a batch


@dataclass(frozen=True)
class Case:
    name: str
    scheme: str
    window: int | None
    batch: bool

    @property
    def reference(self) -> str:
        """The fp16 case this one's quantization error is measured against."""
        name = "fp16" if self.window is None else f"fp16@w{self.window}"
        return f"batch {name}" if self.batch else name


def parse_case(name: str) -> Case:
    """``[batch ]SCHEME[@wN]``: e.g. ``8,4``, ``bits=4 first=0@w24``, ``batch 4``."""
    text = name.strip()
    batch = text.startswith("batch ")
    if batch:
        text = text[len("batch ") :].strip()
    scheme, _, window = text.partition("@w")
    KVSpec.parse(scheme)
    return Case(name, scheme, int(window) if window else None, batch)


def case_caches(case: Case, model) -> list:
    """One sequence's fresh caches for ``case``."""
    return KVSpec.parse(case.scheme).make_cache(model, case.window)


def kv_heads(cache) -> int | None:
    """The KV heads a layer's cache stores (axis 1 of its arrays)."""
    for _, x in tree_flatten(cache.state):
        if isinstance(x, mx.array) and x.ndim == 4:
            return x.shape[1]
    return None


def run_single(case: Case, model, prompt: list[int], max_tokens: int):
    """Greedy generation of one sequence (``generate_step``); its tokens,
    log-probabilities and caches."""
    from mlx_lm.generate import generate_step

    cache = case_caches(case, model)
    tokens, logprobs = [], []
    for token, lp in generate_step(
        mx.array(prompt), model, max_tokens=max_tokens, prompt_cache=cache
    ):
        tokens.append(token)
        logprobs.append(np.array(lp.astype(mx.float32)))
    return [tokens], [np.stack(logprobs)], cache


def run_batch(case: Case, model, prompts: list[list[int]], max_tokens: int):
    """Greedy generation of ``prompts`` batched as the server batches them
    (``BatchGenerator``: left padding, batch caches); tokens,
    log-probabilities and the first sequence's caches as the batch returns
    them when it finishes."""
    from mlx_lm.generate import BatchGenerator

    caches = [case_caches(case, model) for _ in prompts]
    gen = BatchGenerator(model, max_tokens=max_tokens, stop_tokens=[])
    uids = gen.insert(prompts, [max_tokens] * len(prompts), caches=caches)
    tokens = {uid: [] for uid in uids}
    logprobs = {uid: [] for uid in uids}
    finished = {}
    while responses := gen.next_generated():
        for r in responses:
            tokens[r.uid].append(r.token)
            logprobs[r.uid].append(np.array(r.logprobs.astype(mx.float32)))
            if r.finish_reason is not None:
                finished[r.uid] = r.prompt_cache
    gen.close()
    return (
        [tokens[u] for u in uids],
        [np.stack(logprobs[u]) for u in uids],
        finished[uids[0]],
    )


def prompts_for(tokenizer) -> list[list[int]]:
    """The prompt, and for batches a second, shorter one (left padding)."""
    ids = tokenizer.encode(PROMPT)
    return [ids, ids[: len(ids) // 2 + 3]]


def run(model_dir, cases, out_dir, max_tokens=MAX_TOKENS) -> dict:
    """Generate every case on this rank, the model sharded over the ranks of
    ``mx.distributed.init()`` when there are several; write ``rank{R}.npz``
    (log-probabilities) and ``rank{R}.json`` (tokens, caches, KV bytes)."""
    from mlx_lm.utils import load, sharded_load

    group = mx.distributed.init()
    rank, size = group.rank(), group.size()
    if size > 1:
        model, tokenizer = sharded_load(str(model_dir), tensor_group=group)
    else:
        model, tokenizer = load(str(model_dir))
    prompts = prompts_for(tokenizer)
    arrays = {}
    report = {"ranks": size, "rank": rank, "max_tokens": max_tokens, "cases": {}}
    for name in cases:
        case = parse_case(name)
        start = time.perf_counter()
        if case.batch:
            tokens, logprobs, cache = run_batch(case, model, prompts, max_tokens)
        else:
            tokens, logprobs, cache = run_single(case, model, prompts[0], max_tokens)
        seconds = time.perf_counter() - start
        for i, lp in enumerate(logprobs):
            arrays[f"{name}/{i}"] = lp
        report["cases"][name] = {
            "tokens": tokens,
            "prompt_tokens": [len(p) for p in prompts[: len(tokens)]],
            "cache": sorted({type(c).__name__ for c in cache}),
            "kv_heads": sorted({kv_heads(c) for c in cache}),
            "nbytes": sum(c.nbytes for c in cache),
            "seconds": round(seconds, 2),
        }
        log(f"rank {rank}/{size} {name}: {seconds:.1f} s")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    np.savez(out_dir / f"rank{rank}.npz", **arrays)
    (out_dir / f"rank{rank}.json").write_text(json.dumps(report, indent=1))
    return report


# ---------------------------------------------------------------------------
# Several ranks on this machine: MLX's ring backend (CPU) or NCCL (a GPU each) on 127.0.0.1


def free_ports(n: int) -> int:
    """The first of ``n`` consecutive free TCP ports on 127.0.0.1."""
    for _ in range(100):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            first = probe.getsockname()[1]
        if first + n > 65536:
            continue
        held = []
        try:
            for port in range(first, first + n):
                s = socket.socket()
                held.append(s)
                s.bind(("127.0.0.1", port))
            return first
        except OSError:
            continue
        finally:
            for s in held:
                s.close()
    raise RuntimeError(f"Found no {n} consecutive free ports on 127.0.0.1.")


# mlx.launch's entry point, for when its script is not on PATH (pip --target)
LAUNCH_MAIN = "from mlx._distributed_utils.launch import main; main()"


def launch_command(
    ranks: int, port: int, args: list[str], backend: str = "ring"
) -> list[str]:
    """``mlx.launch`` running ``python -m omlx_cache.tensor_parallel ARGS`` on
    ``ranks`` processes on 127.0.0.1: the ring backend over TCP ports from
    ``port``, or NCCL (one GPU per rank) with its rendezvous on ``port``."""
    launcher = Path(sys.executable).parent / "mlx.launch"
    if not launcher.exists():
        launcher = shutil.which("mlx.launch")
    command = [str(launcher)] if launcher else [sys.executable, "-c", LAUNCH_MAIN]
    port_flag = "--starting-port" if backend == "ring" else "--nccl-port"
    return [
        *command,
        "--backend",
        backend,
        "-n",
        str(ranks),
        port_flag,
        str(port),
        "--python",
        sys.executable,
        "--",
        "-m",
        "omlx_cache.tensor_parallel",
        *args,
    ]


def launch(model_dir, out_dir, cases, ranks=2, max_tokens=MAX_TOKENS, timeout=600):
    """``run`` on ``ranks`` local processes; their reports, by rank."""
    args = ["run", "--model", str(model_dir), "--out", str(out_dir)]
    args += ["--max-tokens", str(max_tokens)]
    for name in cases:
        args += ["--case", name]
    command = launch_command(ranks, free_ports(ranks), args)
    done = subprocess.run(
        command, timeout=timeout, capture_output=True, text=True, check=False
    )
    if done.returncode != 0:
        raise RuntimeError(
            f"{' '.join(command)} exited with {done.returncode}:\n"
            f"{done.stdout[-4000:]}\n{done.stderr[-4000:]}"
        )
    return read_reports(out_dir, ranks)


def read_reports(out_dir, ranks: int) -> list[dict]:
    out_dir = Path(out_dir)
    reports = []
    for rank in range(ranks):
        report = json.loads((out_dir / f"rank{rank}.json").read_text())
        with np.load(out_dir / f"rank{rank}.npz") as arrays:
            report["logprobs"] = dict(arrays)
        reports.append(report)
    return reports


# ---------------------------------------------------------------------------
# The layout: KV bytes per rank


@dataclass(frozen=True)
class Shape:
    layers: int
    kv_heads: int
    head_dim: int
    # bytes of the model's dtype: the fp16 cache's elements, and the scales
    # and biases of the quantized ones
    dtype_bytes: int


LLAMA3_8B = Shape(layers=32, kv_heads=8, head_dim=128, dtype_bytes=2)
TP_LLAMA = Shape(
    layers=TP_LLAMA_CONFIG["num_hidden_layers"],
    kv_heads=TP_LLAMA_CONFIG["num_key_value_heads"],
    head_dim=TP_LLAMA_CONFIG["head_dim"],
    dtype_bytes=4,
)


def scheme_quantization(name: str):
    """``None`` for ``fp16``, else the (key, value) ``Affine`` codecs of an
    affine scheme such as ``8,4``, ``4`` or ``bits=4 group=32``."""
    spec = KVSpec.parse(name)
    if spec.is_reference:
        return None
    codecs = spec.codecs()
    if not all(isinstance(c, Affine) for c in codecs):
        raise ValueError(f"No affine layout for scheme {name!r}.")
    return codecs


def bytes_per_token(name: str, shape: Shape, kv_heads: int) -> int:
    """One layer's bytes per token for ``kv_heads`` heads, keys and values:
    fp16 stores each element in the model's dtype; an affine scheme stores
    ``bits`` per element packed in uint32 words plus, per group, a scale and
    a bias in the model's dtype (float offsets) or one 16-bit word (integer
    offsets)."""
    quantization = scheme_quantization(name)
    if quantization is None:
        return 2 * kv_heads * shape.head_dim * shape.dtype_bytes
    total = 0
    for c in quantization:
        packed = shape.head_dim * c.bits // 32 * 4
        groups = shape.head_dim // c.group_size
        scales = groups * (2 * shape.dtype_bytes if c.offset == "float" else 2)
        total += kv_heads * (packed + scales)
    return total


def generation_slots(name: str, prompt_tokens: int, max_tokens: int) -> int:
    """Tokens a layer's cache allocates for ``generate_step`` with this prompt
    and ``max_tokens``: fp16 (``KVCache``) grows in steps of 256 (for prompts
    within one prefill step or of whole steps); a quantized cache reserves the
    prompt and up to 4,096 new tokens, rounded up to 8 (patch 0010), then adds
    pages of 4,096."""
    from mlx_lm.models.cache import KVCache

    total = prompt_tokens + max_tokens
    if scheme_quantization(name) is None:
        return -(-total // KVCache.step) * KVCache.step
    page = KVStore.page_size
    reserve = -(-(prompt_tokens + min(max_tokens, page)) // 16) * 16
    return reserve + max(0, -(-(total - reserve) // page) * page)


def kv_bytes_per_rank(
    name: str, shape: Shape, slots: int, ranks: int = 1, held: int = 0
) -> int:
    """KV bytes on each rank of ``ranks`` for caches of ``slots`` tokens: a
    rank stores ``kv_heads / ranks`` heads of every layer. ``held``: decode
    tokens waiting unquantized (32 where the CUDA decode kernel runs, patch
    0009). A scheme's first tokens are held unquantized too, and its
    transform adds float32 vectors (one per head)."""
    if shape.kv_heads % ranks:
        raise ValueError(
            f"{ranks} ranks do not divide the model's {shape.kv_heads} KV heads."
        )
    heads = shape.kv_heads // ranks
    per_layer = slots * bytes_per_token(name, shape, heads)
    spec = KVSpec.parse(name)
    if not spec.is_reference:
        # the first tokens held unquantized, and the transform's float32
        # vectors (means, key weights), one per head
        unquantized = spec.first_tokens + held
        per_layer += unquantized * bytes_per_token("fp16", shape, heads)
        center, key_scale = spec.transform
        vectors = len(center) + bool(key_scale)
        per_layer += vectors * heads * shape.head_dim * 4
    return shape.layers * per_layer


def built_kv_bytes(name: str, shape: Shape, slots: int, ranks: int = 1) -> int:
    """``nbytes`` of real caches for one rank's heads holding ``slots`` tokens,
    built at full size but never evaluated (the arrays stay lazy: nothing is
    allocated)."""
    from mlx_lm.models.cache import KVCache

    spec = KVSpec.parse(name)
    dtype = {2: mx.float16, 4: mx.float32}[shape.dtype_bytes]
    heads = shape.kv_heads // ranks
    total = 0
    for _ in range(shape.layers):
        if spec.is_reference:
            cache, tokens = KVCache(), slots
        else:
            # the first tokens and one more: its page is allocated
            cache = KVStore(*spec.codecs(), **spec.settings())
            tokens = spec.first_tokens + 1
            cache.reserve = slots
        x = mx.zeros((1, heads, tokens, shape.head_dim), dtype)
        fetched = cache.update_and_fetch(x, x)
        if not spec.is_reference:
            # a write that fixes a transform waits for the queries
            cache.scaled_dot_product_attention(x, *fetched, 1.0, "causal")
        total += cache.nbytes
    return total


def layout_rows(schemes, contexts, ranks, shape: Shape = LLAMA3_8B) -> list[dict]:
    rows = []
    for name in schemes:
        for context in contexts:
            for n in ranks:
                computed = kv_bytes_per_rank(name, shape, context, n)
                rows.append(
                    {
                        "scheme": name,
                        "context": context,
                        "ranks": n,
                        "bytes": computed,
                        "built": built_kv_bytes(name, shape, context, n),
                    }
                )
    return rows


def layout_table(rows: list[dict]) -> list[str]:
    ranks = sorted({r["ranks"] for r in rows})
    lines = [
        "| KV cache | context | "
        + " | ".join(f"{n} rank{'s' * (n > 1)}" for n in ranks)
        + " |",
        "|---|---:|" + "---:|" * len(ranks),
    ]
    by_key = {(r["scheme"], r["context"], r["ranks"]): r for r in rows}
    for scheme in dict.fromkeys(r["scheme"] for r in rows):
        for context in dict.fromkeys(r["context"] for r in rows):
            cells = [f"{by_key[scheme, context, n]['bytes'] / GIB:.2f}" for n in ranks]
            label = f"{context // 1024}K"
            lines.append(f"| {scheme} | {label} | " + " | ".join(cells) + " |")
    return lines


# ---------------------------------------------------------------------------
# Measured on each rank: a real shape, caches filled to a context

MEASURE_PRESETS = {
    "tp-llama": {
        "config": {**TP_LLAMA_CONFIG, "vocab_size": 512},
        "dtype": "float32",
        "weights": None,
    },
}


def measure_preset(name: str) -> dict:
    from . import bench

    if name in MEASURE_PRESETS:
        return MEASURE_PRESETS[name]
    if name in bench.PRESETS:
        return bench.PRESETS[name]
    known = sorted({*MEASURE_PRESETS, *bench.PRESETS})
    raise ValueError(f"Unknown preset {name!r}; known: {known}.")


def preset_shape(preset: dict) -> Shape:
    config = preset["config"]
    heads = config["num_attention_heads"]
    return Shape(
        layers=config["num_hidden_layers"],
        kv_heads=config.get("num_key_value_heads", heads),
        head_dim=config.get("head_dim") or config["hidden_size"] // heads,
        dtype_bytes=getattr(mx, preset["dtype"]).size,
    )


def held_tokens(name: str, shape: Shape, kv_heads: int) -> int:
    """Decode tokens a quantized cache holds unquantized here (patch 0009:
    ``decode_buffer`` tokens, by default 32 where the CUDA decode kernel
    runs, else none)."""
    quantization = scheme_quantization(name)
    if quantization is None:
        return 0
    dtype = {2: mx.float16, 4: mx.float32}[shape.dtype_bytes]
    x = mx.zeros((1, kv_heads, 1, shape.head_dim), dtype)
    held = kernels.hold(x, x, *KVSpec.parse(name).codecs())
    return held.size if held else 0


def measure(
    preset_name,
    schemes,
    contexts,
    out_dir,
    decode_steps=16,
    step=2048,
    backend="any",
    warmup=1024,
):
    """On this rank: the preset's random-weight llama sharded over the ranks;
    per scheme and context, caches reserved for ``context`` tokens (as
    ``generate_step`` reserves them), a random prompt of ``context -
    decode_steps - 1`` tokens prefilled in chunks of ``step`` (the time to
    the first token's logits), then ``decode_steps`` decode steps pipelined
    as ``generate_step`` runs them (they write one token more). Each scheme first runs a ``warmup``-token
    prompt, so that compilation is not timed. Writes ``measure-rank{R}.json``
    after every row: the rank's KV heads and cache bytes against the
    layout's, its peak memory, first-token time and decode speed."""
    from .bench import models as bench_models
    from .bench import timing

    group = mx.distributed.init(strict=backend != "any", backend=backend)
    rank, size = group.rank(), group.size()
    preset = measure_preset(preset_name)
    shape = preset_shape(preset)
    model = bench_models.build_model(preset, getattr(mx, preset["dtype"]))
    if size > 1:
        model.shard(group)
    mx.eval(model.parameters())
    vocab = preset["config"]["vocab_size"]
    report = {
        "preset": preset_name,
        "ranks": size,
        "rank": rank,
        "device": str(mx.default_device()),
        "weights_bytes": sum(v.nbytes for _, v in tree_flatten(model.parameters())),
        "prefill_step": step,
        "decode_steps": decode_steps,
        "rows": [],
    }
    out = Path(out_dir) / f"measure-rank{rank}.json"
    out.parent.mkdir(parents=True, exist_ok=True)

    def generate(name, context, steps):
        cache = KVSpec.parse(name).make_cache(model)
        for c in cache:
            # as generate_step reserves the generation's page
            if getattr(c, "reserve", False) is None and c.empty():
                c.reserve = context
        # the pipelined decode writes steps + 1 tokens: context in all
        prompt = timing.random_tokens(context - steps - 1, vocab, seed=context)
        tokens = timing.random_tokens(steps + 1, vocab, seed=1)
        start = time.perf_counter()
        timing.prefill(model, prompt, cache, step, lambda c: None, math.inf)
        first_token_s = time.perf_counter() - start
        times = timing.decode_pipelined(model, cache, tokens, lambda c: None, math.inf)
        return cache, first_token_s, times

    for name in schemes:
        generate(name, warmup + decode_steps, decode_steps)
        mx.clear_cache()
        for context in contexts:
            mx.reset_peak_memory()
            cache, first_token_s, times = generate(name, context, decode_steps)
            heads = kv_heads(cache[0])
            row = {
                "scheme": name,
                "context": context,
                "kv_heads": heads,
                "nbytes": sum(c.nbytes for c in cache),
                "layout": kv_bytes_per_rank(
                    name, shape, context, size, held_tokens(name, shape, heads)
                ),
                "peak_memory": mx.get_peak_memory(),
                "first_token_s": round(first_token_s, 2),
                "decode_tok_s": round(1 / float(np.median(times)), 1),
            }
            report["rows"].append(row)
            out.write_text(json.dumps(report, indent=1))
            log(f"rank {rank}/{size} {row}")
            del cache
            mx.clear_cache()
    return report


def measure_table(reports: list[dict]) -> list[str]:
    """Markdown: each rank's measured KV bytes next to the layout's, its peak
    memory (weights included), first-token time and decode speed."""
    lines = [
        (
            "| KV cache | context | ranks | rank | KV heads | nbytes | layout "
            "| equal | peak memory | first token | decode |"
        ),
        "|---|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|",
    ]
    for report in reports:
        for r in report["rows"]:
            lines.append(
                f"| {r['scheme']} | {r['context']:,} | {report['ranks']} "
                f"| {report['rank']} | {r['kv_heads']} | {r['nbytes']:,} "
                f"| {r['layout']:,} | {r['nbytes'] == r['layout']} "
                f"| {r['peak_memory'] / GIB:.2f} GiB | {r['first_token_s']:.2f} s "
                f"| {r['decode_tok_s']:.1f} tok/s |"
            )
    return lines


# ---------------------------------------------------------------------------
# Comparison with one process


def _sequences(report, name):
    n = len(report["cases"][name]["tokens"])
    return [report["logprobs"][f"{name}/{i}"] for i in range(n)]


def quantization_error(one: dict, name: str) -> float:
    """Largest log-probability difference between case ``name`` and its fp16
    reference in one process, over the steps whose inputs are the same (up
    to and including the first token where the two differ)."""
    case = parse_case(name)
    ref = case.reference
    error = 0.0
    for tokens, ref_tokens, lp, ref_lp in zip(
        one["cases"][name]["tokens"],
        one["cases"][ref]["tokens"],
        _sequences(one, name),
        _sequences(one, ref),
    ):
        same = next(
            (i for i, (a, b) in enumerate(zip(tokens, ref_tokens)) if a != b),
            len(tokens) - 1,
        )
        error = max(error, float(np.abs(lp[: same + 1] - ref_lp[: same + 1]).max()))
    return error


def compare(one: dict, sharded: list[dict], shape: Shape = TP_LLAMA) -> list[dict]:
    """Per case: whether every rank's greedy tokens equal one process's, the
    largest log-probability difference, the bound it must stay within, each
    rank's KV heads, cache classes and bytes, and for one sequence with an
    unbounded cache the bytes the layout gives (one process; a rank)."""
    rows = []
    for name, single in one["cases"].items():
        case = parse_case(name)
        diff = 0.0
        for report in sharded:
            for a, b in zip(_sequences(one, name), _sequences(report, name)):
                diff = max(diff, float(np.abs(a - b).max()))
        quantized = case.scheme != "fp16"
        error = quantization_error(one, name) if quantized else None
        layout = None
        if not case.batch and case.window is None:
            slots = generation_slots(
                case.scheme, single["prompt_tokens"][0], one["max_tokens"]
            )
            layout = [
                kv_bytes_per_rank(case.scheme, shape, slots, n)
                for n in (1, len(sharded))
            ]
        bound = QUANTIZED_FRACTION * error if quantized else FP_TOLERANCE
        rows.append(
            {
                "case": name,
                "tokens_equal": all(
                    r["cases"][name]["tokens"] == single["tokens"] for r in sharded
                ),
                "logprob_diff": diff,
                "quantization_error": error,
                "bound": bound,
                "within": diff <= bound,
                "cache": single["cache"],
                "kv_heads": [single["kv_heads"]]
                + [r["cases"][name]["kv_heads"] for r in sharded],
                "nbytes": [single["nbytes"]]
                + [r["cases"][name]["nbytes"] for r in sharded],
                "layout_nbytes": layout,
            }
        )
    return rows


def passed(row: dict) -> bool:
    """Tokens equal, log-probabilities within the bound, and the layout's
    bytes equal to what each rank measured."""
    layout = row["layout_nbytes"]
    nbytes_ok = layout is None or (
        row["nbytes"][0] == layout[0] and set(row["nbytes"][1:]) == {layout[1]}
    )
    return row["tokens_equal"] and row["within"] and nbytes_ok


def comparison_table(rows: list[dict]) -> list[str]:
    """Markdown: one row per case. Bytes are one process's; then each rank's,
    and what the layout gives for one process and for one rank."""
    header = (
        "| case | cache | tokens equal | max logprob diff | bound | fp16 error "
        "| KV heads | KV bytes | layout |"
    )
    lines = [header, "|---|---|---|---:|---:|---:|---|---|---|"]
    for r in rows:
        error = r["quantization_error"]
        layout = r["layout_nbytes"]
        cells = [
            r["case"],
            ", ".join(r["cache"]),
            str(r["tokens_equal"]),
            f"{r['logprob_diff']:.2e}",
            f"{r['bound']:.2e}",
            "" if error is None else f"{error:.3g}",
            " / ".join(",".join(map(str, h)) for h in r["kv_heads"]),
            " / ".join(f"{b:,}" for b in r["nbytes"]),
            "" if layout is None else " / ".join(f"{b:,}" for b in layout),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def main(argv=None):
    parser = argparse.ArgumentParser(
        prog="python -m omlx_cache.tensor_parallel",
        description="Quantized KV caches under tensor parallelism.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("model", help="write the random-weight llama")
    p.add_argument("--out", required=True)
    p.add_argument(
        "--tokenizer",
        default=str(DEFAULT_TOKENIZER),
        help="model directory whose tokenizer files are copied",
    )
    p = sub.add_parser("run", help="generate every case on this rank")
    p.add_argument("--model", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--case", action="append", help="a case (default: all)")
    p.add_argument("--max-tokens", type=int, default=MAX_TOKENS)
    p = sub.add_parser("compare", help="one process's results against the ranks'")
    p.add_argument("one")
    p.add_argument("sharded")
    p.add_argument("--ranks", type=int, default=2)
    p = sub.add_parser("measure", help="each rank's KV bytes at a real shape")
    p.add_argument("--preset", default="llama3-8b")
    p.add_argument("--kv", action="append", help="schemes (default fp16, 8,4, 4)")
    p.add_argument("--contexts", default="32768,131072")
    p.add_argument("--decode-steps", type=int, default=16)
    p.add_argument("--prefill-step-size", type=int, default=2048)
    p.add_argument("--warmup", type=int, default=1024, help="untimed prompt tokens")
    p.add_argument(
        "--backend", default="any", help="mx.distributed backend (ring, nccl, ...)"
    )
    p.add_argument("--out", required=True)
    p = sub.add_parser("layout", help="KV bytes per rank at a Llama-3-8B shape")
    p.add_argument("--kv", action="append", help="schemes (default fp16, 8,4, 4)")
    p.add_argument("--contexts", default="32768,131072")
    p.add_argument("--ranks", default="1,2,4,8")
    args = parser.parse_args(argv)
    if args.command == "model":
        write_model(args.out, args.tokenizer)
    elif args.command == "run":
        run(args.model, args.case or DEFAULT_CASES, args.out, args.max_tokens)
    elif args.command == "compare":
        (one,) = read_reports(args.one, 1)
        rows = compare(one, read_reports(args.sharded, args.ranks))
        print("\n".join(comparison_table(rows)))
        return 0 if all(passed(r) for r in rows) else 1
    elif args.command == "measure":
        report = measure(
            args.preset,
            args.kv or ["fp16", "8,4", "4"],
            [int(c) for c in args.contexts.split(",")],
            args.out,
            args.decode_steps,
            args.prefill_step_size,
            args.backend,
            args.warmup,
        )
        print("\n".join(measure_table([report])))
        return 0 if all(r["nbytes"] == r["layout"] for r in report["rows"]) else 1
    elif args.command == "layout":
        rows = layout_rows(
            args.kv or ["fp16", "8,4", "4"],
            [int(c) for c in args.contexts.split(",")],
            [int(n) for n in args.ranks.split(",")],
        )
        print("\n".join(layout_table(rows)))
        mismatched = [r for r in rows if r["bytes"] != r["built"]]
        for r in mismatched:
            log(f"layout {r} differs from the built caches")
        return 1 if mismatched else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
