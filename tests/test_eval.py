"""Tests for omlx_cache.eval on a tiny random llama."""

import json

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import KVCache, make_prompt_cache
from tiny_llama import CONFIG, make_model

from omlx_cache import eval as kv_eval
from omlx_cache.kv.spec import KVSpec

TEXT = (
    "The quick brown fox jumps over the lazy dog.\r\n"
    "A tiny model reads a tiny text, one token after another.\r\n"
) * 40


def tiny_model():
    return make_model()


@pytest.fixture(scope="module")
def model():
    return tiny_model()


@pytest.fixture(scope="module")
def windows():
    tokens = np.random.default_rng(0).integers(2, CONFIG["vocab_size"], size=400)
    return kv_eval.make_windows(tokens.tolist(), 2, 96, bos=1)


def by_name(results):
    return {r["kv"]: r for r in results}


def scheme(name, max_kv_size=None):
    return kv_eval.Scheme(KVSpec.parse(name), max_kv_size)


@pytest.fixture(scope="module")
def results(model, windows):
    names = ["fp16", "8", "4", "8,4"]
    kv = [scheme(name) for name in names]
    # the reference scheme again, run separately, must match itself exactly
    kv.insert(1, scheme("fp16"))
    results = kv_eval.evaluate_tokens(model, windows, kv, chunk=32)
    return results


def test_reference_against_itself(results):
    for r in results[:2]:
        assert r["kv"] == "fp16"
        assert r["kld"] == 0.0
        assert r["top1"] == 100.0
        assert r["delta_ppl_pct"] == 0.0
    assert results[0]["reference"] and not results[1]["reference"]
    assert results[0]["ppl"] == results[1]["ppl"]


def test_quantized_closer_with_more_bits(results):
    r = by_name(results[2:])
    assert 0 < r["8"]["kld"] < 1e-4
    # values dominate on random weights: 8,4 is about as far off as 4
    assert r["8"]["kld"] < r["8,4"]["kld"] / 10
    assert r["8"]["kld"] < r["4"]["kld"] / 10
    assert r["8"]["top1"] >= r["4"]["top1"]
    assert r["8"]["top1"] > 95
    assert abs(r["8"]["delta_ppl_pct"]) < 0.1


def test_token_counts_and_bits(results):
    r = by_name(results[2:])
    for x in results:
        assert x["tokens"] == 2 * 95
    # everything a 4,096-token sequence stores, as a 16-bit model stores it:
    # 8,4 (rotated) keeps its first 16 tokens too
    assert r["8"]["bits_per_element"] == 8.5
    # (the first tokens cost 16 bits instead of their quantized copy's)
    assert r["8,4"]["bits_per_element"] == 6.5 + 16 * (16 - 6.5) / 4096
    assert r["8,4"]["spec"] == "bits=8,4" and r["8,4"]["kept_tokens"] == 16
    # 2 layers x 2 kv heads x 64 dims, keys and values, 16 bits
    assert results[0]["cache_bytes_per_token"] == 2 * 2 * 64 * 2 * 2
    assert all(x["cache_allocated_bytes"] > 0 for x in results)


def test_intervals_contain_values(results):
    for r in results:
        for key in ("ppl", "delta_ppl_pct", "kld", "top1"):
            lo, hi = r[f"{key}_ci"]
            assert lo <= r[key] <= hi


def test_chunked_matches_full_forward(model, windows):
    tokens = windows[0]
    full = model(tokens[None, :-1])[0].astype(mx.float32)
    full = full - mx.logsumexp(full, axis=-1, keepdims=True)
    cache = make_prompt_cache(model)
    assert all(type(c) is KVCache for c in cache)
    chunked = kv_eval.window_logprobs(model, tokens, cache, chunk=13)
    assert chunked.shape == full.shape
    assert mx.allclose(chunked, full, atol=1e-4, rtol=1e-4).item()


