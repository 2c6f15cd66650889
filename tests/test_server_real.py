"""The patched mlx_lm.server on the real SmolLM2, over HTTP on 127.0.0.1.

The server runs as its own process, as `make serve` starts it; clients are
`requests` and the `openai` package. With `--kv-bits 8,4` the server keeps
batching on (also with `--max-kv-size`): concurrent greedy requests must get the
answers they get alone.
"""

import collections
import concurrent.futures
import itertools
import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import openai
import pytest
import requests

QUESTIONS = [
    "What is the capital of France?",
    "Name a primary color.",
    "What is 2 + 2?",
]
# answers long enough that streams served as a batch overlap in time whatever
# the order in which the requests reach the server
LONG_ANSWERS = [
    "Count from one to thirty in words.",
    "List the twelve months of the year.",
    "Write three sentences about the sea.",
]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Debian's OpenBLAS, preloaded as `make serve` does where it is installed: the
# BLAS bundled in mlx-cpu takes a minute for a few hundred prompt tokens
OPENBLAS = Path("/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0")


# each server's log, by its URL
LOGS = {}


def start_server(model_dir, hub, *extra):
    """The server as `make serve` runs it, on a free port; yields its URL."""
    port = free_port()
    LOGS[f"http://127.0.0.1:{port}"] = hub / f"server-{port}.log"
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_HUB_CACHE=str(hub))
    if OPENBLAS.exists():
        env["LD_PRELOAD"] = str(OPENBLAS)
    command = [sys.executable, "-m", "mlx_lm.server", "--model", str(model_dir)]
    command += ["--host", "127.0.0.1", "--port", str(port), "--max-tokens", "12"]
    with open(hub / f"server-{port}.log", "w") as log:
        proc = subprocess.Popen(
            [*command, *extra], env=env, stdout=log, stderr=subprocess.STDOUT
        )
        try:
            yield wait_until_ready(f"http://127.0.0.1:{port}", proc, log.name)
        finally:
            proc.terminate()
            proc.wait(timeout=30)


@pytest.fixture(scope="module")
def server(smollm2_dirs, tmp_path_factory):
    hub = tmp_path_factory.mktemp("hub")
    yield from start_server(smollm2_dirs[1], hub, "--kv-bits", "8,4")


@pytest.fixture
def fresh_server(smollm2_dirs, tmp_path_factory):
    """A server with an empty prompt cache, started with the given arguments."""
    servers = []

    def start(*extra):
        servers.append(
            start_server(smollm2_dirs[1], tmp_path_factory.mktemp("hub"), *extra)
        )
        return next(servers[-1])

    yield start
    for server in servers:
        server.close()


def wait_until_ready(url, proc, log_name, timeout=120):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"server exited: {Path(log_name).read_text()}")
        try:
            if requests.get(f"{url}/health", timeout=1).ok:
                return url
        except requests.ConnectionError:
            time.sleep(0.5)
    pytest.fail(f"server did not start within {timeout} s")


def chat_request(question, **extra):
    """The body of a short greedy chat completion."""
    return {
        "messages": [{"role": "user", "content": question}],
        "max_tokens": 12,
        "temperature": 0.0,
        **extra,
    }


def ask(url, question, **extra):
    response = requests.post(
        f"{url}/v1/chat/completions", json=chat_request(question, **extra), timeout=300
    )
    response.raise_for_status()
    return response.json()["choices"][0]["message"]["content"]


def ask_streaming(url, question, **extra):
    """(the answer's streamed pieces, time of its first piece, time of its
    last), streamed."""
    response = requests.post(
        f"{url}/v1/chat/completions",
        json=chat_request(question, stream=True, **extra),
        stream=True,
        timeout=300,
    )
    response.raise_for_status()
    parts, times = [], []
    for line in response.iter_lines():
        if not line.startswith(b"data: {"):
            continue
        delta = json.loads(line[len(b"data: ") :])["choices"][0]["delta"]
        if delta.get("content"):
            parts.append(delta["content"])
            times.append(time.monotonic())
    return parts, times[0], times[-1]


