"""Tests for omlx_cache.eval and omlx_cache.schemes on a tiny random llama."""

import io
import json

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import KVCache, QuantizedKVCache, make_prompt_cache
from tiny_llama import CONFIG, make_model

from omlx_cache import eval as kv_eval
from omlx_cache import schemes

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


@pytest.fixture(scope="module")
def results(model, windows):
    names = ["fp16", "8", "4", "8,4"]
    kv = [schemes.get_scheme(name) for name in names]
    # the reference scheme again, run separately, must match itself exactly
    kv.insert(1, schemes.get_scheme("fp16"))
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
        assert x["cache_tokens"] == 95
    assert r["8"]["bits_per_element"] == {"k": 8.5, "v": 8.5}
    assert r["8,4"]["bits_per_element"] == {"k": 8.5, "v": 4.5}
    # float32 model: float32 scales and biases, 64 bits a group of 64
    assert r["8,4"]["stored_bits_per_element"] == {"k": 9.0, "v": 5.0}
    assert results[0]["stored_bits_per_element"] == {"k": 32.0, "v": 32.0}
    # 2 layers x 2 kv heads x 64 dims, keys and values
    assert results[0]["cache_bytes_per_token"] == 2 * 2 * 64 * 2 * 4


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


def test_schemes(model):
    s = schemes.get_scheme("8,4", group_size=(64, 32))
    assert s.bits_per_element == (8.5, 5.0)
    caches = s.make_cache(model)
    assert len(caches) == len(model.layers)
    assert all(isinstance(c, QuantizedKVCache) for c in caches)
    assert (caches[0].key_bits, caches[0].value_bits) == (8, 4)
    assert (caches[0].key_group_size, caches[0].value_group_size) == (64, 32)
    assert schemes.get_scheme("fp16").is_reference
    rotated = schemes.get_scheme("4+rotate").make_cache(model)[0]
    assert rotated.rotate is True and rotated.bits == 4
    assert not caches[0].rotate
    assert schemes.parse_group_size("64,32") == (64, 32)
    for bad in ("7", "fp8", "8,4,2", "", "rotate", "4+rot"):
        with pytest.raises(ValueError):
            schemes.get_scheme(bad)


def test_resolve_schemes_puts_reference_first():
    names = [s.name for s in kv_eval.resolve_schemes(["8", "4", "fp16", "8"], 64)]
    assert names == ["fp16", "8", "4"]
    names = [s.name for s in kv_eval.resolve_schemes(["4"], 64)]
    assert names == ["fp16", "4"]


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
        assert set(r["bits_per_element"]) == {"k", "v"}
    table = capsys.readouterr().out
    assert "| fp16 |" in table and "| 4 |" in table
    capsys.readouterr()
    kv_eval.main(["--table", str(out)])
    short = capsys.readouterr().out
    assert "| fp16 | 16 / 16 | ref (PPL" in short and "| 4 | 4.5 / 4.5 | " in short


