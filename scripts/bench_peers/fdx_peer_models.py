"""Random-weight checkpoints of named real model shapes for ``fdx bench peers --shape``.

Nothing may be downloaded, so the tool writes a Hugging Face directory of
the named shape with random weights (config.json, one model.safetensors in
f16 or bf16 written tensor by tensor, never the whole model in memory), the
tokenizer of the embedded SmolLM2-135M GGUF (tokenizer.json and
tokenizer_config.json), converts it with llama.cpp's own
``convert_hf_to_gguf.py`` (from the same sources the peers are built from)
into an F16 GGUF, and quantizes that with ``llama-quantize``. Every file is
cached by shape, seed and format.

The tokenizer: SmolLM2's 49,152 tokens for every shape, and the shape's own
vocab size for the embedding and the head (Qwen2.5's 151,936, Llama 3.2's
128,256), so the weights and the per-token cost are the real model's;
convert_hf_to_gguf.py fills the ids past the tokenizer with ``[PAD<id>]``
tokens, which a benchmark's prompts never contain.
"""
from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np


@dataclass(frozen=True)
class Shape:
    """The numbers of a real model's config.json that fix its cost (from the
    models' published configs; no weights)."""
    architecture: str                  # config.json "architectures"[0]
    model_type: str
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    rope_theta: float
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool = True
    attention_bias: bool = False      # Qwen2: q/k/v carry a bias
    rope_scaling: dict | None = field(default=None, hash=False, compare=False)
    # a mixture of experts (Qwen3-MoE): every layer routes; 0 experts: a dense MLP of intermediate_size
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    head_dim_: int = 0                # config.json's head_dim where it is not hidden / heads (Qwen3)
    qk_norm: bool = False             # Qwen3: per-head q/k RMS norms

    @property
    def head_dim(self) -> int:
        return self.head_dim_ or self.hidden_size // self.num_attention_heads

    def tensors(self) -> list[tuple[str, tuple[int, ...]]]:
        """(name, shape) of every tensor, in HF's names and [out, in] layout, in file order."""
        h, i, hd = self.hidden_size, self.intermediate_size, self.head_dim
        q, kv = self.num_attention_heads * hd, self.num_key_value_heads * hd
        out = [("model.embed_tokens.weight", (self.vocab_size, h))]
        for n in range(self.num_hidden_layers):
            p = f"model.layers.{n}."
            out += [(p + "input_layernorm.weight", (h,)),
                    (p + "self_attn.q_proj.weight", (q, h)),
                    (p + "self_attn.k_proj.weight", (kv, h)),
                    (p + "self_attn.v_proj.weight", (kv, h))]
            if self.attention_bias:
                out += [(p + "self_attn.q_proj.bias", (q,)), (p + "self_attn.k_proj.bias", (kv,)),
                        (p + "self_attn.v_proj.bias", (kv,))]
            out += [(p + "self_attn.o_proj.weight", (h, q))]
            if self.qk_norm:
                out += [(p + "self_attn.q_norm.weight", (hd,)), (p + "self_attn.k_norm.weight", (hd,))]
            out += [(p + "post_attention_layernorm.weight", (h,))]
            if self.num_experts:
                m = self.moe_intermediate_size
                out.append((p + "mlp.gate.weight", (self.num_experts, h)))
                for e in range(self.num_experts):
                    out += [(p + f"mlp.experts.{e}.gate_proj.weight", (m, h)),
                            (p + f"mlp.experts.{e}.up_proj.weight", (m, h)),
                            (p + f"mlp.experts.{e}.down_proj.weight", (h, m))]
                continue
            out += [(p + "mlp.gate_proj.weight", (i, h)),
                    (p + "mlp.up_proj.weight", (i, h)),
                    (p + "mlp.down_proj.weight", (h, i))]
        out.append(("model.norm.weight", (h,)))
        if not self.tie_word_embeddings:
            out.append(("lm_head.weight", (self.vocab_size, h)))
        return out

    def num_parameters(self) -> int:
        return sum(int(np.prod(s)) for _, s in self.tensors())

    def config(self) -> dict:
        c = {"architectures": [self.architecture], "model_type": self.model_type,
             "hidden_size": self.hidden_size, "intermediate_size": self.intermediate_size,
             "num_hidden_layers": self.num_hidden_layers, "num_attention_heads": self.num_attention_heads,
             "num_key_value_heads": self.num_key_value_heads, "vocab_size": self.vocab_size,
             "rope_theta": self.rope_theta, "rms_norm_eps": self.rms_norm_eps,
             "max_position_embeddings": self.max_position_embeddings,
             "tie_word_embeddings": self.tie_word_embeddings, "hidden_act": "silu",
             "initializer_range": 0.02, "torch_dtype": "float16", "bos_token_id": 1, "eos_token_id": 2}
        if self.model_type == "llama":
            c.update(attention_bias=False, mlp_bias=False, head_dim=self.head_dim, pretraining_tp=1)
        if self.rope_scaling:
            c["rope_scaling"] = dict(self.rope_scaling)
        if self.head_dim_:
            c["head_dim"] = self.head_dim_
        if self.num_experts:
            c.update(num_experts=self.num_experts, num_experts_per_tok=self.num_experts_per_tok,
                     moe_intermediate_size=self.moe_intermediate_size, norm_topk_prob=True,
                     decoder_sparse_step=1, mlp_only_layers=[], attention_bias=False)
        return c