def test_openai_client_chat(server):
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="none")
    reply = client.chat.completions.create(
        model="default_model",
        messages=[{"role": "user", "content": QUESTIONS[0]}],
        max_tokens=12,
        temperature=0.0,
    )
    assert "Paris" in reply.choices[0].message.content


def test_concurrent_clients_get_their_own_answers(server):
    alone = [ask(server, q) for q in QUESTIONS]
    with concurrent.futures.ThreadPoolExecutor(len(QUESTIONS)) as pool:
        together = list(pool.map(lambda q: ask(server, q), QUESTIONS))
    assert "Paris" in alone[0]
    assert together == alone


# A multi-turn chat replayed with fixed assistant turns, so that both servers
# see the same prompts whatever they generate.
CHAT = [
    ("user", "Hi! Can you help me plan a picnic?"),
    ("assistant", "Of course. Where and when would you like to have it?"),
    ("user", "In a park on Saturday. What food should I bring?"),
    ("assistant", "Sandwiches, fruit, lemonade and some cookies travel well."),
    ("user", "Great. And what games could we play?"),
]


def replay(url):
    """(prompt tokens, cached prompt tokens) of each user turn."""
    usage = []
    for turn in range(1, len(CHAT) + 1, 2):
        messages = [{"role": r, "content": c} for r, c in CHAT[:turn]]
        response = requests.post(
            f"{url}/v1/chat/completions",
            json={"messages": messages, "max_tokens": 4, "temperature": 0.0},
            timeout=300,
        )
        response.raise_for_status()
        tokens = response.json()["usage"]
        usage.append(
            (tokens["prompt_tokens"], tokens["prompt_tokens_details"]["cached_tokens"])
        )
    return usage


def test_prompt_cache_hits_match_fp16(fresh_server):
    quantized = replay(fresh_server("--kv-bits", "8,4"))
    fp16 = replay(fresh_server())
    assert quantized == fp16
    # later turns reuse the cached conversation
    assert all(cached > 0 for _, cached in quantized[1:])


# A batch's answers are those given alone for their first SAME_TOKENS tokens,
# or part from them at a near tie: two likeliest tokens within NEAR_TIE nats
# of each other. A batch's float32 matmuls round differently from one
# sequence's in the last bits (BLAS blocks by shape; a quantized cache can
# turn that into another code for a key): with 8,4 in a 32-token window,
# SmolLM2 puts " teeming" 0.0009 nats above " where" at the tenth token of
# "Write three sentences about the sea.", and a batch took " where". Past 16
# tokens answers have parted at wider margins too (0.16-0.48 nats, before
# prefill multiplied dequantized tiles on the CPU). An answer asked again, its
# prompt's prefix from the prompt cache, rounds differently the same way
# (OpenBLAS sums a prompt's rows in another order in another chunk): 8,4 with
# centered keys parted from its first answer, alone and in a batch alike, at
# 0.071 nats.
SAME_TOKENS = 16
NEAR_TIE = 0.1


@pytest.fixture(scope="module")
def tokenizer(smollm2_dirs):
    from mlx_lm.utils import load_tokenizer

    return load_tokenizer(smollm2_dirs[1])


def answer_with_margins(url, question, max_tokens):
    """(the answer's tokens, the margin between the two likeliest tokens at
    each), from the server's logprobs."""
    body = chat_request(question, max_tokens=max_tokens, logprobs=True, top_logprobs=2)
    response = requests.post(f"{url}/v1/chat/completions", json=body, timeout=300)
    response.raise_for_status()
    steps = [
        s["top_logprobs"] for s in response.json()["choices"][0]["logprobs"]["content"]
    ]
    tokens = [max(step, key=lambda t: t["logprob"])["id"] for step in steps]
    margins = [abs(a["logprob"] - b["logprob"]) for a, b in steps]
    return tokens, margins


