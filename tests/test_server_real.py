"""The patched mlx_lm.server on the real SmolLM2, over HTTP on 127.0.0.1.

The server runs as its own process, as `make serve` starts it; clients are
`requests` and the `openai` package. With `--kv-bits 8,4` the server keeps
batching on: concurrent greedy requests must get the answers they get alone.
"""

import concurrent.futures
import os
import socket
import subprocess
import sys
import time

import openai
import pytest
import requests

QUESTIONS = [
    "What is the capital of France?",
    "Name a primary color.",
    "What is 2 + 2?",
]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(smollm2_dirs, tmp_path_factory):
    port = free_port()
    hub = tmp_path_factory.mktemp("hub")
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_HUB_CACHE=str(hub))
    with open(hub / "server.log", "w") as log:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "mlx_lm.server",
                "--model",
                str(smollm2_dirs[1]),
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--kv-bits",
                "8,4",
                "--max-tokens",
                "12",
            ],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        try:
            yield wait_until_ready(f"http://127.0.0.1:{port}", proc, hub)
        finally:
            proc.terminate()
            proc.wait(timeout=30)


def wait_until_ready(url, proc, hub, timeout=120):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"server exited: {(hub / 'server.log').read_text()}")
        try:
            if requests.get(f"{url}/health", timeout=1).ok:
                return url
        except requests.ConnectionError:
            time.sleep(0.5)
    pytest.fail(f"server did not start within {timeout} s")


def ask(url, question):
    response = requests.post(
        f"{url}/v1/chat/completions",
        json={
            "messages": [{"role": "user", "content": question}],
            "max_tokens": 12,
            "temperature": 0.0,
        },
        timeout=300,
    )
    response.raise_for_status()
    return response.json()["choices"][0]["message"]["content"]


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