_LLAMA3_SCALING = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                   "original_max_position_embeddings": 8192}

# the published config.json numbers of each model (hidden, intermediate, layers, heads, KV heads, vocab, rope)
SHAPES: dict[str, Shape] = {
    "smollm2-135m": Shape("LlamaForCausalLM", "llama", 576, 1536, 30, 9, 3, 49152, 100000.0, 1e-5, 8192),
    "smollm2-360m": Shape("LlamaForCausalLM", "llama", 960, 2560, 32, 15, 5, 49152, 100000.0, 1e-5, 8192),
    "smollm2-1.7b": Shape("LlamaForCausalLM", "llama", 2048, 8192, 24, 32, 32, 49152, 130000.0, 1e-5, 8192),
    "qwen2.5-0.5b": Shape("Qwen2ForCausalLM", "qwen2", 896, 4864, 24, 14, 2, 151936, 1000000.0, 1e-6, 32768,
                          attention_bias=True),
    "qwen2.5-1.5b": Shape("Qwen2ForCausalLM", "qwen2", 1536, 8960, 28, 12, 2, 151936, 1000000.0, 1e-6, 32768,
                          attention_bias=True),
    "qwen2.5-3b": Shape("Qwen2ForCausalLM", "qwen2", 2048, 11008, 36, 16, 2, 151936, 1000000.0, 1e-6, 32768,
                        attention_bias=True),
    "llama-3.2-1b": Shape("LlamaForCausalLM", "llama", 2048, 8192, 16, 32, 8, 128256, 500000.0, 1e-5, 131072,
                          rope_scaling=_LLAMA3_SCALING),
    "llama-3.2-3b": Shape("LlamaForCausalLM", "llama", 3072, 8192, 28, 24, 8, 128256, 500000.0, 1e-5, 131072,
                          rope_scaling=_LLAMA3_SCALING),
    # Qwen3-30B-A3B's layer shapes (128 experts of 768, top-8, head_dim 128) in 4 of its 48 layers: every
    # step still streams 4 x 8 experts a row, at the real sizes, from a 5 GB F16 file instead of 61 GB
    "qwen3-30b-a3b-4l": Shape("Qwen3MoeForCausalLM", "qwen3_moe", 2048, 6144, 4, 32, 4, 151936, 1000000.0, 1e-6,
                              40960, tie_word_embeddings=False, num_experts=128, num_experts_per_tok=8,
                              moe_intermediate_size=768, head_dim_=128, qk_norm=True),
}


