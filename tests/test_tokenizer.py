"""fdx.model_io.tokenizer against transformers' own tokenizers (the reference)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from fdx.model_io.loader import default_model_path
from fdx.model_io.tokenizer import ChatTemplateError, IncrementalDetokenizer, Tokenizer

transformers = pytest.importorskip("transformers")

TEXTS = [
    "Hello, world! This is a test.",
    "def add(a, b):\n    return a + b  # sum\n",
    "12345 and 3.14159, 1,000,000; x=100000",
    "   leading spaces, trailing   ",
    "tabs\tand\n\nnewlines\r\n  mixed \n\n\n",
    "emoji: 😀🎉👍🏽 👨‍👩‍👧 ❤️",
    "中文：你好，世界。日本語のテキスト、한국어",
    "café naïve résumé Ångström façade über",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "text<|endoftext|>more <repo_name> x",
    "",
    " ",
    "I'm sure they'll've done it; it's 'quoted' \"double\"",
    "URL https://example.com/a?b=c&d=e#frag",
]

CONVERSATIONS = [
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "And 3+3? 😀 café"},
    ],
    [{"role": "user", "content": "Hello!\nHow are you?"}],
]


@pytest.fixture(scope="module")
def gguf_file() -> Path:
    return Path(default_model_path())


@pytest.fixture(scope="module")
def ours(gguf_file: Path) -> Tokenizer:
    return Tokenizer.from_gguf(gguf_file)


@pytest.fixture(scope="module")
def ref(gguf_file: Path):
    return transformers.AutoTokenizer.from_pretrained(str(gguf_file.parent), gguf_file=gguf_file.name)


# ----- GGUF tokenizer vs transformers' GGUF tokenizer ---------------------


@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_encode_matches_transformers(ours, ref, add_special_tokens):
    for text in TEXTS:
        expected = ref.encode(text, add_special_tokens=add_special_tokens)
        assert ours.encode(text, add_special_tokens=add_special_tokens) == expected, text


@pytest.mark.parametrize("skip", [True, False])
def test_decode_matches_transformers(ours, ref, skip):
    rng = random.Random(0)
    sequences = [ref.encode(t) for t in TEXTS]
    sequences += [[rng.randrange(ours.vocab_size) for _ in range(20)] for _ in range(5)]
    sequences.append([1, 9906, 2, 0, 3, 2634])  # specials between words
    for ids in sequences:
        assert ours.decode(ids, skip_special_tokens=skip) == ref.decode(ids, skip_special_tokens=skip), ids


def test_tokens_and_special_ids(ours, ref):
    ids = ref.encode(TEXTS[0] + TEXTS[5])
    assert ours.convert_ids_to_tokens(ids) == ref.convert_ids_to_tokens(ids)
    assert ours.vocab_size == len(ref) == 49152
    assert (ours.bos_token_id, ours.eos_token_id, ours.pad_token_id) == (
        ref.bos_token_id,
        ref.eos_token_id,
        ref.pad_token_id,
    )
    assert ours.eos_token_ids == {ref.eos_token_id}
    assert set(ref.all_special_ids) <= set(ours.all_special_ids)
    assert set(ours.all_special_ids) == set(range(17))  # SmolLM2's control tokens


def test_gguf_pre_tokenizer_splits_digits(ours):
    # SmolLM2 ("smollm" pre-tokenizer) writes every digit as its own token.
    tokens = ours.convert_ids_to_tokens(ours.encode("x 2024 and 99", add_special_tokens=False))
    assert [t for t in tokens if any(c.isdigit() for c in t)] == ["2", "0", "2", "4", "9", "9"]


@pytest.mark.parametrize("conversation", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(ours, ref, conversation, add_generation_prompt):
    expected = ref.apply_chat_template(
        conversation, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    assert ours.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt) == expected


def test_custom_template_features_match_transformers(ours, ref):
    template = (
        "{% for m in messages %}{% if m.role == 'skip' %}{% continue %}{% endif %}"
        "[{{ m.role }}]{{ m.content | trim }}\n{% endfor %}"
        "{% if tools %}{{ tools | tojson }}\n{{ tools | tojson(indent=2) }}{% endif %}"
        "{{ bos_token }}|{{ eos_token }}|{{ pad_token }}|{{ unk_token }}|{{ extra }}\n"
        "{% if add_generation_prompt %}  {% if true %}\nGO{% endif %}{% endif %}"
    )
    messages = [
        {"role": "user", "content": "  spaced <b> & ü  "},
        {"role": "skip", "content": "hidden"},
        {"role": "assistant", "content": "ok"},
    ]
    tools = [{"type": "function", "function": {"name": "f", "description": "größe <x>"}}]
    expected = ref.apply_chat_template(
        messages, tools=tools, chat_template=template, tokenize=False, add_generation_prompt=True, extra="E"
    )
    got = ours.apply_chat_template(messages, tools=tools, chat_template=template, extra="E")
    assert got == expected


def test_raise_exception_in_template_is_value_error(ours):
    template = "{% if messages[0].role != 'user' %}{{ raise_exception('first must be user') }}{% endif %}"
    with pytest.raises(ValueError, match="first must be user"):
        ours.apply_chat_template([{"role": "system", "content": "x"}], chat_template=template)


def test_broken_template_is_value_error(ours):
    with pytest.raises(ValueError, match="chat template failed"):
        ours.apply_chat_template([], chat_template="{% for %}")
    with pytest.raises(ValueError, match="chat template failed"):
        ours.apply_chat_template([{"role": "user"}], chat_template="{{ messages[0].content + 'x' }}")


def test_missing_chat_template_is_clear(ours):
    bare = Tokenizer(ours.backend, eos_token="<|im_end|>")
    with pytest.raises(ChatTemplateError, match="no chat template"):
        bare.apply_chat_template([{"role": "user", "content": "hi"}])
    assert isinstance(ChatTemplateError("x"), ValueError)
    assert bare.chat_template is None


def test_strftime_now_global(ours):
    out = ours.apply_chat_template([], chat_template="{{ strftime_now('%Y') }}")
    assert out.isdigit() and len(out) == 4


# ----- incremental detokenizer ------------------------------------------


def _stream(tokenizer, ids, chunk=1, **kwargs):
    detok = IncrementalDetokenizer(tokenizer, **kwargs)
    deltas = [detok.add(ids[i : i + chunk]) for i in range(0, len(ids), chunk)]
    return detok, deltas


@pytest.mark.parametrize("chunk", [1, 3])
@pytest.mark.parametrize("skip", [True, False])
def test_detokenizer_deltas_equal_decode(ours, chunk, skip):
    for text in TEXTS:
        ids = ours.encode(text, add_special_tokens=False)
        detok, deltas = _stream(ours, ids, chunk, skip_special_tokens=skip)
        assert "".join(deltas) == detok.text == ours.decode(ids, skip_special_tokens=skip), text
        assert not any("\ufffd" in d for d in deltas), text


def _byte_token_ids(tokenizer: Tokenizer, text: str) -> list[int]:
    """`text` spelled one UTF-8 byte per token (GPT-2 byte alphabet)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    bs += list(range(ord("®"), ord("ÿ") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    spelling = dict(zip(bs, map(chr, cs)))
    return [tokenizer.convert_tokens_to_ids(spelling[b]) for b in text.encode("utf-8")]


def test_detokenizer_never_splits_a_character(ours, ref):
    text = "a😀b 你好 é👨‍👩‍👧!"
    ids = _byte_token_ids(ours, text)
    assert None not in ids
    detok, deltas = _stream(ours, ids)
    assert "".join(deltas) == text == ref.decode(ids)
    assert not any("\ufffd" in d for d in deltas)
    # The 4-byte emoji appears in one delta, on its last byte.
    emoji_start = len("a".encode())
    assert deltas[emoji_start : emoji_start + 4] == ["", "", "", "😀"]


def test_detokenizer_with_special_tokens_and_prompt(ours, ref):
    prompt = ours.encode(ours.apply_chat_template(CONVERSATIONS[1]), add_special_tokens=False)
    out = ours.encode("Sure 😀 ", add_special_tokens=False) + [2] + ours.encode("more 中文", add_special_tokens=False)
    out += [0, 1]
    for skip in (True, False):
        detok, deltas = _stream(ours, out, skip_special_tokens=skip, prompt_token_ids=prompt)
        assert "".join(deltas) == ref.decode(out, skip_special_tokens=skip)
        assert detok.output_token_ids == out


def test_detokenizer_flushes_an_incomplete_tail(ours):
    ids = ours.encode("ok", add_special_tokens=False) + _byte_token_ids(ours, "😀")[:2]
    detok, deltas = _stream(ours, ids)
    assert "".join(deltas) == "ok"
    assert detok.finish() == "\ufffd"
    assert detok.text == ours.decode(ids)


def test_detokenizer_decodes_short_windows(ours):
    ids = ours.encode(" ".join(TEXTS) * 3, add_special_tokens=False)
    assert len(ids) > 300
    windows: list[int] = []

    class Counting(Tokenizer):
        def decode(self, token_ids, skip_special_tokens=True):
            windows.append(len(token_ids))
            return super().decode(token_ids, skip_special_tokens)

    counting = Counting(ours.backend, eos_token="<|im_end|>")
    detok, deltas = _stream(counting, ids)
    assert "".join(deltas) == ours.decode(ids)
    assert max(windows) <= 12


# ----- sentencepiece ("llama") GGUF tokenizer -----------------------------


def _write_sentencepiece_gguf(path: Path) -> None:
    import gguf
    import numpy as np
    from tokenizers import SentencePieceBPETokenizer

    corpus = ["the quick brown fox jumps over the lazy dog", "hello world, hello there", "the theory of it"] * 20
    sp = SentencePieceBPETokenizer(add_prefix_space=True)
    sp.train_from_iterator(corpus, vocab_size=110, min_frequency=2, show_progress=False)
    pieces = [t for t, _ in sorted(sp.get_vocab().items(), key=lambda kv: kv[1])]
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + pieces
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores([0.0] * 259 + [-float(i) for i in range(len(pieces))])
    writer.add_token_types([2, 3, 3] + [6] * 256 + [1] * len(pieces))
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_chat_template("{% for m in messages %}<s>{{ m.content }}</s>{% endfor %}")
    for key, value in [("block_count", 1), ("context_length", 64), ("embedding_length", 8),
                       ("feed_forward_length", 16), ("attention.head_count", 2)]:
        writer.add_uint32(f"llama.{key}", value)
    writer.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
    writer.add_tensor("token_embd.weight", np.zeros((len(tokens), 8), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_sentencepiece_gguf_matches_transformers(tmp_path):
    _write_sentencepiece_gguf(tmp_path / "sp.gguf")
    ours = Tokenizer.from_gguf(tmp_path / "sp.gguf")
    ref = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="sp.gguf")
    texts = ["the quick brown fox", " hello  world", "Zebra €5 日本 😀", "hello</s>there", "\nthe\n", ""]
    for text in texts:
        ids = ref.encode(text)
        assert ours.encode(text) == ids, text
        assert ids[:1] == [1]  # sentencepiece GGUFs add BOS by default
        assert ours.encode(text, add_special_tokens=False) == ref.encode(text, add_special_tokens=False)
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == ref.decode(ids, skip_special_tokens=skip)
        body = ids[1:]
        detok, deltas = _stream(ours, body)
        assert "".join(deltas) == ours.decode(body), text
    assert ours.apply_chat_template([{"role": "user", "content": "x"}]) == "<s>x</s>"


def test_unsupported_gguf_tokenizer_model_is_named(tmp_path):
    import gguf

    writer = gguf.GGUFWriter(str(tmp_path / "bad.gguf"), "llama")
    writer.add_tokenizer_model("rwkv")
    writer.add_token_list(["a", "b"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="'rwkv'"):
        Tokenizer.from_gguf(tmp_path / "bad.gguf")


# ----- Hugging Face directory -------------------------------------------


@pytest.fixture(scope="module")
def hf_dir(ref, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("hf_tokenizer")
    ref.save_pretrained(str(path))
    return path


def test_hf_dir_tokenizer_matches_transformers(hf_dir):
    ours = Tokenizer.from_hf_dir(hf_dir)
    ref = transformers.AutoTokenizer.from_pretrained(str(hf_dir))
    for text in TEXTS:
        for add in (True, False):
            ids = ref.encode(text, add_special_tokens=add)
            assert ours.encode(text, add_special_tokens=add) == ids, text
        assert ours.decode(ids) == ref.decode(ids, skip_special_tokens=True)
    for conversation in CONVERSATIONS:
        expected = ref.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
        assert ours.apply_chat_template(conversation) == expected
    assert (ours.bos_token_id, ours.eos_token_id, ours.pad_token_id) == (1, 2, 2)


def _copy_dir(src: Path, dst: Path) -> Path:
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def test_hf_dir_flags_named_templates_and_generation_eos(hf_dir, tmp_path):
    path = _copy_dir(hf_dir, tmp_path / "tok")
    (path / "chat_template.jinja").unlink()
    config = json.loads((path / "tokenizer_config.json").read_text())
    config["add_bos_token"] = True
    config["chat_template"] = [
        {"name": "default", "template": "D:{{ messages[0].content }}"},
        {"name": "tool_use", "template": "T:{{ tools[0].name }}"},
    ]
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))

    ours = Tokenizer.from_hf_dir(path)
    ref = transformers.AutoTokenizer.from_pretrained(str(path))
    # tokenizer.json has a post-processor: it decides, and the flag is ignored
    # (transformers 5 does the same).
    for text in TEXTS[:4]:
        assert ours.encode(text) == ref.encode(text)
    assert not ours.add_bos_token
    messages = [{"role": "user", "content": "hi"}]
    assert ours.apply_chat_template(messages) == "D:hi"
    assert ours.apply_chat_template(messages, tools=[{"name": "f"}]) == "T:f"
    assert ours.apply_chat_template(messages, chat_template="tool_use", tools=[{"name": "g"}]) == "T:g"
    assert ours.eos_token_ids == {0, 2}
    assert ours.eos_token_id == 2

    # Without a post-processor in tokenizer.json the flags apply.
    tokenizer_json = json.loads((path / "tokenizer.json").read_text())
    tokenizer_json["post_processor"] = None
    (path / "tokenizer.json").write_text(json.dumps(tokenizer_json))
    config["add_eos_token"] = True
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    flagged = Tokenizer.from_hf_dir(path)
    assert flagged.add_bos_token and flagged.add_eos_token
    for text in TEXTS[:4]:
        assert flagged.encode(text) == [1, *ref.encode(text, add_special_tokens=False), 2]
        assert flagged.encode(text, add_special_tokens=False) == ref.encode(text, add_special_tokens=False)


def test_hf_dir_trained_bpe(tmp_path):
    from tokenizers import Tokenizer as Backend
    from tokenizers import decoders, models, pre_tokenizers, processors, trainers

    backend = Backend(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(["hello world, the tokenizer works", "café 😀 12345"] * 10, trainer)
    bos_id = backend.token_to_id("<s>")
    backend.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos_id)]
    )
    backend.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": {"__type": "AddedToken", "content": "<s>", "special": True}, "eos_token": "</s>"})
    )
    ours = Tokenizer.from_hf_dir(tmp_path)
    ref = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    assert ours.add_bos_token and (ours.bos_token_id, ours.eos_token_id) == (bos_id, ref.eos_token_id)
    for text in TEXTS:
        assert ours.encode(text) == ref.encode(text), text
        assert ours.encode(text)[0] == bos_id
        assert ours.decode(ref.encode(text)) == ref.decode(ref.encode(text), skip_special_tokens=True)
    with pytest.raises(ValueError, match="no chat template"):
        ours.apply_chat_template([{"role": "user", "content": "hi"}])