def parting_token(tokenizer, tokens, text, other):
    """The index of the first of ``tokens`` (decoded: ``text``) that ``other``
    does not begin with, or None."""
    common = len(os.path.commonprefix([text, other]))
    if common == len(text):
        return None
    return next(
        i
        for i in range(len(tokens))
        if len(tokenizer.decode(tokens[: i + 1], skip_special_tokens=True)) > common
    )


def assert_batched_as_alone(url, tokenizer):
    """Concurrent long answers are those given alone (``SAME_TOKENS``), served
    as a batch; the answers alone, streamed."""
    ties = [answer_with_margins(url, q, 40) for q in LONG_ANSWERS]
    alone = [ask_streaming(url, q, max_tokens=40)[0] for q in LONG_ANSWERS]
    with concurrent.futures.ThreadPoolExecutor(len(LONG_ANSWERS)) as pool:
        together = list(
            pool.map(lambda q: ask_streaming(url, q, max_tokens=40), LONG_ANSWERS)
        )
    for (parts, _, _), answer, (tokens, margins) in zip(together, alone, ties):
        text = "".join(answer)
        # the same answer asked twice alone, the second from the prompt cache:
        # with OpenBLAS a prompt's rows are summed in another order when its
        # prefix comes from the cache, and a quantized cache can turn that
        # rounding into another code: the answers part at a near tie at most
        first = tokenizer.decode(tokens, skip_special_tokens=True)
        parted = parting_token(tokenizer, tokens, first, text)
        if parted is not None and parted < SAME_TOKENS:
            assert margins[parted] < NEAR_TIE, (parted, margins[parted], first, text)
        parted = parting_token(tokenizer, tokens, text, "".join(parts))
        if parted is not None and parted < SAME_TOKENS:
            assert margins[parted] < NEAR_TIE, (parted, text, "".join(parts))
    # served as a batch: streams ran at the same time (one at a time, each
    # would start after the one before it ended)
    spans = [(first, last) for _, first, last in together]
    assert any(
        max(a[0], b[0]) < min(a[1], b[1]) for a, b in itertools.combinations(spans, 2)
    )
    return alone


def test_bounded_quantized_server_batches(fresh_server, tokenizer):
    # a 32-token window, shorter than the prompts (35-38 tokens): prefill and
    # decode both wrap the quantized rotating caches
    url = fresh_server("--max-kv-size", "32", "--kv-bits", "8,4")
    alone = assert_batched_as_alone(url, tokenizer)
    assert all(len(parts) >= 16 for parts in alone)


# With the chat template, 284 tokens: more than twice a 128-token window
LONG_PROMPT = (
    "The quick brown fox jumps over the lazy dog. " * 25 + "What animal jumps?"
)


def collapsed(answer):
    """Whether ``answer`` degenerated: under five words, or a pair of words
    said three times or more."""
    words = re.findall(r"[a-z']+", answer.lower())
    pairs = collections.Counter(itertools.pairwise(words))
    return len(words) < 5 or max(pairs.values()) >= 3


def test_bounded_server_keeps_first_tokens(fresh_server):
    # A batched rotating cache keeps each sequence's first 4 tokens, as
    # mlx_lm.generate's does: without them, answers to prompts longer than
    # the window collapse into repetitions, quantized or not.
    flags = {
        "fp16": (),
        "8": ("--kv-bits", "8"),
        "4": ("--kv-bits", "4"),
        "plain 4": ("--kv-bits", "4", "--kv-cache-config", "rotate=none first=0"),
    }
    answers = {}
    for name, extra in flags.items():
        url = fresh_server("--max-kv-size", "128", *extra)
        answers[name] = ask(url, LONG_PROMPT, max_tokens=16)
    assert answers["8"] == answers["fp16"], answers
    assert not any(map(collapsed, answers.values())), answers


