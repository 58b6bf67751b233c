"""Tiny random models of every supported family saved as HF folders, for oracle and
integration tests.

``make_tiny_model(folder, arch)`` writes config.json, model.safetensors
(float64 by default, so argmax is never decided by rounding) and a
sentencepiece tokenizer (``tokenizer.model`` + ``tokenizer_config.json``,
trained on Python's own docs, vocab 512) that ``AutoTokenizer`` loads.

``patch_hf_float64(model)`` makes a transformers model compute RMSNorm, rotary,
MoE routing and (Gemma 2's eager attention) the attention softmax in float64
(transformers keeps them in float32 even in a float64 model), so it is a true
float64 oracle.
"""

from __future__ import annotations

import io
import json
import sys
import types
from pathlib import Path

import torch

TINY_DIMS = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=3,
)


def training_text(limit: int = 20000) -> list[str]:
    """Real English sentences from the standard library's bundled docs (no network)."""
    from pydoc_data.topics import topics

    text = "\n".join(topics[k] for k in sorted(topics))[:limit]
    return [line for line in text.splitlines() if line.strip()]


def train_sentencepiece(vocab_size: int = 512) -> bytes:
    """A BPE sentencepiece model with byte fallback (ids: unk 0, bos 1, eos 2, pad 3)."""
    import sentencepiece as spm

    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(training_text()),
        model_writer=buf,
        vocab_size=vocab_size,
        model_type="bpe",
        byte_fallback=True,
        character_coverage=1.0,
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        unk_id=0,
        bos_id=1,
        eos_id=2,
        pad_id=3,
        hard_vocab_limit=False,
    )
    return buf.getvalue()