def test_hf_dir_without_tokenizer_json(tmp_path):
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        Tokenizer.from_hf_dir(tmp_path)


# ----- the engine process's deferred tokenizer ----------------------------


def test_deferred_tokenizer_builds_on_first_use_and_equals_transformers(gguf_file, ours, ref):
    """The serving engine's tokenizer: its eos ids without a build, then any
    other use builds it (once), and it encodes as transformers does."""
    import threading

    from fdx.model_io.loader import DeferredTokenizer
    lazy = DeferredTokenizer(str(gguf_file), ours.eos_token_ids)
    assert lazy.eos_token_ids == ours.eos_token_ids and not lazy.is_built
    got: list = []
    threads = [threading.Thread(target=lambda: got.append(lazy.encode(TEXTS[0], add_special_tokens=False)))
               for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert lazy.is_built and got == [ref.encode(TEXTS[0], add_special_tokens=False)] * 3
    built = lazy._built
    assert lazy.vocab_size == ref.vocab_size and len(lazy) == len(ref) and lazy._built is built
    for text in TEXTS:
        assert lazy.encode(text) == ref.encode(text), text


@pytest.mark.slow
def test_engine_with_a_deferred_tokenizer_applies_bad_words(gguf_file):
    """EngineCore(defer_tokenizer=True), as fdx serve's engine process builds
    it: bad_words needs the vocabulary, so the first such request builds it;
    the banned word's first token never comes out, as in an engine that
    holds its tokenizer."""
    from fdx.core.config import FdxConfig
    from fdx.core.engine import EngineCore
    from fdx.core.sampling_params import SamplingParams
    cfg = FdxConfig.build(max_model_len=128, num_kv_blocks=16, block_size=16)
    eng = EngineCore(cfg, progress=False, defer_tokenizer=True)
    assert not eng.tokenizer.is_built
    ref_tok = Tokenizer.from_gguf(gguf_file)
    prompt = ref_tok.encode("The capital of France is")

    def run(params):
        req = eng.make_request(prompt, params)
        eng.add_request(req)
        while eng.has_unfinished():
            eng.step()
        return req.output_token_ids

    free = run(SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert not eng.tokenizer.is_built                   # a plain request: ids only
    word = ref_tok.decode(free[:1]).strip()
    banned = run(SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, bad_words=[word]))
    assert eng.tokenizer.is_built
    first = ref_tok.encode(word, add_special_tokens=False)[0]
    assert banned[0] != free[0] and first not in banned[:1]


def _greedy(eng, prompt: list[int], **params) -> tuple[list[int], str]:
    from fdx.core.sampling_params import SamplingParams
    req = eng.make_request(prompt, SamplingParams(temperature=0, **params))
    eng.add_request(req)
    while eng.has_unfinished():
        eng.step()
    return list(req.output_token_ids), req.status.value


def test_engine_over_an_undecodable_gguf_vocabulary_loads_generates_and_stops(tmp_path, monkeypatch):
    """The serving engine's load of a GGUF file never reads its vocabulary:
    over a file whose tokens no reader can decode (invalid UTF-8), the engine
    loads, generates what the same weights in a Hugging Face folder generate,
    and stops on the eot id the metadata names, with its tokenizer unbuilt."""
    from fdx.core.config import FdxConfig
    from fdx.core.engine import EngineCore
    from tiny_models import TinyLlama
    monkeypatch.setenv("FDX_DISABLE_CPP_OPS", "1")      # the Paddle path: no kernel build
    tiny = TinyLlama()
    settings = dict(max_model_len=64, num_kv_blocks=16, block_size=4)
    prompt = [0, 5, 9, 7]
    hf = EngineCore(FdxConfig.build(model=str(tiny.hf_dir(tmp_path / "hf")), **settings), progress=False)
    free, _ = _greedy(hf, prompt, max_tokens=8, ignore_eos=True)
    stop = free[3]
    expected = free[:min(i for i, t in enumerate(free) if t in (1, stop)) + 1]
    poisoned = [b"\xff\xfe" + bytes([65 + i]) for i in range(tiny.vocab)]
    path = tiny.gguf_file(tmp_path / "poisoned.gguf", tokens=poisoned, eos_token_id=1, eot_token_id=stop)
    eng = EngineCore(FdxConfig.build(model=str(path), **settings), progress=False, defer_tokenizer=True)
    assert eng.eos_token_ids == {1, stop} and not eng.tokenizer.is_built
    assert _greedy(eng, prompt, max_tokens=8, ignore_eos=True) == (free, "length")
    assert _greedy(eng, prompt, max_tokens=8) == (expected, "stop")
    assert not eng.tokenizer.is_built
    with pytest.raises(UnicodeDecodeError):            # what building it from this file does
        eng.tokenizer.encode("w1")


ENGINE_PROCESS = r"""
import json, sys
from fdx.core.config import FdxConfig
from fdx.core.engine import EngineCore
from fdx.core.sampling_params import SamplingParams
eng = EngineCore(FdxConfig.build(max_model_len=256, num_kv_blocks=16), progress=False, defer_tokenizer=True)
def run(**params):
    req = eng.make_request(json.loads(sys.argv[1]), SamplingParams(temperature=0, max_tokens=48, **params))
    eng.add_request(req)
    while eng.has_unfinished():
        eng.step()
    return list(req.output_token_ids), req.status.value
out = {"plain": run(), "eos_ids": sorted(eng.eos_token_ids), "built": eng.tokenizer.is_built,
       "modules": sorted(m for m in ("tokenizers", "fdx.model_io.tokenizer") if m in sys.modules)}
out["banned"] = run(bad_words=[sys.argv[2]])
out["built_after"] = eng.tokenizer.is_built
print(json.dumps(out))
"""


@pytest.mark.slow
def test_serving_engine_loads_the_embedded_model_without_a_tokenizer(ours):
    """In a fresh process, as fdx serve's engine process builds it: loading
    the embedded GGUF model and answering a chat prompt imports no tokenizer
    module at all (nothing parsed the vocabulary), and generation stops on
    <|im_end|>, the eos id the metadata names; a bad_words request then
    builds the tokenizer, and the banned word's token stays out."""
    import subprocess
    import sys
    prompt = ours.encode(ours.apply_chat_template([{"role": "user", "content": "Say hello."}]))
    run = subprocess.run([sys.executable, "-c", ENGINE_PROCESS, json.dumps(prompt), "Hello"],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert out["modules"] == [] and out["built"] is False
    assert out["eos_ids"] == sorted(ours.eos_token_ids) == [2]
    tokens, status = out["plain"]
    assert status == "stop" and tokens[-1] == 2 and len(tokens) < 48, out
    hello = ours.encode("Hello", add_special_tokens=False)[0]
    assert hello in tokens and out["built_after"] is True
    assert hello not in out["banned"][0]
