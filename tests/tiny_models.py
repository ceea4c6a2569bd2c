"""Tiny random Llama checkpoints written with numpy alone (no torch): a
Hugging Face folder (safetensors, config.json, a word-level tokenizer.json)
and the same weights as a GGUF file (gguf's writer, llama.cpp's Q/K row
permutation applied as its converter does)."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np


@dataclass(frozen=True)
class TinyLlama:
    vocab: int = 32
    hidden: int = 16
    intermediate: int = 32
    layers: int = 2
    heads: int = 2
    kv_heads: int = 1
    max_len: int = 64
    seed: int = 0
    scale: float = 0.5          # the weights' standard deviation

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def weights(self) -> dict[str, np.ndarray]:
        """Hugging Face names -> float32 arrays ([out, in] for linear weights)."""
        V, H, I = self.vocab, self.hidden, self.intermediate
        kv = self.kv_heads * self.head_dim
        rng = np.random.default_rng(self.seed)
        w = {"model.embed_tokens.weight": rng.standard_normal((V, H)), "model.norm.weight": np.ones(H)}
        for i in range(self.layers):
            p = f"model.layers.{i}."
            w.update({p + "input_layernorm.weight": np.ones(H), p + "post_attention_layernorm.weight": np.ones(H),
                      p + "mlp.gate_proj.weight": rng.standard_normal((I, H)),
                      p + "mlp.up_proj.weight": rng.standard_normal((I, H)),
                      p + "mlp.down_proj.weight": rng.standard_normal((H, I))})
            for name, rows in (("q", H), ("k", kv), ("v", kv), ("o", H)):
                w[p + f"self_attn.{name}_proj.weight"] = rng.standard_normal((rows, H))
        return {k: (self.scale * v).astype(np.float32) for k, v in w.items()}

    def hf_dir(self, path: Path, generation_config: dict | None = None) -> Path:
        """A Hugging Face folder; its tokenizer maps ``w<i>`` to id i (bos 0, eos 1)."""
        from safetensors.numpy import save_file
        from tokenizers import Tokenizer, models, pre_tokenizers
        path = Path(path)
        path.mkdir()
        save_file(self.weights(), str(path / "model.safetensors"))
        (path / "config.json").write_text(json.dumps({
            "architectures": ["LlamaForCausalLM"], "hidden_size": self.hidden,
            "intermediate_size": self.intermediate, "num_hidden_layers": self.layers,
            "num_attention_heads": self.heads, "num_key_value_heads": self.kv_heads, "vocab_size": self.vocab,
            "max_position_embeddings": self.max_len, "rms_norm_eps": 1e-6, "tie_word_embeddings": True,
            "bos_token_id": 0, "eos_token_id": 1}))
        tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(self.vocab)}, unk_token="w2"))
        tok.pre_tokenizer = pre_tokenizers.Whitespace()
        tok.save(str(path / "tokenizer.json"))
        if generation_config is not None:
            (path / "generation_config.json").write_text(json.dumps(generation_config))
        return path

    def gguf_file(self, path: Path, tokens: list[str | bytes] | None = None, eos_token_id: int = 1,
                  eot_token_id: int | None = None) -> Path:
        """The same weights as a llama GGUF file (float32 tensors, tied
        embedding). ``tokens``: the vocabulary as written (bytes are written
        as they are, so a test can write a vocabulary no reader can decode);
        by default ``w<i>``."""
        import gguf
        path = Path(path)
        names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, self.layers)
        w = gguf.GGUFWriter(str(path), "llama")
        w.add_block_count(self.layers)
        w.add_context_length(self.max_len)
        w.add_embedding_length(self.hidden)
        w.add_feed_forward_length(self.intermediate)
        w.add_head_count(self.heads)
        w.add_head_count_kv(self.kv_heads)
        w.add_layer_norm_rms_eps(1e-6)
        w.add_tokenizer_model("gpt2")
        tokens = tokens if tokens is not None else [f"w{i}" for i in range(self.vocab)]
        w.add_token_list(tokens)
        w.add_token_types([1] * len(tokens))
        w.add_token_merges([])
        w.add_bos_token_id(0)
        w.add_eos_token_id(eos_token_id)
        if eot_token_id is not None:
            w.add_eot_token_id(eot_token_id)
        for name, array in self.weights().items():
            for proj, n_head in (("q_proj", self.heads), ("k_proj", self.kv_heads)):
                if f".{proj}." in name:    # llama.cpp's converter permutes Q/K rows; the loader undoes it
                    array = array.reshape(n_head, 2, array.shape[0] // n_head // 2, -1).swapaxes(1, 2) \
                                 .reshape(array.shape)
            w.add_tensor(names.get_name(name, try_suffixes=(".weight",)), np.ascontiguousarray(array))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        return path
