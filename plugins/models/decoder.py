"""A decoder-only transformer (Llama family) over a paged KV cache.

Llama, Qwen2, Qwen3 and dense ERNIE-4.5 are one network with a few
switches: biases, per-head q/k norms, rotary pairing and defaults. Each
architecture module is a thin subclass of `DecoderForCausalLM` that turns
its Hugging Face config.json into a `DecoderConfig`.

The compute blocks (attention, MLP, the rotary tables, the weights'
reader) are in `fdx.plugins.models.layers`, imported when a model is
built: this module, what the plugin manager and a tensor parallel engine
process load (the config parsing, the class's shape), imports no Paddle.

Every matrix (linear layers, embedding, LM head) is a ``LinearWeight``
that the weight format (``model.quantization``, core/interfaces.py) made:
the model calls ``matmul``, ``embedding``, ``take_rows`` / ``take_cols``
and ``cast`` on it and never sees the storage. q/k/v are fused into one
``[(H + 2*KVH) * D, hidden]`` weight and gate/up into ``[2 * I, hidden]``
(``WeightFormat.fuse``). With the float32 format (``none``) the layout is
the one chosen for speed (DESIGN.md, "Facts measured"): linear weights as
[in, out] and a pre-transposed lm_head copy even when tied; a quantized
tied head reads the embedding's own table.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, ClassVar

from fdx.core.interfaces import AttentionContext, BuildContext, LinearWeight, Model
from fdx.plugins.models.decoder_config import DecoderConfig

if TYPE_CHECKING:
    from paddle import Tensor

    from fdx.plugins.models.layers import KVCache


# --- reading a Hugging Face config.json ------------------------------------

def _rope_settings(hf: dict[str, Any], default_theta: float, arch: str
                   ) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, llama3 scaling or None) from either config format:
    transformers 5 writes ``rope_parameters``; 4.x wrote ``rope_theta`` and
    ``rope_scaling``."""
    params = hf.get("rope_parameters") or {}
    scaling = hf.get("rope_scaling") or params
    theta = float(params.get("rope_theta", hf.get("rope_theta", default_theta)))
    partial = scaling.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        raise NotImplementedError(f"{arch}: partial_rotary_factor={partial} is not supported")
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "default":
        return theta, None
    if rope_type == "llama3":
        return theta, dict(scaling)
    raise NotImplementedError(
        f"{arch}: rope scaling type {rope_type!r} is not supported "
        "(supported: default, llama3)")


def decoder_config(hf: dict[str, Any], arch: str, defaults: dict[str, Any],
                   **switches: Any) -> DecoderConfig:
    """The common part of every variant's config parsing.

    ``defaults`` stands in for keys a config.json may omit; they are the
    values of the matching transformers config class. ``switches`` are the
    variant's own DecoderConfig fields (biases, qk_norm, ...)."""
    def get(key: str) -> Any:
        value = hf.get(key)
        if value is not None:
            return value
        if key in defaults:
            return defaults[key]
        raise ValueError(f"{arch} config.json is missing {key!r}")

    act = get("hidden_act")
    if act != "silu":
        raise NotImplementedError(f"{arch}: hidden_act {act!r} is not supported (only silu)")
    num_layers = get("num_hidden_layers")
    layer_types = hf.get("layer_types") or []
    sliding = "sliding_attention" in layer_types or (
        not layer_types and hf.get("use_sliding_window")
        and num_layers > hf.get("max_window_layers", 28))
    if sliding:
        raise NotImplementedError(f"{arch}: sliding-window attention is not supported")

    num_heads, hidden_size = get("num_attention_heads"), get("hidden_size")
    num_kv_heads = hf.get("num_key_value_heads") or num_heads
    if num_heads % num_kv_heads:
        raise ValueError(f"{arch}: num_attention_heads={num_heads} is not a multiple "
                         f"of num_key_value_heads={num_kv_heads}")
    # A head_dim key that is absent takes the class default (128 for Qwen3 and
    # ERNIE); one set to null means hidden_size // heads, as in transformers.
    head_dim = hf["head_dim"] if "head_dim" in hf else defaults.get("head_dim")
    theta, scaling = _rope_settings(hf, defaults["rope_theta"], arch)
    return DecoderConfig(
        vocab_size=get("vocab_size"),
        hidden_size=hidden_size,
        intermediate_size=get("intermediate_size"),
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim or hidden_size // num_heads,
        max_position_embeddings=get("max_position_embeddings"),
        rms_norm_eps=float(get("rms_norm_eps")),
        rope_theta=theta,
        rope_scaling=scaling,
        tie_word_embeddings=bool(get("tie_word_embeddings")),
        **switches,
    )


# --- the model -----------------------------------------------------------------

