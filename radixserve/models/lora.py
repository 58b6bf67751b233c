"""LoRA adapters in PEFT's format, laid out for our fused layers.

A PEFT LoRA folder holds ``adapter_config.json`` and ``adapter_model.safetensors``
with, per adapted module, ``...{module}.lora_A.weight`` [r, in] and
``...{module}.lora_B.weight`` [out, r]; the module computes
``base(x) + scaling * B (A x)``, ``scaling = lora_alpha / r`` (``lora_alpha / sqrt(r)``
with ``use_rslora``).

Our layers fuse q/k/v into ``qkv_proj`` and gate/up into ``gate_up_proj``
(``checkpoint.py``), so an adapter is stored per layer and per fused module
(``qkv``, ``o``, ``gate_up``, ``down``) as two matrices for one pair of products:
``a`` [in, R], the A matrices of the targeted sub-projections side by side (R is
their ranks summed), and ``b`` [R, out], their B matrices (scaled) in the rows of
the fused output they write, zero elsewhere. ``delta = (x a) b`` is then every
sub-projection's LoRA term at once. Phi-3's checkpoint names (``qkv_proj``,
``gate_up_proj``) are accepted as targets too.

Tensor parallelism shards an adapter like its base layer (``sharding.py``):
column-parallel layers (``qkv``, ``gate_up``) keep ``a`` whole and take this rank's
output columns of ``b``; row-parallel layers (``o``, ``down``) take this rank's input
rows of ``a`` and keep ``b`` whole, so each rank's ``b (a_r x_r)`` is a partial sum
that the layer's all-reduce completes, like its base product.

``load_adapter`` refuses, naming what is wrong, anything it cannot apply exactly:
missing files, a rank above ``max_rank``, tensors whose shapes do not fit this model
(another base model), modules other than the seven projections, and PEFT options
that change the math (DoRA, biases, ``rank_pattern``/``alpha_pattern``,
``modules_to_save``, ``fan_in_fan_out``, ``layers_to_transform``). The adapter's
``digest`` is a SHA-256 over its tensors (names, dtypes, shapes, bytes) and its
scaling: the cache namespace of its requests (docs/lora.md), so an adapter is named
by what it computes, never by its name.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from radixserve.models.config import ModelConfig
from radixserve.models.sharding import Shard, head_shard

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"

#: The fused modules, in the order a layer runs them.
MODULES = ("qkv", "o", "gate_up", "down")
#: Row-parallel modules (their input features are split over ranks).
ROW_PARALLEL = ("o", "down")

_NAME = re.compile(
    r"^(?:base_model\.model\.)?model\.layers\.(\d+)\."
    r"(self_attn|mlp)\.(q|k|v|o|qkv|gate|up|down|gate_up)_proj\.lora_([AB])(?:\.[^.]+)?\.weight$"
)

#: PEFT config keys that change the math, and the values we apply exactly.
_PLAIN = {
    "use_dora": (False, None),
    "modules_to_save": (None, []),
    "rank_pattern": ({}, None),
    "alpha_pattern": ({}, None),
    "fan_in_fan_out": (False, None),
    "layers_to_transform": (None, []),
    "layer_replication": (None, []),
    "lora_bias": (False, None),
    "target_parameters": (None, []),
    "trainable_token_indices": (None, {}),
}


class LoraError(ValueError):
    """An adapter that cannot be served, and why."""


@dataclass
class LoraAdapter:
    """One adapter's weights for this rank: ``layers[i][module] = (a, b)`` for the
    modules it adapts (``a`` [in, R], ``b`` [R, out], the scaling folded into ``b``)."""

    name: str
    path: str
    rank: int
    scaling: float
    digest: str
    targets: tuple[str, ...]
    layers: list[dict[str, tuple[torch.Tensor, torch.Tensor]]] = field(default_factory=list)

    def nbytes(self) -> int:
        return sum(
            t.numel() * t.element_size() for mods in self.layers for ab in mods.values() for t in ab
        )


def read_config(path: str | Path) -> dict:
    """``adapter_config.json`` of a PEFT LoRA folder, checked (LoraError otherwise)."""
    folder = Path(path)
    if not folder.is_dir():
        raise LoraError(f"LoRA adapter {str(path)!r}: no such directory")
    cfg_file = folder / CONFIG_FILE
    if not cfg_file.is_file():
        raise LoraError(f"LoRA adapter {str(path)!r}: {CONFIG_FILE} is missing")
    try:
        cfg = json.loads(cfg_file.read_text())
    except (OSError, ValueError) as e:
        raise LoraError(f"LoRA adapter {str(path)!r}: {CONFIG_FILE} is not valid JSON ({e})") from e
    if not isinstance(cfg, dict):
        raise LoraError(f"LoRA adapter {str(path)!r}: {CONFIG_FILE} is not a JSON object")
    if cfg.get("peft_type", "LORA") != "LORA":
        raise LoraError(
            f"LoRA adapter {str(path)!r}: peft_type is {cfg.get('peft_type')!r}, not LORA"
        )
    for key, allowed in _PLAIN.items():
        if key in cfg and cfg[key] not in allowed and cfg[key] != allowed[0]:
            raise LoraError(
                f"LoRA adapter {str(path)!r}: {key}={cfg[key]!r} is not supported "
                "(only plain LoRA on the attention and MLP projections)"
            )
    if cfg.get("bias", "none") != "none":
        raise LoraError(f"LoRA adapter {str(path)!r}: bias={cfg['bias']!r} is not supported")
    r, alpha = cfg.get("r"), cfg.get("lora_alpha", cfg.get("r"))
    if not isinstance(r, int) or r < 1:
        raise LoraError(f"LoRA adapter {str(path)!r}: r must be a positive integer, got {r!r}")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
        raise LoraError(f"LoRA adapter {str(path)!r}: lora_alpha must be a number, got {alpha!r}")
    return cfg


def scaling_of(cfg: dict) -> float:
    """PEFT's scaling: ``lora_alpha / r``, or ``lora_alpha / sqrt(r)`` with rsLoRA."""
    r = cfg["r"]
    alpha = cfg.get("lora_alpha", r)
    return alpha / math.sqrt(r) if cfg.get("use_rslora", False) else alpha / r


