"""The disk tier (omlx_cache.disk_cache) in process, on real files: a tiny
random llama's caches of every supported kind (mlx-lm's float caches,
omlx_cache.kv's stores of several schemes) go to disk in blocks and come back
bit for bit, and the model goes on from them with the very same logits; bad
files are skipped, warned about once and removed; the byte cap evicts least
recently used blocks; a write that fails stops writing. The real server with
the tier: tests/test_disk_cache_server.py."""

import argparse
import copy
import logging
import os
import resource
import shutil
import subprocess
import sys

import mlx.core as mx
import pytest
from mlx_lm.models.cache import KVCache, LRUPromptCache, make_prompt_cache
from mlx_lm.server import make_prompt_cache_tier
from tiny_llama import make_model

from omlx_cache import unified_memory
from omlx_cache.blocks import BadBlock, Plan, layout_of, read_block
from omlx_cache.disk_cache import DiskPromptCache, check_directory, main
from omlx_cache.kv import Affine, KVStore
from omlx_cache.kv.kernels import Hold
from omlx_cache.kv.spec import KVSpec

B = 32  # tokens a block
MODEL = ("tiny-llama", None, None)


@pytest.fixture(scope="module")
def model():
    return make_model()


@pytest.fixture(scope="module")
def tokens():
    return mx.random.randint(0, 320, (300,), key=mx.random.key(3)).tolist()


def prefill(model, cache, tokens):
    logits = model(mx.array(tokens)[None], cache=cache)
    mx.eval(logits, [c.state for c in cache])
    return logits


def spec_cache(text, max_kv_size=None):
    return lambda m: KVSpec.parse(text).make_cache(m, max_kv_size)


SCHEMES = [
    "fp16",
    "bits=8,4",
    "bits=4",
    "bits=4 recent=16",
    "bits=4 group=32 offset=int",
    "codec=codebook bits=4 center=k first=8",
]
KINDS = {
    **{text: spec_cache(text) for text in SCHEMES},
    # keys and values centered, keys weighted, 4- and 3-bit in groups of 64
    # and 32, a 72-token residual (held tokens over several blocks)
    "q4": spec_cache("q4"),
    "center=kv": spec_cache("bits=4 center=kv qscale=q"),
    "bits=4 first=16": spec_cache("bits=4 center=none qscale=none"),
    # bounded layers that have dropped nothing yet (bits=4: 32 first tokens,
    # 4 of them sinks, in the first span only)
    "fp16 rotating": spec_cache("fp16", 512),
    "bits=8 window": spec_cache("bits=8", 512),
    "bits=4 window": spec_cache("bits=4", 512),
}


