"""Megatron-style tensor parallelism: which slice of every weight a rank holds.

For ``size`` ranks, rank ``r`` holds:
- **attention**: ``num_heads / size`` query heads (``r``'s contiguous block) and
  their KV heads. With at least ``size`` KV heads each rank holds
  ``num_kv_heads / size`` of them; with fewer, each KV head is replicated on the
  ``size / num_kv_heads`` ranks whose query heads read it (as vLLM does), so a rank
  holds one. The fused ``qkv_proj`` is column-parallel (its q, k and v rows of those
  heads), ``o_proj`` row-parallel (the matching input columns; one all-reduce).
  The KV pool of a rank holds its KV heads only, for the same page ids.
- **MLP**: ``gate_up_proj`` column-parallel (a contiguous block of the
  intermediate features, gate and up alike), ``down_proj`` row-parallel (one
  all-reduce); mixture-of-experts layers split every expert the same way (the
  router is replicated).
- **embedding and LM head**: vocab-parallel, ``ceil(vocab / size)`` rows each (the
  last rank's block padded with zero rows); a token outside a rank's block embeds
  to zeros there and one all-reduce completes the row; the LM head's logits are
  gathered on rank 0. Tied embeddings share the slice.
- everything else (norms, q/k norms, biases of row-parallel layers, the router) whole.

``check_tp`` refuses, naming the numbers, a model whose heads or intermediate
features a rank count cannot split. ``shard_sources`` turns ``checkpoint.py``'s
tensor groups into the slices one rank reads, so a rank never loads another
rank's weights (``loader.py`` reads them from safetensors slices).
"""

from __future__ import annotations

from dataclasses import dataclass

from radixserve.models.checkpoint import Sources
from radixserve.models.config import ModelConfig


@dataclass(frozen=True)
class Shard:
    """This process's place in the tensor-parallel group."""

    rank: int = 0
    size: int = 1

    def __post_init__(self) -> None:
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ValueError(f"tensor-parallel rank {self.rank} of {self.size} is out of range")


@dataclass(frozen=True)
class Piece:
    """One slice of a checkpoint tensor: rows ``[start, stop)`` of dim ``dim``
    (``dim`` None: the whole tensor)."""

    name: str
    dim: int | None = None
    start: int = 0
    stop: int = 0


#: Our parameter -> per group, the pieces concatenated along dim 0 to build it.
ShardSources = dict[str, list[list[Piece]]]


@dataclass(frozen=True)
class HeadShard:
    """A rank's attention heads: ``q_heads`` from ``q_start``, ``kv_heads`` from ``kv_start``."""

    q_heads: int
    q_start: int
    kv_heads: int
    kv_start: int


def check_tp(cfg: ModelConfig, size: int) -> None:
    """ValueError, naming the numbers, unless ``size`` ranks can split this model."""
    if size < 1:
        raise ValueError(f"--tp must be >= 1, got {size}")
    if size == 1:
        return
    if cfg.hybrid:
        raise ValueError(f"--tp {size}: hybrid models ({cfg.architecture}) run on one rank only")
    problems = []
    if cfg.num_heads % size:
        problems.append(f"{cfg.num_heads} attention heads are not divisible by {size}")
    kv = cfg.num_kv_heads
    if kv >= size and kv % size:
        problems.append(f"{kv} KV heads are not divisible by {size}")
    if kv < size and size % kv:
        problems.append(f"{size} ranks are not a multiple of the {kv} KV heads (to replicate them)")
    if cfg.intermediate_size % size:
        problems.append(f"intermediate size {cfg.intermediate_size} is not divisible by {size}")
    if cfg.moe is not None and cfg.moe.intermediate_size % size:
        problems.append(
            f"expert intermediate size {cfg.moe.intermediate_size} is not divisible by {size}"
        )
    if problems:
        raise ValueError(
            f"cannot split {cfg.architecture} over --tp {size}: " + "; ".join(problems)
        )