def _sub_rows(cfg: ModelConfig) -> dict[str, tuple[str, int, int, int]]:
    """Checkpoint projection -> (fused module, first row, rows, input features), whole model."""
    d, hq, hkv = cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
    q, kv, h, inter = hq * d, hkv * d, cfg.hidden_size, cfg.intermediate_size
    return {
        "q": ("qkv", 0, q, h),
        "k": ("qkv", q, kv, h),
        "v": ("qkv", q + kv, kv, h),
        "qkv": ("qkv", 0, q + 2 * kv, h),
        "o": ("o", 0, h, q),
        "gate": ("gate_up", 0, inter, h),
        "up": ("gate_up", inter, inter, h),
        "gate_up": ("gate_up", 0, 2 * inter, h),
        "down": ("down", 0, h, inter),
    }


def _rank_rows(cfg: ModelConfig, shard: Shard, module: str, full: torch.Tensor) -> torch.Tensor:
    """This rank's rows of a fused module's whole-model output (``b``'s columns) or
    input (``a``'s rows), as ``sharding.py`` splits the base layer."""
    if shard.size == 1:
        return full
    d = cfg.head_dim
    heads = head_shard(cfg, shard)
    if module in ("qkv", "o"):
        qs = slice(heads.q_start * d, (heads.q_start + heads.q_heads) * d)
        if module == "o":
            return full[qs]
        q, kv = cfg.num_heads * d, cfg.num_kv_heads * d
        ks = slice(q + heads.kv_start * d, q + (heads.kv_start + heads.kv_heads) * d)
        vs = slice(q + kv + heads.kv_start * d, q + kv + (heads.kv_start + heads.kv_heads) * d)
        return torch.cat([full[qs], full[ks], full[vs]])
    inter = cfg.intermediate_size
    block = inter // shard.size
    lo, hi = shard.rank * block, (shard.rank + 1) * block
    if module == "down":
        return full[lo:hi]
    return torch.cat([full[lo:hi], full[inter + lo : inter + hi]])