def test_kept_tokens_scheme(model, windows):
    s = schemes.get_scheme("4+rotate+center+exact4")
    assert s.kept_tokens == 4 and s.bits_per_element == (4.5, 4.5)
    caches = s.make_cache(model)
    assert schemes.average_bits(caches, 4096) == (4.5 + 16 * 4 / 4096,) * 2
    assert (caches[0].keep_exact, caches[0].rotate, caches[0].center) == (4, True, "k")
    windows_ = schemes.windowed(s, 32).make_cache(model)
    assert (windows_[0].keep_exact, windows_[0].max_size) == (4, 32)
    # a window holds 32 tokens, of which the first 4 (keep=4) stay kept
    assert schemes.average_bits(windows_, 4096) == (4.5 + 16 * 4 / 32,) * 2
    no_keep = schemes.windowed(s, 32, keep=0).make_cache(model)
    assert schemes.average_bits(no_keep, 4096) == (4.5, 4.5)
    assert schemes.average_bits(no_keep, 32) == (4.5 + 16 * 4 / 32,) * 2
    # a window that keeps 2 first tokens keeps at most those unquantized
    keep2 = schemes.windowed(s, 32, keep=2).make_cache(model)
    assert keep2[0]._exact_rows() == 2
    for context in (32, 4096):
        assert schemes.average_bits(keep2, context) == (4.5 + 16 * 2 / 32,) * 2

    kv = [schemes.get_scheme(name) for name in ("fp16", "4", "4+exact4")]
    r = by_name(kv_eval.evaluate_tokens(model, windows[:1], kv, chunk=32))
    # the kept tokens make the 4-bit cache closer to fp16
    assert r["4+exact4"]["kld"] < r["4"]["kld"]
    assert r["4+exact4"]["kept_tokens"] == 4
    assert r["4+exact4"]["bits_per_element_at_4096"]["k"] == 4.5 + 16 * 4 / 4096
    assert r["4+exact4"]["bits_per_element_at_96"]["v"] == 4.5 + 16 * 4 / 96
    # the stored bytes count the kept tokens, float32 here: 4 tokens of 2
    # layers x 2 kv heads x 64 dims, keys and values, spread over 95 tokens
    kept = 4 * 2 * 2 * 64 * 2 * 4 / 95
    extra = r["4+exact4"]["cache_bytes_per_token"] - r["4"]["cache_bytes_per_token"]
    assert extra == pytest.approx(kept)
    assert "(4.516 / 4.516 at 4096)" in kv_eval.format_row(r["4+exact4"])


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
    argv = [*model_and_text(tmp_path, model), "--kv", "8,4+exact4"]
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
    found = kv_eval.resolve_schemes(["4"], 64)
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


@pytest.mark.parametrize("name", ["fp16", "codebook-4+center+exact4"])
def test_passkey_answer_decodes_its_own_tokens(tmp_path, model, name):
    from mlx_lm import load
    from mlx_lm.generate import generate_step

    write_model_dir(tmp_path / "tiny", model)
    model, tokenizer = load(str(tmp_path / "tiny"))
    prompt = kv_eval.passkey_prompt(tokenizer, 300, 0.5, "68755", bos=1)
    scheme = schemes.get_scheme(name)
    answer = kv_eval.passkey_answer(model, prompt, scheme.make_cache(model), 64, 6)
    trial = kv_eval.passkey_trial(model, prompt, scheme.make_cache(model), 64)
    assert answer[0] == trial["predicted"][0]
    # what generate_step writes greedily with the same cache and prefill step
    steps = generate_step(
        mx.array(prompt.tokens),
        model,
        max_tokens=6,
        prompt_cache=scheme.make_cache(model),
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
    "name", ["fp16", "4+rotate+center+qscale+exact4", "codebook-4+center+exact4"]
)
def test_passkey_trial_needs_the_last_chunks_logits_only(tmp_path, model, name):
    from mlx_lm import load

    write_model_dir(tmp_path / "tiny", model)
    model, tokenizer = load(str(tmp_path / "tiny"))
    prompt = kv_eval.passkey_prompt(tokenizer, 300, 0.5, "68755", bos=1)
    scheme = schemes.get_scheme(name)
    trial = kv_eval.passkey_trial(model, prompt, scheme.make_cache(model), 64)

    # every chunk's logits evaluated, then the key's tokens fed one at a time
    cache = scheme.make_cache(model)
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
    argv += ["--kv", "4/g64,128", "--windows", "1", "--window-tokens", "48"]
    with pytest.raises(SystemExit, match="'4/g64,128' does not fit the model"):
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


def test_layer_bits_and_rule(model, windows):
    from omlx_cache import layers

    s = schemes.get_scheme("4+rotate+k8@1")
    assert s.high_layers == (1,)
    caches = s.make_cache(model)
    assert schemes.average_bits(caches, 4096) == (6.5, 4.5)
    assert [c.key_bits for c in caches] == [4, 8]
    assert [c.value_bits for c in caches] == [4, 4]
    both = schemes.get_scheme("4+kv8@0.1/g32").make_cache(model)
    assert [c.bits for c in both] == [8, 8] and both[0].group_size == 32
    with pytest.raises(ValueError, match="layer 5"):
        schemes.get_scheme("4+k8@5").make_cache(model)

    stream = io.StringIO()
    progress = kv_eval.Progress(3, stream=stream)  # fp16, then each layer
    errors = layers.layer_errors(
        model, windows[:1], schemes.get_scheme("4"), chunk=32, progress=progress
    )
    assert len(errors) == 2 and all(e > 0 for e in errors)
    assert progress.done == 3 and "layer 1" in stream.getvalue()
    top = layers.top_layers(errors, 1)
    assert errors[top[0]] == max(errors)
    assert layers.with_layers("4+rotate/g32", [3, 11], 8) == "4+rotate+k8@3.11/g32"
    assert layers.with_layers("4", [], 8) == "4"
    r = by_name(
        kv_eval.evaluate_tokens(
            model, windows[:1], [schemes.get_scheme(n) for n in ("fp16", "4+k8@1")]
        )
    )
    assert r["4+k8@1"]["bits_per_element_at_4096"] == {"k": 6.5, "v": 4.5}
    assert r["4+k8@1"]["high_layers"] == [1]
    assert r["4+k8@1"]["layer_bits"] == [[4.5, 4.5], [8.5, 4.5]]


