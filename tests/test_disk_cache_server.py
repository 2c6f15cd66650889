"""mlx_lm.server with the disk tier (--prompt-cache-dir) on the real SmolLM2,
over HTTP on 127.0.0.1, with real files: a restarted server restores a shared
prefix from the disk (fp16, and omlx_cache.kv's schemes through ``--kv-cache
omlx --kv-cache-config SCHEME``); a corrupt block is skipped with one warning
and removed; a server killed with SIGKILL while it writes leaves only blocks
that read back, and a restarted one restores them; a full disk stops writing,
not serving. Answers are compared with a server of the same scheme that caches
nothing (every prompt computed from scratch). Blocks are 64 tokens here
(OMLX_PROMPT_CACHE_BLOCK_TOKENS)."""

import resource
import subprocess
import sys
import threading
import time

import pytest
import requests
from mlx_lm.utils import load_tokenizer
from test_disk_cache import block_files, corrupt

from omlx_cache import disk_bench
from omlx_cache.disk_cache import BLOCK_TOKENS_ENV, check_directory, wait_for_blocks
from omlx_cache.kv.spec import KVSpec

B = 64
SCHEMES = [
    "fp16",
    "bits=8,4",
    "bits=4",
    "bits=4 recent=16",
    "codec=codebook bits=4 center=k first=8",
]
QUANTIZED = "bits=8,4"
kv_args = disk_bench.server_args
DOC = " ".join(
    f"Station {i} of the northern line opened in {1890 + 3 * i} and serves "
    f"{40 + 7 * i} thousand riders a day."
    for i in range(12)
)
QUESTIONS = [
    "Which station opened in 1899?",
    "How many riders does station 5 serve?",
    "Which is the busiest station?",
]


def limited(which: int, value: int) -> list[str]:
    """A command prefix that runs the rest of the command under a resource
    limit (as ``prlimit`` does)."""
    code = (
        "import os, resource, sys; "
        f"resource.setrlimit({which}, ({value}, {value})); "
        "os.execv(sys.argv[1], sys.argv[1:])"
    )
    return [sys.executable, "-c", code]


def Server(model_dir, log_dir, *args, limit_file_size=None):
    """The server with 64-token blocks, optionally under a file size limit."""
    prefix = (
        ()
        if limit_file_size is None
        else limited(resource.RLIMIT_FSIZE, limit_file_size)
    )
    env = {BLOCK_TOKENS_ENV: str(B)}
    return disk_bench.Server(
        model_dir, log_dir, "--max-tokens", "12", *args, env=env, prefix=prefix
    )


def messages(question, doc=DOC):
    return [{"role": "system", "content": doc}, {"role": "user", "content": question}]


def chat(url, question, doc=DOC):
    """(answer, usage) of a greedy chat completion."""
    response = requests.post(
        f"{url}/v1/chat/completions",
        json={
            "messages": messages(question, doc),
            "max_tokens": 12,
            "temperature": 0.0,
        },
        timeout=300,
    )
    response.raise_for_status()
    body = response.json()
    return body["choices"][0]["message"]["content"], body["usage"]


def cached(usage) -> int:
    return usage["prompt_tokens_details"]["cached_tokens"]


@pytest.fixture(scope="module")
def model_dir(smollm2_dirs):
    return smollm2_dirs[1]


@pytest.fixture(scope="module")
def reference(model_dir, tmp_path_factory):
    """Answers of a server of a scheme that caches no prompt (one server at a
    time: the last scheme's)."""
    servers, answers = {}, {}

    def answer(question, scheme=QUANTIZED, doc=DOC):
        if (scheme, question, doc) not in answers:
            if scheme not in servers:
                for server in servers.values():
                    server.stop()
                servers.clear()
                servers[scheme] = Server(
                    model_dir,
                    tmp_path_factory.mktemp("ref"),
                    *kv_args(scheme),
                    "--prompt-cache-size",
                    "0",
                )
            text, usage = chat(servers[scheme].url, question, doc)
            assert cached(usage) == 0
            answers[scheme, question, doc] = text
        return answers[scheme, question, doc]

    yield answer
    for server in servers.values():
        server.stop()