def load_adapter(
    name: str,
    path: str | Path,
    cfg: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    max_rank: int,
    shard: Shard | None = None,
) -> LoraAdapter:
    """Read a PEFT LoRA folder for this model and rank (module docstring); LoraError
    saying why when it cannot be served."""
    from safetensors import safe_open

    shard = shard or Shard()
    acfg = read_config(path)
    where = f"LoRA adapter {name!r} ({path})"
    weights = Path(path) / WEIGHTS_FILE
    if not weights.is_file():
        bin_file = Path(path) / "adapter_model.bin"
        extra = (
            " (adapter_model.bin is pickle: convert it to safetensors)" if bin_file.exists() else ""
        )
        raise LoraError(f"{where}: {WEIGHTS_FILE} is missing{extra}")
    try:
        with safe_open(str(weights), "pt") as f:
            tensors = {k: f.get_tensor(k) for k in sorted(f.keys())}
    except Exception as e:  # a truncated or foreign file: safetensors' own message
        raise LoraError(f"{where}: cannot read {WEIGHTS_FILE} ({e})") from e
    if not tensors:
        raise LoraError(f"{where}: {WEIGHTS_FILE} holds no tensors")
    scaling = scaling_of(acfg)
    subs = _sub_rows(cfg)
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        m = _NAME.match(key)
        if m is None:
            raise LoraError(
                f"{where}: tensor {key!r} adapts something other than the attention and "
                "MLP projections (q/k/v/o/gate/up/down): not supported"
            )
        layer, _, proj, ab = int(m.group(1)), m.group(2), m.group(3), m.group(4)
        if layer >= cfg.num_layers:
            raise LoraError(
                f"{where}: tensor {key!r} is for layer {layer}; the model has {cfg.num_layers}"
            )
        if t.dim() != 2 or not t.is_floating_point():
            raise LoraError(f"{where}: tensor {key!r} is not a floating-point matrix")
        pairs.setdefault((layer, proj), {})[ab] = t
    rank = 0
    fused: dict[tuple[int, str], list[tuple[int, int, torch.Tensor, torch.Tensor]]] = {}
    for (layer, proj), ab in sorted(pairs.items()):
        if set(ab) != {"A", "B"}:
            raise LoraError(
                f"{where}: layer {layer} {proj}_proj has lora_{set('AB') - set(ab)} missing"
            )
        a, b = ab["A"], ab["B"]
        module, row0, rows, fan_in = subs[proj]
        if module in ("gate_up", "down") and cfg.moe is not None and cfg.moe.sparse_layers[layer]:
            raise LoraError(
                f"{where}: layer {layer} is a mixture-of-experts layer: its MLP cannot be adapted"
            )
        r = a.shape[0]
        if b.shape[1] != r or a.shape[1] != fan_in or b.shape[0] != rows:
            raise LoraError(
                f"{where}: layer {layer} {proj}_proj has lora_A {tuple(a.shape)} and lora_B "
                f"{tuple(b.shape)}; this model needs [r, {fan_in}] and [{rows}, r] "
                "(an adapter for another base model?)"
            )
        if r > max_rank:
            raise LoraError(f"{where}: rank {r} is above --max-lora-rank {max_rank}")
        rank = max(rank, r)
        fused.setdefault((layer, module), []).append((row0, rows, a, b))
    layers: list[dict[str, tuple[torch.Tensor, torch.Tensor]]] = [{} for _ in range(cfg.num_layers)]
    out_rows = {
        "qkv": subs["qkv"][2],
        "o": subs["o"][2],
        "gate_up": subs["gate_up"][2],
        "down": subs["down"][2],
    }
    for (layer, module), parts in fused.items():
        total_r = sum(a.shape[0] for _, _, a, _ in parts)
        a_cat = torch.cat([a.to(torch.float64) for _, _, a, _ in parts])  # [R, in]
        b_full = torch.zeros(out_rows[module], total_r, dtype=torch.float64)  # [out, R]
        col = 0
        for row0, rows, a, b in parts:
            b_full[row0 : row0 + rows, col : col + a.shape[0]] = b.to(torch.float64) * scaling
            col += a.shape[0]
        if module in ROW_PARALLEL:
            a_cat = _rank_rows(cfg, shard, module, a_cat.t()).t()
        else:
            b_full = _rank_rows(cfg, shard, module, b_full)
        layers[layer][module] = (
            a_cat.t().to(dtype).contiguous().to(device),
            b_full.t().to(dtype).contiguous().to(device),
        )
    targets = tuple(sorted({proj for _, proj in pairs}))
    return LoraAdapter(name, str(path), rank, scaling, digest(tensors, scaling), targets, layers)


def digest(tensors: dict[str, torch.Tensor], scaling: float) -> str:
    """SHA-256 (hex) over the adapter's tensors, in name order, and its scaling."""
    h = hashlib.sha256(b"radixserve-lora-v1\0")
    h.update(repr(float(scaling)).encode() + b"\0")
    for key in sorted(tensors):
        t = tensors[key].contiguous()
        h.update(f"{key}\0{t.dtype}\0{tuple(t.shape)}\0".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()