def test_layers_within_budget(model):
    from omlx_cache import layers

    errors = [0.1, 0.3]  # layer 1 first
    assert layers.scheme_bits(model, "4") == 4.5
    assert layers.scheme_bits(model, "4+k8@1") == 5.5
    for budget, chosen in ((4.5, []), (6.4, [1]), (6.5, [0, 1])):
        assert layers.layers_within(model, errors, "4", 8, "k", budget) == chosen
    assert layers.layers_within(model, errors, "4", 8, "kv", 6.4) == []
    # a codebook cache knows its bits once it has seen its head dims
    bits = layers.scheme_bits(model, "codebook-4")
    assert bits == pytest.approx(4 + 16 / CONFIG["head_dim"])
    with pytest.raises(ValueError, match="4.500 bits, over --budget 4.4"):
        layers.check_budget(model, "4", 4.4)
    layers.check_budget(model, "4", 4.5)


def test_layers_main_budget(tmp_path, model, capsys):
    from omlx_cache import layers

    argv = [*model_and_text(tmp_path, model), "--skip", "0", "--window-tokens", "48"]
    argv += ["--chunk", "16", "--kv", "4+rotate", "--apply", "4", "--bits", "8"]
    with pytest.raises(
        SystemExit, match="4 alone stores 4.500 bits, over --budget 4.4"
    ):
        layers.main([*argv, "--budget", "4.4"])
    out = tmp_path / "layers.json"
    report = layers.main([*argv, "--budget", "5.5", "--out", str(out)])
    assert json.loads(out.read_text())["scheme"] == report["scheme"]
    (top,) = report["top"]  # one layer at 8 bits fits in 5.5, two do not
    assert report["layer_kld"][top] == max(report["layer_kld"])
    assert report["scheme"] == f"4+k8@{top}" and report["bits_per_element"] == 5.5
    assert report["apply"] == "4" and report["budget"] == 5.5
    assert f"scheme: 4+k8@{top} (5.500 bits at 4096 tokens)" in capsys.readouterr().out


def test_residual_scheme_bits(model):
    s = schemes.get_scheme("4+rotate+center+exact4+res16")
    caches = s.make_cache(model)
    assert (caches[0].residual, caches[0].keep_exact, caches[0].center) == (16, 4, "k")
    assert schemes.residual_tokens(16, 20) == 20
    assert schemes.residual_tokens(16, 32) == 16
    assert schemes.residual_tokens(16, 4096 + 5) == 21
    assert schemes.residual_tokens(0, 4096) == 0
    # 16 to 31 held: 23.5 on average over a cycle, wherever 4096 falls in it
    assert schemes.mean_residual_tokens(16, 4096) == 23.5
    assert schemes.mean_residual_tokens(16, 4096 + 5) == 23.5
    assert schemes.mean_residual_tokens(16, 20) == 20
    # the rest at 4.5 bits, the first 4 also at 16, the held ones at 16
    expected = ((4096 - 23.5) * 4.5 + (4 + 23.5) * 16) / 4096
    assert schemes.average_bits(caches, 4096) == pytest.approx((expected, expected))
    # while every token is held, all are 16-bit
    assert schemes.average_bits(caches, 20) == (16.0, 16.0)