def stored_prefix(model_dir, first, second) -> int:
    """The tokens of ``second``'s prompt that the disk holds after ``first``:
    whole blocks and the end of the system prompt (where the server stores a
    cache) within their common prefix."""
    tokenizer = load_tokenizer(model_dir)
    a, b = (
        tokenizer.apply_chat_template(messages(q), add_generation_prompt=True)
        for q in (first, second)
    )
    system = tokenizer.apply_chat_template(
        [messages(first)[0], {"role": "user", "content": ""}]
    )
    system_end = next(i for i, (x, y) in enumerate(zip(system, a)) if x != y)
    common = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
    common = min(common, len(b) - 1)
    return max(common // B * B, system_end if system_end <= common else 0)


@pytest.mark.parametrize("scheme", SCHEMES)
def test_restart_restores_shared_prefix(model_dir, tmp_path, reference, scheme):
    cache_dir = tmp_path / "cache"
    args = (*kv_args(scheme), "--prompt-cache-dir", str(cache_dir))
    with Server(model_dir, tmp_path, *args) as s:
        _, usage = chat(s.url, QUESTIONS[0])
        assert cached(usage) == 0
        wait_for_blocks(cache_dir, usage["prompt_tokens"] // B)
        assert s.lines("not storing") == []
    with Server(model_dir, tmp_path, *args) as s:
        answer, usage = chat(s.url, QUESTIONS[1])
        assert s.lines("disk prompt cache: restored")
    restored = stored_prefix(model_dir, *QUESTIONS[:2])
    assert restored >= 3 * B
    assert cached(usage) == restored
    if KVSpec.parse(scheme).recent:
        # The server batches every request's cache, and a batch writes a
        # residual's held tokens to its pages: after a prompt-cache hit, from
        # memory or disk, the answer may differ from one computed from
        # scratch (test_disk_cache checks that the restored store is the
        # stored one).
        assert answer
    else:
        assert answer == reference(QUESTIONS[1], scheme)


def test_corrupt_block_is_skipped_and_removed(model_dir, tmp_path, reference):
    cache_dir = tmp_path / "cache"
    args = (*kv_args(QUANTIZED), "--prompt-cache-dir", str(cache_dir))
    with Server(model_dir, tmp_path, *args) as s:
        _, usage = chat(s.url, QUESTIONS[0])
        wait_for_blocks(cache_dir, usage["prompt_tokens"] // B)
    blocks = block_files(cache_dir)
    victim = blocks[2]
    corrupt(victim)
    corrupted = victim.read_bytes()
    with Server(model_dir, tmp_path, *args) as s:
        answer, usage = chat(s.url, QUESTIONS[2])
        wait_for_blocks(cache_dir, len(blocks))
        warnings = s.lines(" - WARNING - ")
    assert len(warnings) == 1 and victim.name in warnings[0]
    assert "skipped and removed" in warnings[0]
    assert cached(usage) == 2 * B
    assert answer == reference(QUESTIONS[2])
    # the request stored the block again, from its own computation
    assert victim.read_bytes() != corrupted
    assert check_directory(cache_dir)[1] == []


def test_kill_during_writes_keeps_every_stored_block(model_dir, tmp_path):
    """SIGKILL while a request loop makes the server write float blocks (the
    largest): no stored block is lost or reads back wrong."""
    cache_dir = tmp_path / "cache"
    docs = [f"Report {i}: " + DOC.replace("northern", f"line-{i}") for i in range(40)]
    question = QUESTIONS[0]
    answers = {}
    server = Server(model_dir, tmp_path, "--prompt-cache-dir", str(cache_dir))

    def loop():
        for i, doc in enumerate(docs):
            try:
                answers[i] = chat(server.url, question, doc)
            except requests.RequestException:
                return

    thread = threading.Thread(target=loop)
    thread.start()
    deadline = time.monotonic() + 120
    writing = False
    while time.monotonic() < deadline and thread.is_alive():
        writing = any(cache_dir.glob("*/*.tmp"))
        if writing and len(answers) >= 3:
            break
        time.sleep(0.001)
    server.kill()
    thread.join()
    print(f"killed after {len(answers)} answers, a block being written: {writing}")

    good, bad = check_directory(cache_dir)
    assert bad == []
    assert good >= 3
    with Server(model_dir, tmp_path, "--prompt-cache-dir", str(cache_dir)) as s:
        assert not list(cache_dir.glob("*/*.tmp"))
        hits = 0
        for i, (answer, _) in answers.items():
            again, usage = chat(s.url, question, docs[i])
            assert again == answer
            hits += cached(usage) > 0
    assert hits >= 2
    assert s.lines(" - WARNING - ") == []


@pytest.fixture
def small_tmpfs(tmp_path):
    directory = tmp_path / "tmpfs"
    directory.mkdir()
    mount = ["mount", "-t", "tmpfs", "-o", "size=1536k", "tmpfs", str(directory)]
    if subprocess.run(mount, capture_output=True, check=False).returncode:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    yield directory
    subprocess.run(["umount", str(directory)], check=True)


@pytest.mark.parametrize("limit", ["tmpfs", "file-size"])
def test_full_disk_stops_writing_not_serving(
    model_dir, tmp_path, reference, request, limit
):
    """A 1.5 MiB tmpfs holds one bits=8,4 block (1.4 MB: 645 KB of pages and
    737 KB of the first 16 tokens kept in float32): ENOSPC on the second.
    RLIMIT_FSIZE below a block's size: EFBIG on the first."""
    if limit == "tmpfs":
        cache_dir, limit_file_size = request.getfixturevalue("small_tmpfs"), None
    else:
        cache_dir, limit_file_size = tmp_path / "cache", 300_000
    args = (*kv_args(QUANTIZED), "--prompt-cache-dir", str(cache_dir))
    with Server(model_dir, tmp_path, *args, limit_file_size=limit_file_size) as s:
        answers = [chat(s.url, q)[0] for q in QUESTIONS[:2]]
        failures = s.lines("cannot write")
        assert s.proc.poll() is None
    assert answers == [reference(q) for q in QUESTIONS[:2]]
    assert len(failures) == 1 and "serving goes on" in failures[0]
    assert not list(cache_dir.glob("*/*.tmp"))
    assert check_directory(cache_dir)[1] == []