#: Per-family extras on top of TINY_DIMS: small enough to build in ~0.1 s, big enough that
#: each family's own feature (q/k norms, routing, dense layers between MoE ones, LongRoPE,
#: partial rotary) decides tokens.
FAMILY_DIMS: dict[str, dict[str, object]] = {
    "llama": {},
    "qwen2": {},
    "mistral": {"sliding_window": None},
    "qwen3": {"head_dim": 16},
    "mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": None},
    # Layer 0 is MoE, layer 1 dense (mlp_only_layers).
    "qwen3_moe": {"head_dim": 16, "num_experts": 8, "num_experts_per_tok": 2,
                  "moe_intermediate_size": 32, "mlp_only_layers": [1], "norm_topk_prob": False},
    # LongRoPE with factor max/original = 2 (attention factor ~1.05), half the head rotated.
    "phi3": {"original_max_position_embeddings": 512,
             "rope_parameters": {"rope_type": "longrope", "rope_theta": 10000.0,
                                 "partial_rotary_factor": 0.5,
                                 "short_factor": [1.0, 1.3, 2.1, 3.7],
                                 "long_factor": [1.5, 2.9, 4.4, 8.0]}},
    # Sliding (window 16 < the 40-token prompts) and global layers alternating, a scale
    # other than head_dim ** -0.5, soft-caps small enough to bite.
    "gemma2": {"head_dim": 16, "query_pre_attn_scalar": 24, "sliding_window": 16,
               "attn_logit_softcapping": 3.0, "final_logit_softcapping": 4.0},
    # Two sliding layers (local rope base 1000), then a global one (base 1e5, linear x2).
    "gemma3": {"head_dim": 16, "query_pre_attn_scalar": 24, "sliding_window": 16,
               "num_hidden_layers": 3,
               "layer_types": ["sliding_attention", "sliding_attention", "full_attention"],
               "rope_parameters": {
                   "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e5},
                   "sliding_attention": {"rope_type": "default", "rope_theta": 1000.0}}},
    # Hybrid: three gated delta-net layers (2 key heads serving 4 value heads), then one
    # gated full-attention layer (a quarter of each head rotated), as Qwen3.5's pattern.
    "qwen3_5": {"head_dim": 16, "num_hidden_layers": 4, "linear_num_key_heads": 2,
                "linear_num_value_heads": 4, "linear_key_head_dim": 16,
                "linear_value_head_dim": 8, "linear_conv_kernel_dim": 4},
    # Hybrid: Qwen3.5's layers (delta-net projections interleaved per key head) with
    # MoE MLPs (8 experts, top 2, renormalised, a gated shared expert) except on layer 2,
    # kept dense by mlp_only_layers.
    "qwen3_next": {"head_dim": 16, "num_hidden_layers": 4, "linear_num_key_heads": 2,
                   "linear_num_value_heads": 4, "linear_key_head_dim": 16,
                   "linear_value_head_dim": 8, "linear_conv_kernel_dim": 4,
                   "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                   "shared_expert_intermediate_size": 48, "norm_topk_prob": True,
                   "decoder_sparse_step": 1, "mlp_only_layers": [2]},
    # Hybrid: Qwen3.5's layers with Qwen3-Next's MoE MLP on every layer (8 experts, top 2,
    # always renormalised, a gated shared expert).
    "qwen3_5_moe": {"head_dim": 16, "num_hidden_layers": 4, "linear_num_key_heads": 2,
                    "linear_num_value_heads": 4, "linear_key_head_dim": 16,
                    "linear_value_head_dim": 8, "linear_conv_kernel_dim": 4,
                    "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                    "shared_expert_intermediate_size": 48},
    # Hybrid: Mamba-2 layers (8 heads of 8 in 2 groups, state 16), a squared-ReLU MLP,
    # one attention layer (no rotary) and one MoE layer (8 experts in 2 groups, top 2 of
    # the best group, shared expert), as Nemotron-H's patterns; transformers' own scan
    # chunk (8) is shorter than the prompts, so its chunked path is what is compared.
    "nemotron_h": {"head_dim": 16, "num_hidden_layers": 6, "hybrid_override_pattern": "M-M*EM",
                   "mamba_num_heads": 8, "mamba_head_dim": 8, "n_groups": 2,
                   "ssm_state_size": 16, "conv_kernel": 4, "chunk_size": 8,
                   "layer_norm_epsilon": 1e-5, "n_routed_experts": 8, "num_experts_per_tok": 2,
                   "moe_intermediate_size": 32, "moe_shared_expert_intermediate_size": 48,
                   "n_group": 2, "topk_group": 1, "routed_scaling_factor": 2.5},
}  # fmt: skip


#: The families added after Llama / Qwen2 / Mistral, each with its own oracle tests.
NEW_FAMILIES = ("qwen3", "mixtral", "qwen3_moe", "phi3", "gemma2", "gemma3")
#: Hybrid families (recurrent layers beside attention), tested in tests/models/test_hybrid.py.
HYBRID_FAMILIES = ("qwen3_5", "qwen3_next", "qwen3_5_moe", "nemotron_h")


def tiny_config(arch: str = "llama", **overrides: object):
    """A transformers config for a tiny model of ``arch`` (a key of ``FAMILY_DIMS``)."""
    import transformers

    cls = {
        "llama": transformers.LlamaConfig,
        "qwen2": transformers.Qwen2Config,
        "mistral": transformers.MistralConfig,
        "qwen3": transformers.Qwen3Config,
        "mixtral": transformers.MixtralConfig,
        "qwen3_moe": transformers.Qwen3MoeConfig,
        "phi3": transformers.Phi3Config,
        "gemma2": transformers.Gemma2Config,
        "gemma3": transformers.Gemma3TextConfig,
        "qwen3_5": transformers.Qwen3_5TextConfig,
        "qwen3_next": transformers.Qwen3NextConfig,
        "qwen3_5_moe": transformers.Qwen3_5MoeTextConfig,
        "nemotron_h": transformers.NemotronHConfig,
    }[arch]
    return cls(**{**TINY_DIMS, **FAMILY_DIMS[arch], **overrides})