def test_scheme_served_through_kv_cache_hook(fresh_server):
    # q4 (weighted keys, a recent window), with fp16's greedy answers to
    # these questions
    fp16 = [ask(fresh_server(), q) for q in QUESTIONS]
    url = fresh_server("--kv-cache", "omlx", "--kv-cache-config", "q4")
    with concurrent.futures.ThreadPoolExecutor(len(QUESTIONS)) as pool:
        together = list(pool.map(lambda q: ask(url, q), QUESTIONS))
    assert together == fp16


@pytest.mark.parametrize(
    "config", ["bits=8,4 center=k", "q4", "q4-recall", "bits=4 codec=codebook"]
)
def test_schemes_and_presets_are_batched(fresh_server, tokenizer, config):
    # centering, key weights, first tokens, a residual, codebooks: the
    # server merges them into one batch, each answer as it is alone
    assert_batched_as_alone(
        fresh_server("--kv-cache", "omlx", "--kv-cache-config", config), tokenizer
    )


@pytest.mark.parametrize(
    "flags, error",
    [
        (
            ("--kv-cache-config", "bits=4 centre=k"),
            "--kv-cache: --kv-cache-config 'bits=4 centre=k': Unknown scheme item",
        ),
        (
            ("--kv-bits", "4", "--kv-cache-config", "q4"),
            "--kv-bits 4 and --kv-cache-config 'q4' both set the bits",
        ),
        (("--kv-group-size", "32"), "--kv-group-size needs --kv-bits"),
        (("--kv-bits", "3", "--kv-group-size", "48"), "argument --kv-group-size"),
        (("--kv-bits", "9"), "argument --kv-bits"),
        (("--kv-cache-config", "bits=4 rotate=q"), "rotate='q': one of kv, k, v, none"),
        (("--kv-cache", "no-such-cache"), "argument --kv-cache: no installed package"),
        (("--prompt-cache-disk-bytes", "lots"), "argument --prompt-cache-disk-bytes"),
        (("--prompt-cache-dir", "/etc/hostname"), "argument --prompt-cache-dir"),
        (("--kv-rotate", "q"), "unrecognized arguments: --kv-rotate"),
        (("--kv-cache-budget", "lots"), "argument --kv-cache-budget: expected auto"),
    ],
)
def test_bad_kv_cache_flags_are_named(smollm2_dirs, tmp_path, flags, error):
    # each refused when parsed, before the server starts, with a line naming it
    command = [sys.executable, "-m", "mlx_lm", "server", "--model"]
    command += [str(smollm2_dirs[1]), *flags]
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_HUB_CACHE=str(tmp_path))
    done = subprocess.run(
        command, check=False, env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 2, done.stderr
    assert error in done.stderr
    assert "Traceback" not in done.stderr and "Starting httpd" not in done.stderr


def test_kv_cache_budget_refuses_what_never_fits(fresh_server):
    # SmolLM2 float32 caches take 46,080 bytes a token: 2.5 MB hold one of
    # these requests (about 36 prompt tokens and 12 more) at a time, so the
    # others wait for it to finish; a 600-token prompt can never fit
    url = fresh_server("--kv-cache-budget", "2.5MB")
    alone = [ask(url, q) for q in QUESTIONS]
    long_prompt = " ".join(["The sky is blue."] * 120)
    refused = requests.post(
        f"{url}/v1/chat/completions", json=chat_request(long_prompt), timeout=300
    )
    assert refused.status_code == 413
    error = refused.json()["error"]
    assert "more than the server's budget of 2.5 MB (--kv-cache-budget)" in error
    with concurrent.futures.ThreadPoolExecutor(len(QUESTIONS)) as pool:
        together = list(pool.map(lambda q: ask(url, q), QUESTIONS))
    assert together == alone and "Paris" in alone[0]
    log = LOGS[url].read_text()
    assert "KV cache budget: 2.5 MB, 46,080 bytes per token" in log
    assert "A request waits for KV cache memory" in log