def head_shard(cfg: ModelConfig, shard: Shard) -> HeadShard:
    """Which query and KV heads ``shard`` holds (``check_tp`` must pass)."""
    q = cfg.num_heads // shard.size
    kv_total = cfg.num_kv_heads
    if kv_total >= shard.size:
        kv = kv_total // shard.size
        return HeadShard(q, shard.rank * q, kv, shard.rank * kv)
    # Replicated: the KV head of this rank's query heads (all in one group).
    group = cfg.num_heads // kv_total
    return HeadShard(q, shard.rank * q, 1, (shard.rank * q) // group)


def vocab_shard(vocab_size: int, shard: Shard) -> tuple[int, int]:
    """(first token id, rows per rank) of ``shard``'s vocabulary block."""
    rows = -(-vocab_size // shard.size)
    return shard.rank * rows, rows


def shard_sources(cfg: ModelConfig, shard: Shard, sources: Sources) -> ShardSources:
    """``checkpoint_sources(cfg)`` as the pieces ``shard`` reads (the module docstring)."""
    heads = head_shard(cfg, shard)
    out: ShardSources = {}
    for name, groups in sources.items():
        out[name] = [_pieces(cfg, shard, heads, name, group) for group in groups]
    return out


def _pieces(
    cfg: ModelConfig, shard: Shard, heads: HeadShard, name: str, group: tuple[str, ...]
) -> list[Piece]:
    if shard.size == 1:
        return [Piece(n) for n in group]
    d = cfg.head_dim
    if name in ("embed_tokens.weight", "lm_head.weight"):
        start, rows = vocab_shard(cfg.vocab_size, shard)
        return [Piece(group[0], 0, start, min(start + rows, cfg.vocab_size))]
    if name.endswith("qkv_proj.weight") or name.endswith("qkv_proj.bias"):
        q = (heads.q_start * d, (heads.q_start + heads.q_heads) * d)
        kv = (heads.kv_start * d, (heads.kv_start + heads.kv_heads) * d)
        if len(group) == 3:
            return [Piece(n, 0, a, b) for n, (a, b) in zip(group, (q, kv, kv))]
        # Fused (Phi-3): q rows, then k rows, then v rows in one tensor.
        k_off, v_off = cfg.num_heads * d, (cfg.num_heads + cfg.num_kv_heads) * d
        return [
            Piece(group[0], 0, q[0], q[1]),
            Piece(group[0], 0, k_off + kv[0], k_off + kv[1]),
            Piece(group[0], 0, v_off + kv[0], v_off + kv[1]),
        ]
    if name.endswith("o_proj.weight"):
        return [Piece(group[0], 1, heads.q_start * d, (heads.q_start + heads.q_heads) * d)]
    if name.endswith("experts.gate_up") or name.endswith("experts.down"):
        assert cfg.moe is not None
        return _mlp_pieces(cfg.moe.intermediate_size, shard, name.endswith("down"), group)
    if name.endswith("gate_up_proj.weight") or name.endswith("gate_up_proj.bias"):
        return _mlp_pieces(cfg.intermediate_size, shard, False, group)
    if name.endswith("down_proj.weight"):
        return _mlp_pieces(cfg.intermediate_size, shard, True, group)
    return [Piece(n) for n in group]  # replicated


def _mlp_pieces(intermediate: int, shard: Shard, down: bool, group: tuple[str, ...]) -> list[Piece]:
    """A rank's block of the intermediate features: rows of gate and of up (fused:
    one tensor, gate then up), or columns of down."""
    rows = intermediate // shard.size
    a, b = shard.rank * rows, (shard.rank + 1) * rows
    if down:
        return [Piece(group[0], 1, a, b)]
    if len(group) == 2:
        return [Piece(n, 0, a, b) for n in group]
    return [Piece(group[0], 0, a, b), Piece(group[0], 0, intermediate + a, intermediate + b)]