def make_tiny_model(
    folder: str | Path,
    arch: str = "llama",
    seed: int = 0,
    dtype: torch.dtype = torch.float64,
    tokenizer: bool = True,
    **overrides: object,
) -> Path:
    """Save a random tiny model of ``arch`` with a tokenizer (unless ``tokenizer`` is
    False: the caller brings one) into ``folder``; return it."""
    import transformers

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    config = tiny_config(arch, **overrides)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    # Random init gives tiny weights and near-flat logits; widen them so greedy
    # decoding has clear winners and the model's structure matters.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif p.dim() == 1:  # biases
                p.normal_(0.0, 0.1)
            else:
                p.normal_(0.0, 1.0 / p.shape[-1] ** 0.5)
            if name.endswith("A_log"):  # slow decays: the state remembers tens of tokens
                p.copy_(torch.empty_like(p).uniform_(0.005, 0.05).log())
            elif name.endswith("dt_bias"):
                p.normal_(-1.0, 0.5)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # a buffer: choices it decides
                b.normal_(0.0, 0.1)
    model.save_pretrained(folder)
    if not tokenizer:
        return folder
    (folder / "tokenizer.model").write_bytes(train_sentencepiece(config.vocab_size))
    tok_config = {
        "tokenizer_class": "LlamaTokenizer",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "pad_token": "<pad>",
        "add_bos_token": True,
        "add_eos_token": False,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(tok_config))
    return folder