def test_make_windows():
    tokens = list(range(10, 30))
    w = kv_eval.make_windows(tokens, 3, 5, bos=1).tolist()
    assert w == [[1, 10, 11, 12, 13], [1, 14, 15, 16, 17], [1, 18, 19, 20, 21]]
    w = kv_eval.make_windows(tokens, 2, 5).tolist()
    assert w == [[10, 11, 12, 13, 14], [15, 16, 17, 18, 19]]
    with pytest.raises(ValueError, match="need 24"):
        kv_eval.make_windows(tokens, 4, 7, bos=1)


def test_resolve_schemes_puts_reference_first():
    names = [str(s) for s in kv_eval.resolve_schemes(["8", "4", "fp16", "bits=8"])]
    assert names == ["fp16", "8", "4"]
    names = [str(s) for s in kv_eval.resolve_schemes(["4"])]
    assert names == ["fp16", "4"]
    with pytest.raises(SystemExit):
        kv_eval.parse_args(["--kv", "bits=4 rotat=k"])


def test_read_text(tmp_path):
    path = tmp_path / "text.raw"
    path.write_bytes(b"a\r\nb\r\n")
    assert kv_eval.read_text(path) == "a\nb\n"
    with pytest.raises(FileNotFoundError, match="--text"):
        kv_eval.read_text(tmp_path / "missing.raw")


