"""An outside model, written from docs/plugins.md's Model contract alone:
``ExampleLlamaForCausalLM``, a plain Llama (RMS norm, rotary, grouped
attention, SwiGLU) in eager Paddle, float32 weights, registered under its
own architecture name. It imports ``fdx.core.interfaces`` only: the
attention goes through the ``AttentionContext`` the runner hands it.

It reads the step's ``meta.layout`` (``BatchLayout``: which request each
row is) and runs the activation hooks of ``meta.activations`` at the three
named points, as the Model contract says: ``seen_layouts`` keeps, per
step, the request ids and their row spans it saw.

``ExampleNoTapForCausalLM`` is the same model saying it does not fill the
hidden-state tap (``supports_hidden_states`` False), and ``NotAModel`` a
class that does not subclass the contract: the engine refuses both where
the config asks what they cannot give.
"""
from __future__ import annotations

import numpy as np

from fdx.core.hookspecs import hookimpl
from fdx.core.interfaces import Model


class _Shape:
    def __init__(self, config: dict):
        self.num_layers = config["num_hidden_layers"]
        self.num_heads = config["num_attention_heads"]
        self.num_kv_heads = config.get("num_key_value_heads") or self.num_heads
        self.hidden_size = config["hidden_size"]
        self.head_dim = config.get("head_dim") or self.hidden_size // self.num_heads
        self.vocab_size = config["vocab_size"]
        self.max_position_embeddings = config["max_position_embeddings"]
        self.intermediate_size = config["intermediate_size"]
        self.eps = config.get("rms_norm_eps", 1e-6)
        self.theta = config.get("rope_theta") or (config.get("rope_parameters") or {}).get("rope_theta", 10000.0)
        self.tie = config.get("tie_word_embeddings", False)


class ExampleLlamaForCausalLM(Model):
    supports_hidden_states = True
    supports_activation_hooks = True

    @classmethod
    def parse_config(cls, config):
        return _Shape(config)

    def __init__(self, settings, context):
        import paddle
        config, weights = context.hf_config, context.weights
        s = self.shape = _Shape(config)
        for name in ("num_layers", "num_heads", "num_kv_heads", "head_dim", "vocab_size",
                     "max_position_embeddings"):
            setattr(self, name, getattr(s, name))

        def take(name, transpose=False):
            a = np.asarray(weights.pop(name), dtype=np.float32)
            return paddle.to_tensor(np.ascontiguousarray(a.T) if transpose else a)

        self.embed = take("model.embed_tokens.weight")                      # [vocab, hidden]
        self.layers = []
        for i in range(s.num_layers):
            p = f"model.layers.{i}"
            self.layers.append({
                "in_norm": take(f"{p}.input_layernorm.weight"),
                "post_norm": take(f"{p}.post_attention_layernorm.weight"),
                "q": take(f"{p}.self_attn.q_proj.weight", True), "k": take(f"{p}.self_attn.k_proj.weight", True),
                "v": take(f"{p}.self_attn.v_proj.weight", True), "o": take(f"{p}.self_attn.o_proj.weight", True),
                "gate": take(f"{p}.mlp.gate_proj.weight", True), "up": take(f"{p}.mlp.up_proj.weight", True),
                "down": take(f"{p}.mlp.down_proj.weight", True)})
        self.norm = take("model.norm.weight")
        head = weights.pop("lm_head.weight", None)
        self.head = (self.embed if s.tie or head is None else paddle.to_tensor(np.asarray(head, np.float32))).T
        inv = 1.0 / (s.theta ** (np.arange(0, s.head_dim, 2, dtype=np.float64) / s.head_dim))
        freqs = np.outer(np.arange(s.max_position_embeddings, dtype=np.float64), inv)
        emb = np.concatenate([freqs, freqs], axis=-1)
        self.cos, self.sin = paddle.to_tensor(np.cos(emb).astype("float32")), paddle.to_tensor(np.sin(emb).astype("float32"))
        self.seen_layouts: list[dict[str, tuple[int, int, int]]] = []   # per step: id -> (first row, rows, position)

    def weight_bytes(self):
        tensors = [self.embed, self.norm] + [t for layer in self.layers for t in layer.values()]
        if not self.shape.tie:
            tensors.append(self.head)
        return {"f32": int(sum(int(np.prod(t.shape)) * 4 for t in tensors))}

    def _norm(self, x, w):
        import paddle
        return x * paddle.rsqrt((x * x).mean(axis=-1, keepdim=True) + self.shape.eps) * w

    def _rope(self, x, positions):
        import paddle
        cos = paddle.gather(self.cos, positions).unsqueeze(1)
        sin = paddle.gather(self.sin, positions).unsqueeze(1)
        half = x.shape[-1] // 2
        return x * cos + paddle.concat([-x[..., half:], x[..., :half]], axis=-1) * sin

    def forward(self, input_ids, positions, kv_caches, meta, logits_indices):
        import paddle
        import paddle.nn.functional as F
        s = self.shape
        n = input_ids.shape[0]
        x = paddle.gather(self.embed, input_ids)
        hooks = meta.connector                 # the KV connector's per-layer calls (core/interfaces.py)
        layout, act = meta.layout, meta.activations    # this step's rows by request; its activation hooks
        if layout is not None:                 # None only outside a step (a memory profile)
            self.seen_layouts.append({rid: (r0, count, p0) for rid, r0, count, p0 in zip(
                layout.request_ids, layout.row_starts, layout.num_rows, layout.start_positions)})
        for i, (layer, (k_cache, v_cache)) in enumerate(zip(self.layers, kv_caches)):
            if hooks is not None:
                hooks.wait_for_layer_load(i)
            h = self._norm(x, layer["in_norm"])
            q = paddle.matmul(h, layer["q"]).reshape([n, s.num_heads, s.head_dim])
            k = paddle.matmul(h, layer["k"]).reshape([n, s.num_kv_heads, s.head_dim])
            v = paddle.matmul(h, layer["v"]).reshape([n, s.num_kv_heads, s.head_dim])
            q, k = self._rope(q, positions), self._rope(k, positions)
            meta.write_kv(k_cache, v_cache, k, v)
            a = meta.attention(q, k_cache, v_cache, s.head_dim ** -0.5).reshape([n, s.num_heads * s.head_dim])
            if hooks is not None:
                hooks.save_kv_layer(i, kv_caches[i], meta)
            a = paddle.matmul(a, layer["o"])
            if act is not None:
                a = act.apply("attn_out", i, a)
            x = x + a
            h = self._norm(x, layer["post_norm"])
            m = paddle.matmul(F.silu(paddle.matmul(h, layer["gate"])) * paddle.matmul(h, layer["up"]), layer["down"])
            if act is not None:
                m = act.apply("mlp_out", i, m)
            x = x + m
            if act is not None:
                x = act.apply("residual", i, x)    # the residual stream after layer i
        x = paddle.gather(self._norm(x, self.norm), logits_indices)
        if self.capture_hidden_states:
            self.last_hidden_states = x
        return paddle.matmul(x, self.head)


class ExampleNoTapForCausalLM(ExampleLlamaForCausalLM):
    supports_hidden_states = False
    supports_activation_hooks = False


class NotAModel:
    """Registered as a model without subclassing the contract."""
    def __init__(self, config, weights):
        raise AssertionError("the engine must refuse this class before constructing it")


@hookimpl
def fdx_register_models(register):
    register("ExampleLlamaForCausalLM", ExampleLlamaForCausalLM)
    register("ExampleNoTapForCausalLM", ExampleNoTapForCausalLM)
    register("ExampleNotAModel", NotAModel)