def patch_hf_float64(model: torch.nn.Module) -> torch.nn.Module:
    """Make a float64 transformers model compute RMSNorm, rotary (default, linear or
    LongRoPE, partial rotary included; Gemma 3's per layer type) and MoE routing in
    float64; MoE experts run transformers' eager loop (its grouped matmul has no
    float64). Gemma 2's eager attention (its module's ``eager_attention_forward``) is
    replaced for the process by one whose softmax runs in float32 or the input dtype,
    whichever is wider: the same for half and float32 models."""
    if hasattr(model, "set_experts_implementation"):
        model.set_experts_implementation("eager")
    for module in model.modules():
        name = type(module).__name__
        if name.startswith(("Qwen3_5", "Qwen3Next")) and not name.endswith(
            ("TopKRouter", "NextRotaryEmbedding")
        ):
            prefix = next(p for p in ("Qwen3_5Moe", "Qwen3_5", "Qwen3Next") if name.startswith(p))
            _patch_qwen3_5(module, name.removeprefix(prefix))
        elif name.startswith("NemotronH"):
            _patch_nemotron_h(module, name)
        elif name.startswith("Gemma") and name.endswith("RMSNorm"):
            module.forward = types.MethodType(_gemma_rmsnorm64, module)
        elif name.startswith("Gemma2") and name.endswith("Attention"):
            sys.modules[type(module).__module__].eager_attention_forward = _eager64
        elif name == "Gemma3RotaryEmbedding":
            module.forward = types.MethodType(_gemma3_rotary64, module)
        elif name.endswith("RMSNorm"):
            module.forward = types.MethodType(_rmsnorm64, module)
        elif name.endswith("RotaryEmbedding"):
            cfg = module.config
            rope = cfg.rope_parameters
            if module.rope_type not in ("default", "longrope"):
                raise ValueError("patch_hf_float64 supports default and longrope rope only")
            head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
            dim = int(head_dim * rope.get("partial_rotary_factor", 1.0))
            inv = 1.0 / (rope["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
            module.inv_freq64 = module.long_inv_freq64 = inv
            module.long_from = None
            if module.rope_type == "longrope":
                module.inv_freq64 = inv / torch.tensor(rope["short_factor"], dtype=torch.float64)
                module.long_inv_freq64 = inv / torch.tensor(
                    rope["long_factor"], dtype=torch.float64
                )
                module.long_from = rope["original_max_position_embeddings"]
            module.forward = types.MethodType(_rotary64, module)
        elif name.endswith("TopKRouter"):
            module.forward = types.MethodType(_router64, module)
    return model


def _patch_qwen3_5(module: torch.nn.Module, name: str) -> None:
    """Qwen3.5 or Qwen3-Next (``name``: the class name after the family prefix) in float64: (1 + w) norms, the gated head norm, rotary (text positions),
    and the gated delta-net, whose decay transformers computes from float32 copies
    (``.float()``) and whose delta rule runs in float32: its forward is recompiled from
    transformers' own source with ``.float()`` as ``.double()``, and the module's two
    delta-rule functions become ``_delta_rule64``, the rule token by token in float64."""
    import inspect
    import textwrap

    if name == "RMSNorm":
        module.forward = types.MethodType(_gemma_rmsnorm64, module)
    elif name == "RMSNormGated":
        module.forward = types.MethodType(_gated_rmsnorm64, module)
    elif name == "TextRotaryEmbedding":
        module.forward = types.MethodType(_qwen3_5_rotary64, module)
    elif name == "GatedDeltaNet":
        mod = sys.modules[type(module).__module__]
        mod.torch_chunk_gated_delta_rule = _delta_rule64
        mod.torch_recurrent_gated_delta_rule = _delta_rule64
        src = textwrap.dedent(inspect.getsource(type(module).forward))
        src = src[src.index("def forward") :].replace(".float()", ".double()")
        scope: dict = {}
        exec(compile(src, mod.__file__, "exec"), mod.__dict__, scope)
        module.forward = types.MethodType(scope["forward"], module)


def _as_float64(mod, qualname: str):
    """Function or method ``qualname`` of module ``mod`` recompiled from the module's
    source (decorators dropped) with every float32 cast a float64 one, in the module's
    globals (transformers wraps some of them in objects ``inspect`` cannot read)."""
    import ast
    import inspect

    src = inspect.getsource(mod)
    body = ast.parse(src).body
    node = None
    for part in qualname.split("."):
        node = next(n for n in body if getattr(n, "name", None) == part)
        body = node.body
    node.decorator_list = []
    code = ast.get_source_segment(src, node, padded=False) or ""
    code = code[code.index("def ") :].replace(".float()", ".double()")
    code = code.replace("torch.float32", "torch.float64")
    import textwrap

    scope: dict = {}
    exec(compile(textwrap.dedent(code), mod.__file__, "exec"), mod.__dict__, scope)
    return scope[qualname.split(".")[-1]]


def _patch_nemotron_h(module: torch.nn.Module, name: str) -> None:
    """Nemotron-H in float64: transformers computes its norms, the gated norm, the
    Mamba-2 decay (``A_log.float()``), its scans, the expert routing and the logits
    (``.float()``) in float32; the mixer's and the model's forwards and the module's scan functions are
    recompiled from transformers' own source with those casts float64 ones."""
    mod = sys.modules[type(module).__module__]
    if not getattr(mod, "_float64", False):
        for fn in ("mamba2_scan_forward", "mamba2_chunk_scan", "mamba2_selective_state_update"):
            setattr(mod, fn, _as_float64(mod, fn))
        mod._float64 = True
    if name in ("NemotronHRMSNorm", "NemotronHRMSNormGated", "NemotronHMamba2Mixer",
                "NemotronHTopkRouter", "NemotronHForCausalLM"):  # fmt: skip
        forward = _as_float64(mod, f"{name}.forward")
        module.forward = types.MethodType(forward, module)


def _gated_rmsnorm64(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    h = x.to(torch.float64)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
    h = self.weight * h.to(x.dtype)
    return (h * torch.nn.functional.silu(gate.to(torch.float64))).to(x.dtype)


def _qwen3_5_rotary64(self, x: torch.Tensor, position_ids: torch.Tensor):
    # Text positions are the same on the three rotary grids: take the first.
    rope = self.config.rope_parameters
    head_dim = self.config.head_dim
    dim = int(head_dim * rope.get("partial_rotary_factor", 1.0))
    inv = 1.0 / (rope["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    freqs = position_ids[0][..., None].to(torch.float64) * inv.to(x.device)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


def _delta_rule64(query, key, value, g, beta, initial_state=None, output_final_state=False,
                  use_qk_l2norm_in_kernel=False, **kwargs):  # fmt: skip
    """The gated delta rule by its definition, one token at a time, in float64 (the
    signature of transformers' ``torch_*_gated_delta_rule``)."""
    dtype = query.dtype
    _, n, k_heads, dk = key.shape
    v_heads = value.shape[2]
    q, k, v, g, beta = (t.to(torch.float64) for t in (query, key, value, g, beta))
    if use_qk_l2norm_in_kernel:
        q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6)
        k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    q = q * dk**-0.5
    q = q.repeat_interleave(v_heads // k_heads, dim=2)
    k = k.repeat_interleave(v_heads // k_heads, dim=2)
    b = key.shape[0]
    s = torch.zeros(b, v_heads, dk, value.shape[-1], dtype=torch.float64)
    if initial_state is not None:
        s = initial_state.to(torch.float64).clone()
    out = torch.zeros(b, n, v_heads, value.shape[-1], dtype=torch.float64)
    for t in range(n):
        s = s * g[:, t].exp()[..., None, None]
        read = (s * k[:, t, :, :, None]).sum(-2)
        s = s + k[:, t, :, :, None] * (beta[:, t, :, None] * (v[:, t] - read))[:, :, None, :]
        out[:, t] = (s * q[:, t, :, :, None]).sum(-2)
    return out.to(dtype), (s if output_final_state else None)


def _rmsnorm64(self, x: torch.Tensor) -> torch.Tensor:
    h = x.to(torch.float64)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
    return self.weight * h.to(x.dtype)


def _gemma_rmsnorm64(self, x: torch.Tensor) -> torch.Tensor:
    h = x.to(torch.float64)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
    return (h * (1.0 + self.weight.to(torch.float64))).to(x.dtype)


def _inv_freq64(rope: dict, dim: int) -> torch.Tensor:
    """Default or linear-scaled inverse frequencies in float64."""
    inv = 1.0 / (rope["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    if rope.get("rope_type", "default") == "linear":
        return inv / rope["factor"]
    if rope.get("rope_type", "default") != "default":
        raise ValueError("Gemma 3's float64 rotary supports default and linear rope only")
    return inv


def _gemma3_rotary64(self, x: torch.Tensor, position_ids: torch.Tensor, layer_type: str):
    inv = _inv_freq64(self.config.rope_parameters[layer_type], self.config.head_dim)
    freqs = position_ids[..., None].to(torch.float64) * inv.to(x.device)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


def _eager64(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
             softcap=None, **kwargs):  # fmt: skip
    """transformers' eager attention (Gemma 2's: soft-cap, then mask) with the softmax in
    float32 or the input dtype, whichever is wider."""
    from transformers.models.gemma2.modeling_gemma2 import repeat_kv

    key = repeat_kv(key, module.num_key_value_groups)
    value = repeat_kv(value, module.num_key_value_groups)
    scores = torch.matmul(query, key.transpose(2, 3)) * scaling
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if attention_mask is not None:
        scores = scores + attention_mask
    wide = torch.promote_types(query.dtype, torch.float32)
    probs = torch.softmax(scores, dim=-1, dtype=wide).to(query.dtype)
    return torch.matmul(probs, value).transpose(1, 2).contiguous(), probs


def _rotary64(self, x: torch.Tensor, position_ids: torch.Tensor):
    # transformers picks LongRoPE's long factors for every position once the forward's
    # largest position reaches the original context.
    long = self.long_from is not None and int(position_ids.max()) + 1 > self.long_from
    inv = self.long_inv_freq64 if long else self.inv_freq64
    freqs = position_ids[..., None].to(torch.float64) * inv.to(x.device)
    emb = torch.cat((freqs, freqs), dim=-1)
    scale = getattr(self, "attention_scaling", 1.0)
    return (emb.cos() * scale).to(x.dtype), (emb.sin() * scale).to(x.dtype)


def _router64(self, hidden_states: torch.Tensor):
    """transformers' top-k router (Mixtral: always renormalised; Qwen3-MoE: ``norm_topk_prob``)
    with the softmax in float64."""
    logits = torch.nn.functional.linear(hidden_states.reshape(-1, self.hidden_dim), self.weight)
    probs = torch.softmax(logits.to(torch.float64), dim=-1)
    top, index = torch.topk(probs, self.top_k, dim=-1)
    if getattr(self, "norm_topk_prob", True):
        top = top / top.sum(dim=-1, keepdim=True)
    return logits, top.to(logits.dtype), index


def load_hf_float64(folder: str | Path) -> torch.nn.Module:
    """The HF transformers model saved in ``folder``, in float64 throughout, for evaluation."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float64)
    return patch_hf_float64(model.eval())


def hf_greedy(hf: torch.nn.Module, prompt, n: int) -> tuple[list[int], torch.Tensor]:
    """The oracle: HF's greedy continuation by full recomputation (no cache), and the
    first step's logits."""
    ids = torch.as_tensor(prompt, dtype=torch.long)[None]
    first = None
    with torch.no_grad():
        for _ in range(n):
            logits = hf(input_ids=ids).logits[0, -1]
            first = logits if first is None else first
            ids = torch.cat([ids, logits.argmax().view(1, 1)], dim=1)
    return ids[0, len(prompt) :].tolist(), first


def hf_cached_greedy(hf: torch.nn.Module, prompt, n: int) -> list[int]:
    """HF's greedy continuation with its own KV cache (one prefill, then one token a step):
    much faster than ``hf_greedy``, and for LongRoPE the semantics our per-position
    rotary follows past the original context."""
    from transformers import DynamicCache

    tokens: list[int] = []
    with torch.no_grad():
        ids = torch.as_tensor(prompt, dtype=torch.long)[None]
        out = hf(input_ids=ids, cache=DynamicCache(config=hf.config), use_cache=True)
        while True:
            tokens.append(int(out.logits[0, -1].argmax()))
            if len(tokens) == n:
                return tokens
            nxt = torch.tensor([[tokens[-1]]])
            out = hf(input_ids=nxt, cache=out.past_key_values, use_cache=True)


def use_char_tokenizer(folder: str | Path) -> Path:
    """Replace a tiny model's tokenizer by one token per character (printable ASCII
    and newline, ids 4..99 after unk, bos, eos, pad): every string has exactly one
    tokenization. Built with ``tokenizers``, saved as ``tokenizer.json``."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    folder = Path(folder)
    specials = ["<unk>", "<s>", "</s>", "<pad>"]
    chars = [chr(c) for c in range(32, 127)] + ["\n"]
    vocab = {t: i for i, t in enumerate(specials + chars)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.decoder = decoders.Fuse()
    for name in ("tokenizer.model", "tokenizer_config.json"):
        (folder / name).unlink(missing_ok=True)
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
    )
    hf.save_pretrained(folder)
    return folder


def use_tokenizer_of(folder: str | Path, source: str | Path) -> Path:
    """Replace a tiny model's tokenizer by the one in ``source`` (its tokenizer.json
    and tokenizer_config.json), e.g. the embedded SmolLM2's byte-level BPE."""
    import shutil

    folder, source = Path(folder), Path(source)
    (folder / "tokenizer.model").unlink(missing_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(source / name, folder / name)
    return folder