def write_model_dir(path, model):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    path.mkdir()
    (path / "config.json").write_text(json.dumps(CONFIG))
    model.save_weights(str(path / "model.safetensors"))
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=CONFIG["vocab_size"],
        special_tokens=["<unk>", "<s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator([TEXT.replace("\r\n", "\n")], trainer)
    tokenizer.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(
        json.dumps({"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>"})
    )


def model_and_text(tmp_path, model) -> list[str]:
    """``--model DIR --text FILE`` for the tiny model and text, written out."""
    write_model_dir(tmp_path / "tiny", model)
    text = tmp_path / "text.raw"
    text.write_bytes(TEXT.encode())
    return ["--model", str(tmp_path / "tiny"), "--text", str(text)]


def test_main_writes_json(tmp_path, model, capsys):
    out = tmp_path / "out" / "eval.json"
    argv = [*model_and_text(tmp_path, model), "--kv", "4"]
    argv += ["--windows", "2", "--window-tokens", "48", "--chunk", "16"]
    kv_eval.main([*argv, "--out", str(out)])

    report = json.loads(out.read_text())
    for key in ("model", "text", "windows", "window_tokens", "chunk", "date"):
        assert key in report
    assert set(report["versions"]) >= {"mlx", "mlx_lm"}
    assert report["bos"] == 1
    assert [r["kv"] for r in report["results"]] == ["fp16", "4"]
    for r in report["results"]:
        assert r["tokens"] == 2 * 47
        for key in ("ppl", "ppl_ci", "delta_ppl_pct", "kld", "kld_ci", "top1"):
            assert key in r
        assert r["bits_per_element"] > 0
    table = capsys.readouterr().out
    assert "| fp16 |" in table and "| 4 |" in table
    capsys.readouterr()
    kv_eval.main(["--table", str(out)])
    short = capsys.readouterr().out
    assert "| fp16 | 16.000 | ref (PPL" in short and "| 4 | 4.598 | " in short


def test_kept_tokens_and_bounded_context(model, windows):
    kept4 = "bits=4 first=4 center=none qscale=none"
    kv = [scheme(name) for name in ("fp16", "bits=4 first=0", kept4)]
    r = by_name(kv_eval.evaluate_tokens(model, windows[:1], kv, chunk=32))
    # the kept tokens make the 4-bit cache closer to fp16
    assert r[kept4]["kld"] < r["bits=4 first=0"]["kld"]
    assert r[kept4]["kept_tokens"] == 4
    assert r[kept4]["bits_per_element"] == 4.5 + 4 * (16 - 4.5) / 4096
    # the kept tokens cost 16 bits instead of 4.5: 4 tokens of 2 layers x 2 kv
    # heads x 64 dims, keys and values, spread over the window's 95 tokens
    kept = 4 * 2 * 2 * 64 * 2 * (16 - 4.5) / 8 / 95
    extra = (
        r[kept4]["cache_bytes_per_token"] - r["bits=4 first=0"]["cache_bytes_per_token"]
    )
    assert extra == pytest.approx(kept)
    # a bounded context, fp16's too: every layer holds at most 32 tokens. Our
    # stores keep the 4 sinks in view of every query, mlx-lm's rotating cache
    # only of the queries whose window reaches them in a prefill chunk: the
    # unquantized store (bits=16) shows what that alone does, and 8-bit adds
    # little to it
    bounded = [scheme(name, 32) for name in ("fp16", "bits=16", "8")]
    r = kv_eval.evaluate_tokens(model, windows[:1], bounded, chunk=32)
    assert [x["kv"] for x in r[1:]] == [
        "bits=16 @ max-kv-size 32",
        "8 @ max-kv-size 32",
    ]
    assert r[1]["kld"] > 0 and abs(r[2]["kld"] - r[1]["kld"]) < 1e-3


def test_passkey_prompt(tmp_path, model):
    from mlx_lm import load

    write_model_dir(tmp_path / "tiny", model)
    _, tokenizer = load(str(tmp_path / "tiny"))
    assert kv_eval.passkey_depths(3) == [0.0, 0.5, 1.0]
    assert kv_eval.passkey_key(4096, 2) == kv_eval.passkey_key(4096, 2)
    assert kv_eval.passkey_key(4096, 2) != kv_eval.passkey_key(8192, 2)
    needle_at = []
    for depth in (0.0, 0.5, 1.0):
        p = kv_eval.passkey_prompt(tokenizer, 400, depth, "68755", bos=1)
        assert p.tokens[0] == 1
        # whole filler lines: at most one short of the context
        filler = len(kv_eval.encode(tokenizer, kv_eval.PASSKEY_FILLER))
        assert 400 - filler < len(p.tokens) + len(p.answer) <= 400
        text = tokenizer.decode(p.tokens)
        assert text.endswith(kv_eval.PASSKEY_QUESTION)
        assert tokenizer.decode(p.answer).strip() == "68755"
        needle_at.append(text.index("The pass key is 68755"))
    assert needle_at == sorted(needle_at) and needle_at[0] < needle_at[-1]
    with pytest.raises(ValueError, match="needs more than"):
        kv_eval.passkey_prompt(tokenizer, 30, 0.5, "68755")
    with pytest.raises(ValueError, match="1 or more"):
        kv_eval.passkey_depths(0)


def test_main_dtype_and_passkey(tmp_path, model, capsys):
    out = tmp_path / "eval.json"
    argv = [*model_and_text(tmp_path, model), "--kv", "bits=8,4 first=4"]
    argv += ["--windows", "1", "--window-tokens", "48", "--chunk", "16"]
    argv += ["--dtype", "bfloat16", "--passkey", "300,400", "--passkey-depths", "2"]
    kv_eval.main([*argv, "--passkey-chunk", "64", "--out", str(out)])

    report = json.loads(out.read_text())
    assert report["dtype"] == "bfloat16"
    assert report["passkey_depths"] == [0.0, 1.0]
    for r in report["results"]:
        assert list(r["passkey"]) == ["300", "400"]
        for trials in r["passkey"].values():
            assert trials["trials"] == 2
            assert trials["correct"] == sum(t["correct"] for t in trials["runs"])
            assert [t["depth"] for t in trials["runs"]] == [0.0, 1.0]
            assert all(t["tokens"] <= 400 for t in trials["runs"])
    # a bfloat16 model against its own bfloat16 cache
    assert report["results"][0]["kld"] == 0.0
    printed = capsys.readouterr().out
    assert "| passkey |" in printed and "300: " in printed
    with pytest.raises(SystemExit):
        kv_eval.parse_args(["--passkey", "4096,x"])
    with pytest.raises(SystemExit):
        kv_eval.parse_args(["--passkey", "4096", "--passkey-keys", "0"])


def test_passkey_keys_pair_with_the_reference(tmp_path, model):
    from mlx_lm import load

    write_model_dir(tmp_path / "tiny", model)
    model, tokenizer = load(str(tmp_path / "tiny"))
    found = kv_eval.model_schemes(model, kv_eval.resolve_schemes(["4"]))
    results = kv_eval.evaluate_passkey(
        model, tokenizer, found, [300], [0.0, 1.0], chunk=64, keys=2
    )
    runs = results[0]["300"]["runs"]
    assert results[0]["300"]["trials"] == 4 and "vs_reference" not in results[0]["300"]
    assert [t["depth"] for t in runs] == [0.0, 1.0, 0.0, 1.0]
    assert len({t["key"] for t in runs}) == 4
    # the first key per depth is the one a run of one key per depth uses
    assert runs[1]["key"] == kv_eval.passkey_key(300, 1)
    vs = results[1]["300"]["vs_reference"]
    assert set(vs) == {"lost", "gained", "p", "logprob_delta", "logprob_delta_se"}
    assert 0 <= vs["p"] <= 1
    for result in results:
        runs = result["300"]["runs"]
        assert result["300"]["found"] == sum(t["found"] for t in runs)
        for t in runs:
            # a miss carries the greedy answer it was judged on
            assert t["correct"] or isinstance(t["answer"], str)
            assert t["found"] == (t["correct"] or t["key"] in t["answer"])
    assert set(results[1]["300"]["found_vs_reference"]) == {"lost", "gained", "p"}
    assert set(results[1]["300"]["digits_vs_reference"]) == {"lost", "gained", "p"}
    for result in results:
        runs = result["300"]["runs"]
        assert result["300"]["digits"] == sum(t["digits"] for t in runs)
        for t in runs:
            # every token right means the digits are; a stored trial scores the same
            assert t["digits"] or not t["correct"]
            assert t["digits"] == kv_eval.digits_retrieved(tokenizer, t)


def test_digit_positions_hold_the_key(tmp_path, model):
    from mlx_lm import load

    write_model_dir(tmp_path / "tiny", model)
    _, tokenizer = load(str(tmp_path / "tiny"))
    for key in ("80365", "10000", "99999"):
        answer = kv_eval.answer_tokens(tokenizer, key)
        positions = kv_eval.digit_positions(tokenizer, answer)
        digits = [tokenizer.decode([answer[i]]) for i in positions]
        assert "".join(c for text in digits for c in text if c.isdigit()) == key
        others = [
            tokenizer.decode([t]) for i, t in enumerate(answer) if i not in positions
        ]
        assert not any(c.isdigit() for text in others for c in text)


@pytest.mark.parametrize("name", ["fp16", "codec=codebook bits=4 center=k first=4"])
def test_passkey_answer_decodes_its_own_tokens(tmp_path, model, name):
    from mlx_lm import load
    from mlx_lm.generate import generate_step

    write_model_dir(tmp_path / "tiny", model)
    model, tokenizer = load(str(tmp_path / "tiny"))
    prompt = kv_eval.passkey_prompt(tokenizer, 300, 0.5, "68755", bos=1)
    spec = KVSpec.parse(name)
    answer = kv_eval.passkey_answer(model, prompt, spec.make_cache(model), 64, 6)
    trial = kv_eval.passkey_trial(model, prompt, spec.make_cache(model), 64)
    assert answer[0] == trial["predicted"][0]
    # what generate_step writes greedily with the same cache and prefill step
    steps = generate_step(
        mx.array(prompt.tokens),
        model,
        max_tokens=6,
        prompt_cache=spec.make_cache(model),
        prefill_step_size=64,
    )
    assert answer == [int(token) for token, _ in steps]


def test_answer_has_key():
    assert kv_eval.answer_has_key(" 68755", "68755")
    assert kv_eval.answer_has_key(" the 68755. Remember", "68755")
    assert not kv_eval.answer_has_key(" 168755", "68755")
    assert not kv_eval.answer_has_key(" 687550", "68755")
    assert not kv_eval.answer_has_key(" 6875", "68755")


@pytest.mark.parametrize(
    "name",
    ["fp16", "bits=4 center=k qscale=qk first=4", "codec=codebook bits=4 center=k"],
)
def test_passkey_trial_needs_the_last_chunks_logits_only(tmp_path, model, name):
    from mlx_lm import load

    write_model_dir(tmp_path / "tiny", model)
    model, tokenizer = load(str(tmp_path / "tiny"))
    prompt = kv_eval.passkey_prompt(tokenizer, 300, 0.5, "68755", bos=1)
    spec = KVSpec.parse(name)
    trial = kv_eval.passkey_trial(model, prompt, spec.make_cache(model), 64)

    # every chunk's logits evaluated, then the key's tokens fed one at a time
    cache = spec.make_cache(model)
    tokens = mx.array(prompt.tokens)
    for start in range(0, tokens.size, 64):
        logits = model(tokens[None, start : start + 64], cache=cache)[0, -1]
        mx.eval(logits)
    predicted, logprob = [], 0.0
    for i, target in enumerate(prompt.answer):
        if i:
            logits = model(mx.array([[prompt.answer[i - 1]]]), cache=cache)[0, -1]
        logprobs = logits.astype(mx.float32) - mx.logsumexp(logits.astype(mx.float32))
        predicted.append(int(mx.argmax(logprobs).item()))
        logprob += logprobs[target].item()
    assert trial["predicted"] == predicted
    assert trial["answer_logprob"] == logprob


def test_scheme_that_does_not_fit_fails_first(tmp_path, model):
    out = tmp_path / "eval.json"
    argv = [*model_and_text(tmp_path, model), "--kv", "4"]
    argv += ["--kv", "bits=4 group=128", "--windows", "1", "--window-tokens", "48"]
    with pytest.raises(SystemExit, match="'bits=4 group=128' does not fit the model"):
        kv_eval.main([*argv, "--out", str(out)])
    assert not out.exists()


def test_paired_outcomes():
    def runs(bits):
        return [{"correct": b == "1"} for b in bits]

    same = kv_eval.paired_outcomes(runs("1100"), runs("1100"))
    assert same == {"lost": 0, "gained": 0, "p": 1.0}
    vs = kv_eval.paired_outcomes(runs("11111111"), runs("00000001"))
    assert (vs["lost"], vs["gained"]) == (7, 0)
    assert vs["p"] == pytest.approx(2 / 2**7)
    vs = kv_eval.paired_outcomes(runs("1100"), runs("0110"))
    assert (vs["lost"], vs["gained"], vs["p"]) == (1, 1, 1.0)
    r = {"passkey": {"8192": {"correct": 6, "trials": 8, "vs_reference": vs}}}
    assert kv_eval.format_passkey(r) == "8192: 6/8 (-1 +1)"
    r["passkey"]["8192"].update(found=7, found_vs_reference=same)
    assert kv_eval.format_passkey(r) == "8192: 6/8 (-1 +1), in answer 7/8 (-0 +0)"
    r["passkey"]["8192"].update(digits=8, digits_vs_reference=same)
    assert kv_eval.format_passkey(r).endswith(
        "in answer 7/8 (-0 +0), digits 8/8 (-0 +0)"
    )

    def scored(logprobs):
        return [{"correct": True, "answer_logprob": x} for x in logprobs]

    vs = kv_eval.paired_outcomes(scored([-1.0, -2.0, -3.0]), scored([-1.5, -2.0, -4.0]))
    assert vs["logprob_delta"] == pytest.approx(-0.5)
    assert vs["logprob_delta_se"] == pytest.approx(
        np.std([-0.5, 0, -1], ddof=1) / 3**0.5
    )