def shape(name: str) -> Shape:
    """The named shape; a ValueError naming --shape and the known names otherwise."""
    key = name.strip().lower()
    if key not in SHAPES:
        raise ValueError(f"--shape {name!r}: known shapes are {', '.join(SHAPES)}")
    return SHAPES[key]


# --- writing the checkpoint ------------------------------------------------------------

DTYPES = {"f16": ("F16", 2), "bf16": ("BF16", 2)}
_CHUNK = 1 << 22                        # elements generated at a time: 16 MB of float32


def _seed(seed: int, name: str) -> int:
    return zlib.crc32(name.encode()) ^ (seed * 0x9E3779B1 & 0xFFFFFFFF)


def tensor_values(seed: int, name: str, shape_: tuple[int, ...]) -> np.ndarray:
    """The float32 values of one tensor (tests and the writer agree through this):
    norms 1, biases and weights normal(0, 0.02), seeded by the tensor's name."""
    n = int(np.prod(shape_))
    if name.endswith("norm.weight"):
        return np.ones(n, np.float32)
    rng = np.random.default_rng(_seed(seed, name))
    return rng.standard_normal(n, dtype=np.float32) * np.float32(0.02)


def _encode(x: np.ndarray, dtype: str) -> bytes:
    if dtype == "f16":
        return x.astype("<f2").tobytes()
    u = x.astype("<f4").view("<u4")
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype("<u2").tobytes()   # round to nearest even


def _chunks(seed: int, name: str, shape_: tuple[int, ...]):
    """The tensor's values in pieces of at most _CHUNK elements, the same values as tensor_values."""
    n = int(np.prod(shape_))
    if name.endswith("norm.weight"):
        for a in range(0, n, _CHUNK):
            yield np.ones(min(_CHUNK, n - a), np.float32)
        return
    rng = np.random.default_rng(_seed(seed, name))
    for a in range(0, n, _CHUNK):
        # numpy's generator gives the same stream whether drawn at once or in pieces
        yield rng.standard_normal(min(_CHUNK, n - a), dtype=np.float32) * np.float32(0.02)


def write_safetensors(path: Path, sh: Shape, seed: int = 0, dtype: str = "f16") -> Path:
    """model.safetensors of random weights, written tensor by tensor in pieces
    (the header first: every offset is known from the shapes), to a .partial
    file renamed once whole; memory stays at one piece whatever the size."""
    if dtype not in DTYPES:
        raise ValueError(f"--shape-dtype {dtype!r}: f16 or bf16")
    st_dtype, size = DTYPES[dtype]
    header, offset = {}, 0
    for name, s in sh.tensors():
        nbytes = int(np.prod(s)) * size
        header[name] = {"dtype": st_dtype, "shape": list(s), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    header["__metadata__"] = {"format": "pt", "fdx": f"random weights, seed {seed}"}
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    tmp = path.with_name(path.name + ".partial")
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for name, s in sh.tensors():
            for piece in _chunks(seed, name, s):
                f.write(_encode(piece, dtype))
    tmp.rename(path)
    return path


def write_tokenizer(out_dir: Path, gguf_path: Path) -> None:
    """tokenizer.json and tokenizer_config.json of the GGUF's tokenizer (fdx's
    reading of the GGUF metadata: the same merges, pre-tokenizer and special tokens)."""
    from fdx.model_io.tokenizer import Tokenizer
    tok = Tokenizer.from_gguf(str(gguf_path))
    tok.backend.save(str(out_dir / "tokenizer.json"))
    cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 8192,
           "bos_token": tok.bos_token, "eos_token": tok.eos_token, "unk_token": tok.unk_token,
           "add_bos_token": tok.add_bos_token, "add_eos_token": False, "clean_up_tokenization_spaces": False}
    if tok.pad_token is not None:
        cfg["pad_token"] = tok.pad_token
    if tok.chat_template:
        cfg["chat_template"] = tok.chat_template
    (out_dir / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2))