def test_fitted_layers_once_per_model(tmp_path, model, monkeypatch, capsys):
    """``+k5@fitX``: the layers fitted to X bits from text the model samples
    itself, once per model: kept in memory and in ``fit_dir()``; a corrupt
    file is fitted again, a base scheme over the budget is an error."""
    from omlx_cache import layers

    monkeypatch.setenv("OMLX_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(layers, "SAMPLED_TOKENS", 24)
    layers._fitted.clear()
    base = layers.scheme_bits(model, "codebook-4")
    name = f"codebook-4+k5@fit{base + 0.3:.3f}"  # 5-bit keys in one layer: +0.25
    caches = schemes.get_scheme(name).make_cache(model)
    (path,) = (tmp_path / "layers").glob("*.json")
    report = json.loads(path.read_text())
    (top,) = report["layers"]
    assert report["layer_kld"][top] == max(report["layer_kld"])
    assert report["scheme"] == f"codebook-4+k5@{top}"
    assert report["measure"] == "codebook-4k-16v"
    assert [c.key_codec.bits for c in caches] == [5 if i == top else 4 for i in (0, 1)]
    assert "fitting codebook-4 to" in capsys.readouterr().err
    schemes.get_scheme(name).make_cache(model)
    assert "fitting" not in capsys.readouterr().err
    layers._fitted.clear()  # a new process: the file
    schemes.get_scheme(name).make_cache(model)
    assert "fitting" not in capsys.readouterr().err
    layers._fitted.clear()
    path.write_text("{")
    schemes.get_scheme(name).make_cache(model)
    assert "fitting again" in capsys.readouterr().err
    assert json.loads(path.read_text())["layers"] == [top]
    with pytest.raises(ValueError, match=r"over --budget 4\.2"):
        schemes.get_scheme("codebook-4+k5@fit4.2").make_cache(model)
    # the layers' keys ranked with values unquantized, the values' layers kept
    name = f"codebook-4+k5@fit{base + 0.3:.3f}+v5@global"
    schemes.get_scheme(name).make_cache(model)
    (report,) = [
        json.loads(p.read_text())
        for p in (tmp_path / "layers").glob("*.json")
        if p != path
    ]
    assert (report["name"], report["measure"]) == (
        "codebook-4+v5@global",
        "codebook-4k-16v",
    )
    assert report["scheme"] == f"codebook-4+k5@{top}+v5@global"


def test_sampled_tokens_are_the_models_and_repeat(model):
    from omlx_cache import layers

    tokens = layers.sampled_tokens(model, 16, seed=3)
    assert tokens.shape == (16,)
    assert mx.array_equal(tokens, layers.sampled_tokens(model, 16, seed=3))
    assert not mx.array_equal(tokens, layers.sampled_tokens(model, 16, seed=4))
    assert int(tokens.max()) < CONFIG["vocab_size"]


def test_values_of_global_layers(model):
    """``+v5@global``: the values of the whole-context layers of a model with
    sliding windows (Gemma 3) at 5 bits; a model without them has none."""
    from mlx_lm.models import gemma3_text
    from tiny_gemma import TINY_GEMMA

    gemma = gemma3_text.Model(gemma3_text.ModelArgs.from_dict(TINY_GEMMA))
    assert schemes.global_layers(gemma) == (2,)
    caches = schemes.get_scheme("codebook-4+k5@0+v5@global").make_cache(gemma)
    bits = [(c.key_codec.bits, c.value_codec.bits) for c in caches]
    assert bits == [(5, 4), (4, 4), (4, 5)]
    assert schemes.global_layers(model) == ()
    caches = schemes.get_scheme("codebook-4+v5@global").make_cache(model)
    assert {c.value_codec.bits for c in caches} == {4}


def test_float32_matmuls_follow_mlx_enable_tf32(monkeypatch):
    monkeypatch.delenv("MLX_ENABLE_TF32", raising=False)
    assert kv_eval.float32_matmuls() == "TF32"
    monkeypatch.setenv("MLX_ENABLE_TF32", "1")
    assert kv_eval.float32_matmuls() == "TF32"
    monkeypatch.setenv("MLX_ENABLE_TF32", "0")
    assert kv_eval.float32_matmuls() == "float32"


def test_machine_names_the_device():
    line = kv_eval.machine()
    assert f"mlx device {mx.default_device()}" in line
    # the float32 matmul mode is a GPU backend's
    assert ("float32 matmuls in" in line) == (mx.default_device() == mx.gpu)