def stored(model, tokens, kind, n_tokens):
    """A cache of ``kind`` that prefilled ``n_tokens`` in two updates."""
    cache = KINDS[kind](model)
    prefill(model, cache, tokens[: n_tokens // 3])
    prefill(model, cache, tokens[n_tokens // 3 : n_tokens])
    return cache


def tier(directory, **kwargs):
    return DiskPromptCache(directory, block_tokens=B, **kwargs)


def assert_same_cache(a, b, n):
    """The first ``n`` tokens of caches ``a`` and ``b`` are held alike: the
    same classes and settings, the same arrays (pages and held tokens)."""
    assert [type(c) for c in a] == [type(c) for c in b]
    for x, y in zip(a, b):
        sx, sy = layout_of(type(x)).split(x), layout_of(type(y)).split(y)
        assert sx.describe() == sy.describe()
        px, py = sx.slices(0, n), sy.slices(0, n)
        assert px.keys() == py.keys()
        for kind in px:
            for u, v in zip(px[kind], py[kind]):
                assert u.dtype == v.dtype
                assert mx.array_equal(u, v).item()
        for u, v in zip(sx.arrays, sy.arrays):
            assert mx.array_equal(u, v).item()


def assert_goes_on_alike(model, tokens, cache, restored, n, stop):
    """The model goes on from the ``n`` restored tokens to ``stop`` as from
    (a copy of) the original cache trimmed to them: the same logits, bit for
    bit."""
    cache = copy.deepcopy(cache)
    for c in cache:
        c.trim(c.offset - n)
    expected = prefill(model, cache, tokens[n:stop])
    logits = prefill(model, restored, tokens[n:stop])
    assert mx.array_equal(logits, expected).item()


def held_counts(cache):
    """Each layer's held tokens (0 for mlx-lm's caches)."""
    return [int(c.state[13]) if len(c.state) == 15 else 0 for c in cache]


@pytest.mark.parametrize("kind", list(KINDS))
def test_round_trip(model, tokens, tmp_path, kind):
    cache = stored(model, tokens, kind, 250)
    writer = tier(tmp_path)
    writer.insert(MODEL, tokens[:250], cache)
    writer.flush()
    assert writer.stats.written_blocks == 250 // B + 1  # and a tail
    # plain safetensors files
    for path in tmp_path.glob("*/*.safetensors"):
        arrays, metadata = mx.load(str(path), return_metadata=True)
        assert metadata["format"] == "omlx-prefix-block"
        assert "0.keys.0" in arrays or "0.held_keys.0" in arrays

    # a new tier on the directory, as after a restart
    restored, n = tier(tmp_path).fetch(MODEL, tokens, 0)
    assert n == 250
    assert held_counts(restored) == held_counts(cache)
    # a store's pages begin after its first tokens (in the first span only)
    assert [getattr(c, "dropped", 0) for c in restored] == [
        getattr(c, "dropped", 0) for c in cache
    ]
    assert_same_cache(cache, restored, n)
    assert_goes_on_alike(model, tokens, cache, restored, n, 280)


def test_a_prefix_restored_shorter_than_the_first_tokens(model, tokens, tmp_path):
    """Blocks of 8 tokens, 16 first tokens: the first block's page rows are
    the first span's (stored encoded, so the pages' rows run from row 0) and
    a prefix of one block restores a store of 8 tokens with none in its
    pages; the model goes on from it as from the stored cache trimmed."""
    cache = stored(model, tokens, "bits=4 first=16", 100)
    assert cache[0].dropped == 16
    t = DiskPromptCache(tmp_path, block_tokens=8)
    t.insert(MODEL, tokens[:100], cache)
    t.flush()
    for prefix in (8, 16, 24, 100):
        restored, n = DiskPromptCache(tmp_path, block_tokens=8).fetch(
            MODEL, tokens[: prefix + 1], 0
        )
        assert n == prefix
        assert (restored[0].dropped, restored[0]._written) == (min(16, n), n)
        assert_goes_on_alike(model, tokens, cache, restored, n, 110)


@pytest.mark.parametrize("kind", ["fp16", "bits=8,4"])
def test_round_trip_bfloat16(tokens, tmp_path, kind):
    """bfloat16 has no numpy type: its bits travel as uint16 and come back
    as bfloat16."""
    model = make_model()
    model.set_dtype(mx.bfloat16)
    cache = stored(model, tokens, kind, 250)
    keys = cache[0].state[0]
    assert (keys if kind == "fp16" else keys[0][1]).dtype == mx.bfloat16  # scales
    writer = tier(tmp_path)
    writer.insert(MODEL, tokens[:250], cache)
    writer.flush()
    restored, n = tier(tmp_path).fetch(MODEL, tokens, 0)
    assert n == 250
    assert_same_cache(cache, restored, n)
    assert_goes_on_alike(model, tokens, cache, restored, n, 280)


def held_blocks(directory):
    return sorted(
        int(read_block(p)[0]["index"]) for p in directory.glob("*/*.held.safetensors")
    )


@pytest.mark.parametrize("kind", ["bits=4 recent=16", "q4"])
def test_residual_held_tokens_go_to_disk_unquantized(model, tokens, tmp_path, kind):
    """A residual's held tokens are stored as they are held, in blocks named
    as holding them: the restored store holds them too. Once a longer prompt
    has them in its pages, its blocks are taken instead."""
    cache = KINDS[kind](model)
    prefill(model, cache, tokens[:100])
    held = held_counts(cache)[0]
    assert held == {"bits=4 recent=16": 20, "q4": 100}[kind]
    t = tier(tmp_path)
    t.insert(MODEL, tokens[:100], cache)
    t.flush()
    # the blocks with held tokens, the tail (96-100) among them
    first_held = (100 - held) // B
    assert held_blocks(tmp_path) == list(range(first_held, 4))
    restored, n = tier(tmp_path).fetch(MODEL, tokens, 0)
    assert n == 100
    assert held_counts(restored) == held_counts(cache)
    assert_same_cache(cache, restored, n)
    assert_goes_on_alike(model, tokens, cache, restored, n, 120)

    # the conversation goes on: its pages hold what was held
    prefill(model, cache, tokens[100:250])
    longer = cache
    t.insert(MODEL, tokens[:250], longer)
    t.flush()
    restored, n = tier(tmp_path).fetch(MODEL, tokens, 0)
    assert n == 250
    assert held_counts(restored) == held_counts(longer)
    assert_same_cache(longer, restored, n)
    assert_goes_on_alike(model, tokens, longer, restored, n, 280)
    # the first prompt again: the longer one's blocks (rows in the pages),
    # then the first one's tail of held tokens, its settings being theirs
    # (q4's too: its first tokens and transform were kept from the first
    # write, before any token reached its pages)
    restored, n = tier(tmp_path).fetch(MODEL, tokens[:101], 0)
    assert_same_cache(longer, restored, 3 * B)
    assert n == 100 and held_counts(restored) == [100 - 3 * B] * len(restored)


def test_bad_held_block_is_skipped_and_removed(model, tokens, tmp_path, caplog):
    cache = stored(model, tokens, "q4", 250)  # 144 tokens in the pages
    t = tier(tmp_path)
    t.insert(MODEL, tokens[:250], cache)
    t.flush()
    assert held_blocks(tmp_path) == [4, 5, 6, 7]
    victim = next(
        p
        for p in tmp_path.glob("*/*.held.safetensors")
        if "5" == read_block(p)[0]["index"]
    )
    corrupt(victim)
    with caplog.at_level(logging.WARNING, logger="omlx_cache.disk_cache"):
        restored, n = tier(tmp_path).fetch(MODEL, tokens, 0)
    assert n == 5 * B
    assert held_counts(restored) == [5 * B - 144] * len(restored)
    assert_same_cache(cache, restored, n)
    assert_goes_on_alike(model, tokens, cache, restored, n, 200)
    assert [r.getMessage() for r in caplog.records if victim.name in r.getMessage()]
    assert not victim.exists()


@pytest.mark.parametrize("first", [0, 16])
def test_kernel_held_tokens_go_to_the_pages_first(tmp_path, first):
    """Decode tokens a kernel holds outside the codecs' rotated domains (as
    CUDA's codebook kernel asks) go to the pages before a store is stored
    (its state holds none: it does not say in which domain they are held):
    the restored store holds them in its pages and attends as the stored
    one (the first tokens in its first span only, the pages after them)."""
    mx.random.seed(0)
    keys, values = (mx.random.normal((1, 2, 40, 64)) for _ in range(2))
    store = KVStore(Affine(4, 64, "hadamard"), first=first)
    store.update_and_fetch(keys[:, :, :36], values[:, :, :36])
    store.spans.hold = Hold(8, rotated=False)
    for t in range(36, 40):
        store.update_and_fetch(keys[:, :, t : t + 1], values[:, :, t : t + 1])
    assert store.spans.n_held == 4 and not store.spans.rotated
    t = tier(tmp_path)
    t.insert(MODEL, list(range(40)), [store])
    t.flush()
    assert store.spans.n_held == 0 and store._written == 40
    (restored,), n = tier(tmp_path).fetch(MODEL, list(range(41)), 0)
    assert n == 40 and held_counts([restored]) == [0]
    assert (restored.dropped, restored._written) == (store.dropped, 40) == (first, 40)
    assert_same_cache([store], [restored], 40)
    queries = mx.random.normal((1, 4, 1, 64))
    expected, got = (
        c.scaled_dot_product_attention(queries, None, None, scale=0.125, mask=None)
        for c in (store, restored)
    )
    assert mx.array_equal(got, expected).item()


def test_caches_it_cannot_store(model, tokens, tmp_path, caplog):
    """A window that dropped pages, a wrapped rotating cache: nothing to store
    from the first token, nothing written. Caches of classes without a layout
    (a subclass may hold another state): one warning, nothing written."""
    t = tier(tmp_path)
    for cache in (
        KVSpec.parse("bits=4").make_cache(model, 64),
        make_prompt_cache(model, max_kv_size=64),
    ):
        prefill(model, cache, tokens[:200])
        prefill(model, cache, tokens[200:250])
        t.insert(MODEL, tokens[:250], cache)
    assert cache[0].state[5] != 250  # wrapped

    class Other(KVCache):
        pass

    other = [Other() for _ in model.layers]
    prefill(model, other, tokens[:100])
    with caplog.at_level(logging.WARNING, logger="omlx_cache.disk_cache"):
        for _ in range(2):
            t.insert(MODEL, tokens[:100], other)
    t.flush()
    assert t.stats.written_blocks == 0 and t.nbytes == 0
    warnings = [r.getMessage() for r in caplog.records if r.name == t.__module__]
    assert warnings == ["disk prompt cache: not storing caches of Other"]


def test_fetch_limits(model, tokens, tmp_path):
    t = tier(tmp_path)
    t.insert(MODEL, tokens[:250], stored(model, tokens, "bits=8,4", 250))
    t.flush()
    # seven blocks and a tail of 26 tokens
    assert t.fetch(MODEL, tokens, 0)[1] == 250
    # never the whole prompt: a token must be left to compute
    assert t.fetch(MODEL, tokens[:250], 0)[1] == 224
    assert t.fetch(MODEL, tokens[:224], 0)[1] == 192
    # nothing shorter than the memory's match
    assert t.fetch(MODEL, tokens, 250) is None
    assert t.fetch(MODEL, tokens, 249)[1] == 250
    # another prompt shares the first block only
    other = tokens[:40] + [(x + 1) % 320 for x in tokens[40:]]
    assert t.fetch(MODEL, other, 0)[1] == B


def test_key_separates_models_and_settings(model, tokens, tmp_path):
    settings = {"kv_bits": [8, 4], "kv_group_size": 64}
    t = tier(tmp_path, settings=settings)
    t.insert(MODEL, tokens[:250], stored(model, tokens, "bits=8,4", 250))
    t.flush()
    assert tier(tmp_path, settings=settings).fetch(MODEL, tokens, 0) is not None
    assert (
        tier(tmp_path, settings={**settings, "kv_bits": 4}).fetch(MODEL, tokens, 0)
        is None
    )
    assert tier(tmp_path, settings=settings).fetch(("other",), tokens, 0) is None
    assert (
        DiskPromptCache(tmp_path, settings=settings, block_tokens=16).fetch(
            MODEL, tokens, 0
        )
        is None
    )


def test_model_identity_covers_config(model, tokens, tmp_path):
    weights = tmp_path / "model"
    weights.mkdir()
    (weights / "config.json").write_text('{"hidden_size": 128}')
    key = (str(weights), None, None)
    t = tier(tmp_path / "cache")
    t.insert(key, tokens[:100], stored(model, tokens, "fp16", 100))
    t.flush()
    assert tier(tmp_path / "cache").fetch(key, tokens, 0) is not None
    (weights / "config.json").write_text('{"hidden_size": 256}')
    assert tier(tmp_path / "cache").fetch(key, tokens, 0) is None


def block_files(directory):
    """{index in its chain: path} of the block files under ``directory``."""
    files = {}
    for path in directory.glob("*/*.safetensors"):
        files[int(read_block(path)[0]["index"])] = path
    return files


def flip_byte(path, offset):
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


def corrupt(path):
    flip_byte(path, path.stat().st_size - 100)


def truncate(path):
    os.truncate(path, path.stat().st_size // 2)


def garbage(path):
    path.write_bytes(b"not a safetensors file")


def bad_header(path):
    flip_byte(path, 20)


@pytest.mark.parametrize("damage", [corrupt, truncate, garbage, bad_header])
def test_bad_block_is_skipped_and_removed(model, tokens, tmp_path, caplog, damage):
    t = tier(tmp_path)
    cache = stored(model, tokens, "bits=8,4", 250)
    t.insert(MODEL, tokens[:250], cache)
    t.flush()
    victim = block_files(tmp_path)[3]
    damage(victim)
    with caplog.at_level(logging.WARNING, logger="omlx_cache.disk_cache"):
        restored, n = tier(tmp_path).fetch(MODEL, tokens, 0)
    assert n == 3 * B  # the blocks before the bad one
    assert_same_cache(cache, restored, n)
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and victim.name in warnings[0].getMessage()
    assert "\n" not in warnings[0].getMessage()
    assert not victim.exists()


def test_foreign_block_is_skipped_and_removed(model, tokens, tmp_path, caplog):
    """Another key's block put under this key's name (same tokens): skipped."""
    ours, theirs = tmp_path / "ours", tmp_path / "theirs"
    for directory, kind in ((ours, "bits=8,4"), (theirs, "fp16")):
        t = tier(directory, settings={"kind": kind})
        t.insert(MODEL, tokens[:250], stored(model, tokens, kind, 250))
        t.flush()
    victim = block_files(ours)[2]
    shutil.copy(block_files(theirs)[2], victim)
    with caplog.at_level(logging.WARNING, logger="omlx_cache.disk_cache"):
        _, n = tier(ours, settings={"kind": "bits=8,4"}).fetch(MODEL, tokens, 0)
    assert n == 2 * B
    assert [r.getMessage() for r in caplog.records if "key differs" in r.getMessage()]
    assert not victim.exists()


def test_read_into_a_slot_parses_as_a_whole_read(model, tokens, tmp_path):
    """A full block read straight into a slot (its data after the header)
    gives the metadata, tokens and settings a whole read gives, and the slot
    holds the file's data; a corrupt one fails its CRC, a block of another
    layout leaves the slot untouched."""
    t = tier(tmp_path)
    t.insert(MODEL, tokens[:250], stored(model, tokens, "center=kv", 250))
    t.flush()
    files = block_files(tmp_path)
    metadata, tensors, _ = read_block(files[0])
    plan = Plan.from_block(metadata, tensors)
    plan.allocate(2)
    for i in (0, 1):
        metadata, small, size = plan.read(files[i], i)
        alone = read_block(files[i])
        assert metadata == alone[0] and size == alone[2] == files[i].stat().st_size
        assert set(small) == plan.small and "0.settings.0" in small
        for name, (dtype, x) in small.items():
            assert dtype == alone[1][name][0] and (x == alone[1][name][1]).all()
        data = files[i].read_bytes()
        assert bytes(plan.slot(i)) == data[len(data) - len(plan.slot(i)) :]
    tail = files[7]  # a partial block: another layout
    before = bytes(plan.slot(1))
    assert plan.read(tail, 1) is None and bytes(plan.slot(1)) == before
    corrupt(files[1])
    with pytest.raises(BadBlock, match="CRC"):
        plan.read(files[1], 1)


def test_check_directory(model, tokens, tmp_path, capsys):
    t = tier(tmp_path)
    t.insert(MODEL, tokens[:250], stored(model, tokens, "bits=4", 250))
    t.flush()
    assert check_directory(tmp_path) == (8, [])  # seven and a tail
    corrupt(block_files(tmp_path)[5])
    good, bad = check_directory(tmp_path)
    assert good == 7 and len(bad) == 1 and "CRC" in bad[0][1]
    assert main(["check", str(tmp_path), "--remove"]) == 1
    assert "7 good blocks, 1 bad" in capsys.readouterr().out
    assert check_directory(tmp_path) == (7, [])


def test_byte_cap_evicts_least_recently_used(model, tokens, tmp_path):
    cache = stored(model, tokens, "fp16", 250)
    block_bytes = tier(tmp_path / "probe")
    block_bytes.insert(MODEL, tokens[: B + 1], cache)
    block_bytes.flush()
    size = block_bytes.nbytes
    # room for five blocks
    t = tier(tmp_path / "capped", max_bytes=5 * size + size // 2)
    t.insert(MODEL, tokens[:128], cache)  # blocks 0-3 of one chain
    t.flush()
    other = [(x + 7) % 320 for x in tokens]
    t.insert(MODEL, other[:64], stored(model, other, "fp16", 64))  # two more
    t.flush()
    assert t.nbytes <= t.max_bytes
    # the first chain lost its tail, not its head
    assert t.fetch(MODEL, tokens, 0)[1] == 3 * B
    assert t.fetch(MODEL, other, 0)[1] == 2 * B
    # and the cap holds across a restart
    assert tier(tmp_path / "capped", max_bytes=t.max_bytes).nbytes <= t.max_bytes


def test_write_error_stops_writing_not_serving(model, tokens, tmp_path, caplog):
    """A file size limit (RLIMIT_FSIZE) makes the writes fail with EFBIG."""
    t = tier(tmp_path)
    t.insert(MODEL, tokens[:100], stored(model, tokens, "fp16", 100))
    t.flush()
    assert t.stats.written_blocks == 4  # three and a tail
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (30_000, hard))
    try:
        with caplog.at_level(logging.WARNING, logger="omlx_cache.disk_cache"):
            t.insert(MODEL, tokens[:250], stored(model, tokens, "fp16", 250))
            t.flush()
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    assert not t.writable
    assert len([r for r in caplog.records if "cannot write" in r.getMessage()]) == 1
    assert not list(tmp_path.glob("*/*.tmp"))
    assert t.fetch(MODEL, tokens, 0)[1] == 100
    t.insert(MODEL, tokens[:250], stored(model, tokens, "fp16", 250))
    t.flush()
    assert t.stats.written_blocks == 4


def test_temporary_files_of_dead_writers_are_removed(tmp_path):
    ns = tmp_path / ("a" * 32)
    ns.mkdir()
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True,
        text=True,
        check=True,
    )
    left = ns / f"{'b' * 64}.{dead.stdout.strip()}.0a1b.tmp"
    left_held = ns / f"{'d' * 64}.held.{dead.stdout.strip()}.0a1b.tmp"
    live = ns / f"{'c' * 64}.{os.getppid()}.0a1b.tmp"
    for path in (left, left_held, live):
        path.write_bytes(b"partial")
    tier(tmp_path)
    assert not left.exists() and not left_held.exists() and live.exists()


def test_server_hook_finds_the_disk_tier(model, tokens, tmp_path):
    """The installed entry point builds the tier from the server's flags, and
    LRUPromptCache falls back to it when the memory lost a prompt."""
    args = argparse.Namespace(
        prompt_cache_dir=str(tmp_path),
        prompt_cache_disk_bytes=1 << 30,
        prompt_cache_tier="disk",
        kv_bits=None,
        kv_group_size=64,
        max_kv_size=None,
        quantized_kv_start=0,
    )
    disk = make_prompt_cache_tier(args)
    assert isinstance(disk, DiskPromptCache) and disk.max_bytes == 1 << 30
    memory = LRUPromptCache(max_size=1, tier=disk)
    memory.insert_cache(MODEL, tokens[:600], stored(model, tokens, "fp16", 300))
    other = [(x + 1) % 320 for x in tokens]
    memory.insert_cache(MODEL, other[:100], stored(model, other, "fp16", 100))
    disk.flush()
    cache, rest = memory.fetch_nearest_cache(MODEL, tokens[:280])
    assert len(rest) == 280 - 256 and cache[0].offset == 256


def test_disk_bench_synthetic(tmp_path):
    """The GPU measurement's script, at a tiny shape: every scheme restores the
    prefix and answers as a prefill from scratch."""
    from omlx_cache import disk_bench

    report = disk_bench.main(
        [
            "synthetic",
            "--preset",
            "tiny-cpu",
            "--prefix",
            "256",
            "--suffix",
            "8",
            "--prefill-step",
            "128",
            "--block-tokens",
            "64",
            "--answer-tokens",
            "3",
            "--schemes",
            "fp16",
            "bits=8,4",
            "bits=4",
            "bits=4 recent=16",
            "--out",
            str(tmp_path / "report.json"),
        ]
    )
    assert [r["scheme"] for r in report["synthetic"]] == [
        "fp16",
        "bits=8,4",
        "bits=4",
        "bits=4 recent=16",
    ]
    for row in report["synthetic"]:
        assert row["restored_tokens"] == 256
        assert row["identical_cold"] and row["identical_warm"]
    assert (tmp_path / "report.json").exists()


def test_prefetch_is_a_no_op_off_cuda():
    """Moving arrays to the GPU only happens on CUDA; elsewhere the arrays are
    left as they are and the call says it did nothing."""
    x = mx.arange(1000, dtype=mx.float32)
    mx.eval(x)
    on_cuda = mx.default_device() == mx.gpu and mx.cuda.is_available()
    assert unified_memory.available() == on_cuda
    assert unified_memory.prefetch_to_gpu([x]) == on_cuda
    assert mx.array_equal(x, mx.arange(1000, dtype=mx.float32)).item()