class DecoderForCausalLM(Model):
    """Constructed as ``cls(settings, context)`` with ``context.hf_config``
    (the HF config.json dict), ``context.weights`` (HF-named: float32
    numpy, or ``QuantizedTensor`` for a GGUF block tensor when the format
    keeps blocks) and ``context.weight_format`` (None: float32, ``none``).
    The weights dict is consumed: each entry is popped as it is converted,
    so the numpy copy is freed once the caller drops its own references;
    entries the model does not use are left in it."""

    architecture: ClassVar[str] = "DecoderForCausalLM"
    supports_hidden_states = True
    supports_pooling = True
    supports_activation_hooks = True
    supports_lora = True
    takes_weight_format = True

    @classmethod
    def parse_config(cls, config: dict[str, Any]) -> DecoderConfig:
        raise NotImplementedError

    def __init__(self, settings: Any, context: BuildContext):
        config, weights, weight_format = context.hf_config, context.weights, context.weight_format
        if weight_format is None:
            from fdx.plugins.models.weight_formats import NoQuantization
            weight_format = NoQuantization()
        self.weight_format = weight_format
        cfg = self.cfg = self.parse_config(config)
        self.num_layers = cfg.num_layers
        self.num_heads = cfg.num_heads
        self.num_kv_heads = cfg.num_kv_heads
        self.capture_hidden_states = False        # research tap: keep the final hidden states
        self.last_hidden_states: Tensor | None = None
        self.capture_pooling_hidden_states = False  # model.task embed: keep every token row's final state
        self.pooling_hidden_states: Tensor | None = None
        self.head_dim = cfg.head_dim
        self.vocab_size = cfg.vocab_size
        self.max_position_embeddings = cfg.max_position_embeddings

        from fdx.plugins.models.layers import Weights, build_rotary
        w = Weights(self.architecture, weights, weight_format)
        self.embed_tokens = w.matrix("model.embed_tokens.weight", (cfg.vocab_size, cfg.hidden_size), "embedding")
        if cfg.tie_word_embeddings:
            weights.pop("lm_head.weight", None)
            self.lm_head = weight_format.tied_head(self.embed_tokens)
        else:
            self.lm_head = w.matrix("lm_head.weight", (cfg.vocab_size, cfg.hidden_size), "lm_head")

        rope = build_rotary(cfg)
        self.layers = [self.make_layer(cfg, w, i, rope) for i in range(cfg.num_layers)]
        self.norm = w.vector("model.norm.weight", cfg.hidden_size)

    def make_layer(self, cfg: DecoderConfig, w, index: int, rope):
        """Decoder layer ``index`` (a subclass builds other MLPs here: MoE)."""
        from fdx.plugins.models.layers import DecoderLayer
        return DecoderLayer(cfg, w, index, rope)

    def shard(self, rank: int, world: int, reduce: Callable[[Tensor], Tensor]) -> None:
        """Keep only tensor-parallel rank ``rank`` of ``world``'s part: its
        query and KV heads in attention, its intermediate columns in the MLP;
        ``reduce`` sums a tensor over the ranks (after o_proj and down_proj).
        Embedding, norms and lm_head stay whole on every rank."""
        cfg = self.cfg
        for key, count in (("num_attention_heads", cfg.num_heads), ("num_key_value_heads", cfg.num_kv_heads),
                           ("intermediate_size", cfg.intermediate_size)):
            if count % world:
                raise ValueError(f"{self.architecture}: {key}={count} does not divide by "
                                 f"tensor_parallel_size={world}")
        for layer in self.layers:
            layer.attn.shard(rank, world, reduce)
            layer.mlp.shard(rank, world, reduce)
            layer.weights_changed()
        self.num_heads, self.num_kv_heads = cfg.num_heads // world, cfg.num_kv_heads // world

    def lora_shapes(self) -> dict[str, tuple[int, int]]:
        cfg = self.cfg
        h, q, kv, i = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, \
            cfg.intermediate_size
        return {"q_proj": (q, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, q),
                "gate_proj": (i, h), "up_proj": (i, h), "down_proj": (h, i)}

    def load_lora(self, name: str, adapter) -> None:
        """Each layer's share of ``adapter`` (fdx.core.lora.LoRAWeights, checked):
        q/k/v and gate/up fused as their base weights, sharded as they are."""
        from fdx.plugins.models.layers import lora_slot
        shapes, m, s = self.lora_shapes(), adapter.modules, adapter.scale
        for i, layer in enumerate(self.layers):
            a, f = layer.attn, layer.mlp
            for held, names, rows, cols in (
                    (a.lora_qkv, ("q_proj", "k_proj", "v_proj"), a.qkv_rows, None),
                    (a.lora_o, ("o_proj",), None, a.o_cols),
                    (f.lora_gate_up, ("gate_proj", "up_proj"), f.gate_up_rows, None),
                    (f.lora_down, ("down_proj",), None, f.down_cols)):
                slot = lora_slot([m.get((i, n)) for n in names], [shapes[n][0] for n in names], s, rows, cols)
                if slot is not None:
                    held[name] = slot

    def unload_lora(self, name: str) -> None:
        for layer in self.layers:
            for held in (layer.attn.lora_qkv, layer.attn.lora_o, layer.mlp.lora_gate_up, layer.mlp.lora_down):
                held.pop(name, None)

    def drop_lm_head(self) -> None:
        """A rank that never reads logits (tensor parallel ranks above 0):
        a 1-wide float32 head in place of the vocabulary."""
        import paddle

        from fdx.plugins.models.weight_formats import DenseWeight
        self.lm_head = DenseWeight(paddle.zeros([self.cfg.hidden_size, 1], dtype=getattr(self, "dtype", "float32")))

    def weight_bytes(self) -> dict[str, int]:
        """Bytes of weights held, by kind ("q4_1", "f32", ...): every
        matrix, norm and bias once (a tied head that reads the embedding's
        table is not counted twice), rotary tables left out."""
        from fdx.plugins.models.weight_formats import weight_bytes
        held = [self.embed_tokens, self.norm] + ([] if self.lm_head is self.embed_tokens else [self.lm_head])
        for layer in self.layers:
            a, m = layer.attn, layer.mlp
            held += [layer.input_norm, layer.post_norm, a.wqkv, a.bqkv, a.wo, a.bo, a.q_norm, a.k_norm,
                     m.w_gate_up, m.b_gate_up, m.w_down, m.b_down]
        return weight_bytes(held)

    def cast(self, dtype: str) -> None:
        """Hold every weight (and the rotary tables) in ``dtype``; logits come
        out in it too (the runner reads them as float32)."""
        def conv(obj, names):
            for name in names:
                t = getattr(obj, name)
                if t is not None:
                    setattr(obj, name, t.cast(dtype) if isinstance(t, LinearWeight) else t.astype(dtype))
        tied = self.lm_head is self.embed_tokens
        conv(self, ("embed_tokens", "norm") if tied else ("embed_tokens", "lm_head", "norm"))
        if tied:
            self.lm_head = self.embed_tokens
        ropes = set()
        for layer in self.layers:
            conv(layer, ("input_norm", "post_norm"))
            conv(layer.attn, ("wqkv", "bqkv", "wo", "bo", "q_norm", "k_norm"))
            conv(layer.mlp, ("w_gate_up", "b_gate_up", "w_down", "b_down"))
            layer.weights_changed()
            ropes.add(layer.attn.rope)
        for rope in ropes:
            conv(rope, [n for n in ("cos_cache", "sin_cache") if hasattr(rope, n)])
        self.dtype = dtype

    def forward(self, input_ids: Tensor, positions: Tensor, kv_caches: list[KVCache],
                meta: AttentionContext, logits_indices: Tensor) -> Tensor:
        """Run the new tokens of a mixed batch; float32 logits [M, vocab]
        for the rows in ``logits_indices`` only. ``meta`` is an
        ``AttentionContext``: the attention backend and the step's metadata."""
        import paddle

        from fdx.ops.norm import add_rms_norm
        x = self.embed_tokens.embedding(input_ids)
        residual = None
        hooks = meta.connector              # the KV connector's per-layer calls, only when one runs
        act = meta.activations              # the step's activation hooks, only when a request has some
        lora = meta.lora                    # the step's LoRA adapter groups, only when a request has one
        # the compiled layers before the first hooked one (all of them without activation hooks), when
        # the kernel port takes the step (fdx.ops.layer_port; with a KV connector it calls the
        # connector's per-layer hooks around each). A step with a LoRA adapter runs every layer
        # composed, for every row (the fused kernels take no adapter).
        first = 0 if lora is not None else self.num_layers if act is None else act.layers[0]
        got = None
        if first > 0:
            from fdx.ops import layer_port
            got = layer_port.decoder_stack(x, [layer.fused for layer in self.layers[:first]], kv_caches[:first], meta)
        done = 0
        if got is not None:
            x, residual = got
            done = first
        for i in range(done, self.num_layers):
            layer, kv_cache = self.layers[i], kv_caches[i]
            if hooks is not None:
                hooks.wait_for_layer_load(i)
            if lora is not None:
                x, residual = layer.composed(x, residual, positions, kv_cache, meta, act, i)
                if act is not None:
                    x = act.apply_residual(i, x, residual)
            elif act is not None and act.hooked(i):
                x, residual = layer.hooked(i, x, residual, positions, kv_cache, meta, act)
            else:
                x, residual = layer(x, residual, positions, kv_cache, meta)
            if hooks is not None:
                hooks.save_kv_layer(i, kv_cache, meta)
        x, _ = add_rms_norm(x, residual, self.norm, self.cfg.rms_norm_eps)
        if self.capture_pooling_hidden_states:
            self.pooling_hidden_states = x
        x = paddle.gather(x, logits_indices)
        if self.capture_hidden_states:
            self.last_hidden_states = x
        return self.lm_head.matmul(x)

    __call__ = forward