def write_checkpoint(out_dir: Path, name: str, tokenizer_gguf: Path, seed: int = 0, dtype: str = "f16") -> Path:
    """The HF directory of shape ``name`` (config, weights, tokenizer), written once."""
    sh = shape(name)
    if (out_dir / "model.safetensors").is_file() and (out_dir / "tokenizer.json").is_file():
        return out_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    cfg = sh.config()
    cfg["torch_dtype"] = {"f16": "float16", "bf16": "bfloat16"}[dtype]
    tok_ids = _special_ids(tokenizer_gguf)
    cfg.update(tok_ids)
    (out_dir / "config.json").write_text(json.dumps(cfg, indent=2))
    write_tokenizer(out_dir, tokenizer_gguf)
    write_safetensors(out_dir / "model.safetensors", sh, seed, dtype)
    return out_dir


def _special_ids(gguf_path: Path) -> dict:
    from fdx.model_io.tokenizer import Tokenizer
    tok = Tokenizer.from_gguf(str(gguf_path))
    return {"bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id}


# --- converting it -----------------------------------------------------------------------

# what convert_hf_to_gguf.py imports beyond the standard library (gguf-py comes with the sources);
# it also imports sentencepiece for a Llama checkpoint before it looks for a tokenizer.model: see
# sentencepiece_stub
CONVERT_DEPS = ("torch", "numpy", "transformers", "safetensors")

_STUB = '''"""Stand-in written by fdx bench peers: sentencepiece is not installed.

convert_hf_to_gguf.py imports SentencePieceProcessor for a Llama checkpoint
before it checks for a tokenizer.model; fdx's random checkpoints have none
(their tokenizer.json is byte-level BPE), so the converter moves on to it.
Installing sentencepiece makes this stub unused."""


class SentencePieceProcessor:
    def __init__(self, *args, **kwargs):
        raise ImportError("sentencepiece is not installed (fdx bench peers' stand-in)")
'''


def missing_convert_deps(python: str = sys.executable) -> list[str]:
    """The modules convert_hf_to_gguf.py needs that ``python`` cannot import."""
    code = ("import importlib.util, sys; print(' '.join(m for m in sys.argv[1:] "
            "if importlib.util.find_spec(m) is None))")
    r = subprocess.run([python, "-c", code, *CONVERT_DEPS], capture_output=True, text=True)
    return r.stdout.split()


def convert_command(src_dir: Path, hf_dir: Path, out: Path, outtype: str = "f16") -> list[str]:
    """llama.cpp's own converter on the HF directory, with its own gguf-py
    (the script puts it first on its path unless NO_LOCAL_GGUF is set)."""
    return [sys.executable, str(src_dir / "convert_hf_to_gguf.py"), str(hf_dir), "--outfile", str(out),
            "--outtype", outtype]


def sentencepiece_stub(where: Path, python: str = sys.executable) -> Path | None:
    """A folder holding a stand-in sentencepiece module when python has none (else None)."""
    r = subprocess.run([python, "-c", "import importlib.util as u; print(u.find_spec('sentencepiece') is None)"],
                       capture_output=True, text=True)
    if r.stdout.strip() != "True":
        return None
    (where / "sentencepiece").mkdir(parents=True, exist_ok=True)
    (where / "sentencepiece" / "__init__.py").write_text(_STUB)
    return where


def convert_env(stub: Path | None = None) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "NO_LOCAL_GGUF"}
    if stub is not None:
        env["PYTHONPATH"] = os.pathsep.join(x for x in (str(stub), env.get("PYTHONPATH")) if x)
    env.setdefault("OMP_NUM_THREADS", "1")
    env["HF_HUB_OFFLINE"] = "1"                     # nothing is downloaded
    env["TRANSFORMERS_OFFLINE"] = "1"
    return env
