"""DeepSeek-V4's architecture values and the layout of its hybrid cache.

Every V4 layer attends over a sliding window of raw tokens; a compressed layer also over
entries that each pool `compress_rate` tokens: a "compressed_sparse_attention" (CSA) layer
attends to the `index_topk` entries its lightning indexer picks, a
"heavily_compressed_attention" (HCA) layer to all of them. The cache is hybrid (vLLM's term),
in columns of the cache's dtype:

- the window pool (`V4WindowRow`, engine/block_manager.py): per recent token and layer
      kv       [D]      the token's key (= value): normed and roped; the window's raw tokens
      pool_kv  [c * D]  the compressor's per-token projections (c = 2 for CSA, whose entries
      pool_gate[c * D]  pool two overlapping windows, 1 for HCA), read when a window closes
      index_kv [2 * Di], index_gate [2 * Di]: the same for the indexer's own compressor (CSA)
  held only for the last `window_span` tokens of a sequence (and a step's new ones);
- the paged cache proper (`V4EntryRow`): the pooled entries, each spread over the rows of the m
  tokens it pools (`EntrySpread`): element c of entry j sits in the row of token
  j * m + c // share, column col + c % share. Each token's row then holds 1/m of an entry
  (`share` = ceil(D / m) columns, and ceil(Di / m) for the indexer's entry), so the entries cost
  (D + Di) / m per token, and a row is still a function of its token's window and those before
  it: the block manager, prefix cache, preemption and a hand-off into another block size treat
  the entries as any family's rows. An entry is written when its window closes, into rows of
  tokens already in the cache.

V4-Flash's bytes per token are in docs/models.md.
"""

from __future__ import annotations

from dataclasses import dataclass

from rayinfer.config_error import ConfigError

SLIDING = "sliding_attention"
CSA = "compressed_sparse_attention"
HCA = "heavily_compressed_attention"
LAYER_TYPES = (SLIDING, CSA, HCA)
MLP_LAYER_TYPES = ("hash_moe", "moe")
SCORING_FUNCS = ("sqrtsoftplus", "softmax", "sigmoid")
# transformers' defaults for configs that leave the list out (configuration_deepseek_v4.py)
DEFAULT_COMPRESS_RATES = {CSA: 4, HCA: 128}
DEFAULT_NUM_HASH_LAYERS = 3
_LEGACY_RATIO_TO_TYPE = {0: SLIDING, 4: CSA, 128: HCA}


@dataclass(frozen=True)
class V4Config:
    """The V4-only values of a config.json, checked (a ConfigError names the key)."""

    layer_types: tuple[str, ...]
    mlp_layer_types: tuple[str, ...]
    compress_rates: dict  # layer type -> tokens per entry
    sliding_window: int
    head_dim: int  # D: the one shared key/value head
    rope_dim: int  # R: the trailing columns of every head that RoPE rotates
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    swiglu_limit: float | None
    scoring_func: str
    routed_scaling_factor: float
    rope_parameters: dict  # {"main": {...}, "compress": {...}}

    @classmethod
    def from_hf(cls, hf: dict) -> V4Config:
        num_layers = hf["num_hidden_layers"]
        compress_rates = dict(DEFAULT_COMPRESS_RATES, **(hf.get("compress_rates") or {}))
        layer_types = _layer_types(hf, num_layers)
        mlp_layer_types = hf.get("mlp_layer_types")
        if mlp_layer_types is None:
            num_hash = hf.get("num_hash_layers", DEFAULT_NUM_HASH_LAYERS)
            mlp_layer_types = ["hash_moe"] * num_hash + ["moe"] * (num_layers - num_hash)
        _check_types("mlp_layer_types", mlp_layer_types[:num_layers], num_layers, MLP_LAYER_TYPES)
        for kind in (CSA, HCA):
            rate = compress_rates.get(kind)
            if kind in layer_types and (not isinstance(rate, int) or rate < 1):
                raise ConfigError(f"compress_rates[{kind!r}]={rate!r} must be a positive integer")
        head_dim = hf["head_dim"]
        rope_dim = hf.get("qk_rope_head_dim") or int(
            head_dim * (hf.get("partial_rotary_factor") or 64 / 512)
        )
        scoring = hf.get("scoring_func", "sqrtsoftplus")
        if scoring not in SCORING_FUNCS:
            raise ConfigError(f"scoring_func={scoring!r}; use one of {', '.join(SCORING_FUNCS)}")
        for key in ("sliding_window", "q_lora_rank", "o_groups", "o_lora_rank", "hc_mult"):
            if not isinstance(hf.get(key), int) or hf[key] <= 0:
                raise ConfigError(f"{key}={hf.get(key)!r} must be a positive integer")
        if CSA in layer_types:
            for key in ("index_n_heads", "index_head_dim", "index_topk"):
                if not isinstance(hf.get(key), int) or hf[key] <= 0:
                    raise ConfigError(f"{key}={hf.get(key)!r} must be a positive integer")
        if (hf["num_attention_heads"] * head_dim) % hf["o_groups"]:
            raise ConfigError(
                f"o_groups={hf['o_groups']} must divide num_attention_heads * head_dim"
            )
        return cls(
            layer_types=tuple(layer_types),
            mlp_layer_types=tuple(mlp_layer_types[:num_layers]),
            compress_rates=compress_rates,
            sliding_window=hf["sliding_window"],
            head_dim=head_dim,
            rope_dim=rope_dim,
            q_lora_rank=hf["q_lora_rank"],
            o_groups=hf["o_groups"],
            o_lora_rank=hf["o_lora_rank"],
            index_n_heads=hf.get("index_n_heads") or 0,
            index_head_dim=hf.get("index_head_dim") or 0,
            index_topk=hf.get("index_topk") or 0,
            hc_mult=hf["hc_mult"],
            hc_sinkhorn_iters=hf.get("hc_sinkhorn_iters", 20),
            hc_eps=float(hf.get("hc_eps", 1e-6)),
            swiglu_limit=hf.get("swiglu_limit"),
            scoring_func=scoring,
            routed_scaling_factor=float(hf.get("routed_scaling_factor") or 1.0),
            rope_parameters=_rope_parameters(hf, rope_dim / head_dim),
        )

    def compress_rate(self, layer_idx: int) -> int:
        """Tokens per compressed entry of the layer (0: a sliding-window layer)."""
        kind = self.layer_types[layer_idx]
        return 0 if kind == SLIDING else self.compress_rates[kind]

    @property
    def compressed_types(self) -> list[str]:
        return [kind for kind in (CSA, HCA) if kind in self.layer_types]

    @property
    def window_row(self) -> V4WindowRow:
        return V4WindowRow.for_layers(self.layer_types, self.head_dim, self.index_head_dim)

    @property
    def entry_row(self) -> V4EntryRow:
        rates = {kind: self.compress_rates[kind] for kind in self.compressed_types}
        return V4EntryRow.for_rates(rates, self.head_dim, self.index_head_dim)

    def entry_width(self, layer_idx: int) -> int:
        """Columns of the layer's rows in the paged cache: its type's share of the entries (and
        the indexer's, for CSA; `V4EntryRow`'s columns, cut after the last one the layer uses),
        one for a sliding layer, which keeps nothing there."""
        kind, row = self.layer_types[layer_idx], self.entry_row
        if kind == SLIDING:
            return 1
        if kind == CSA:
            return row.width
        return row.entries(kind).share

    @property
    def window_span(self) -> int:
        """Tokens before a step's first one whose window state the step reads: the window's,
        and the pooled span of a compressor that closes at the step's first token."""
        spans = [self.sliding_window]
        for kind in self.compressed_types:
            spans.append((2 if kind == CSA else 1) * self.compress_rates[kind])
        return max(spans)


@dataclass(frozen=True)
class V4WindowRow:
    """Column offsets of one token's row in the window pool; `width` columns."""

    head_dim: int
    pool_width: int  # c * D: 2 * D with a CSA layer, D with only HCA ones, 0 without either
    index_dim: int  # Di where a CSA layer exists, else 0

    @classmethod
    def for_layers(cls, layer_types, head_dim: int, index_head_dim: int) -> V4WindowRow:
        pools = 2 if CSA in layer_types else 1 if HCA in layer_types else 0
        return cls(head_dim, pools * head_dim, index_head_dim if CSA in layer_types else 0)

    @property
    def pool_kv(self) -> int:  # first column
        return self.head_dim

    @property
    def pool_gate(self) -> int:
        return self.pool_kv + self.pool_width

    @property
    def index_kv(self) -> int:
        return self.pool_gate + self.pool_width

    @property
    def index_gate(self) -> int:
        return self.index_kv + 2 * self.index_dim

    @property
    def width(self) -> int:
        return self.index_gate + 2 * self.index_dim


@dataclass(frozen=True)
class EntrySpread:
    """Where entries of `dim` values pooled from `rate` tokens lie in the tokens' rows: element
    c of entry j in the row of token j * rate + c // share, column `column` + c % share."""

    rate: int
    dim: int
    column: int

    @property
    def share(self) -> int:
        return -(-self.dim // self.rate)


@dataclass(frozen=True)
class V4EntryRow:
    """One token's row in the paged cache: its share of the entries of every compressed layer
    type ([0, share) of the widest), then its share of the indexer's ([index_col, +share))."""

    rates: dict  # compressed layer type -> tokens per entry
    head_dim: int
    index_dim: int

    @classmethod
    def for_rates(cls, rates: dict, head_dim: int, index_head_dim: int) -> V4EntryRow:
        return cls(dict(rates), head_dim, index_head_dim if CSA in rates else 0)

    def entries(self, kind: str) -> EntrySpread:
        return EntrySpread(self.rates[kind], self.head_dim, 0)

    @property
    def index_col(self) -> int:
        return max((self.entries(kind).share for kind in self.rates), default=0)

    @property
    def index_entries(self) -> EntrySpread:
        return EntrySpread(self.rates[CSA], self.index_dim, self.index_col)

    @property
    def width(self) -> int:
        """At least one column: a model of sliding layers only keeps nothing here."""
        index_share = self.index_entries.share if self.index_dim else 0
        return max(self.index_col + index_share, 1)


def _check_types(key: str, types, num_layers: int, allowed) -> None:
    if len(types) != num_layers:
        raise ConfigError(
            f"{key} has {len(types)} entries; it needs one per layer (num_hidden_layers="
            f"{num_layers})"
        )
    for i, kind in enumerate(types):
        if kind not in allowed:
            raise ConfigError(f"{key}[{i}]={kind!r} is unknown; use one of {', '.join(allowed)}")


def _layer_types(hf: dict, num_layers: int) -> list[str]:
    """`layer_types`, else the legacy per-layer `compress_ratios` (0 / 4 / 128), else
    transformers' default (two HCA layers, then HCA and CSA alternating)."""
    if hf.get("layer_types") is not None:
        types = list(hf["layer_types"])
    elif hf.get("compress_ratios") is not None:
        ratios = hf["compress_ratios"][:num_layers]
        bad = [r for r in ratios if r not in _LEGACY_RATIO_TO_TYPE]
        if bad:
            raise ConfigError(f"compress_ratios has {bad[0]!r}; use 0, 4 or 128")
        types = [_LEGACY_RATIO_TO_TYPE[r] for r in ratios]
    else:
        types = [HCA] * min(num_layers, 2) + [
            CSA if i % 2 else HCA for i in range(max(num_layers - 2, 0))
        ]
    _check_types("layer_types", types, num_layers, LAYER_TYPES)
    return types


def _rope_parameters(hf: dict, partial_rotary_factor: float) -> dict:
    """{"main": plain RoPE at rope_theta, "compress": compress_rope_theta with the config's
    scaling (YaRN in V4-Flash; no attention factor on cos and sin, as transformers reads it)}."""
    given = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    if isinstance(given.get("main"), dict) and isinstance(given.get("compress"), dict):
        return {"main": dict(given["main"]), "compress": dict(given["compress"])}
    main = {"rope_type": "default", "rope_theta": float(hf.get("rope_theta", 10000.0))}
    scaling = {k: v for k, v in given.items() if k not in ("main", "compress")}
    compress = dict(scaling, rope_theta=float(hf.get("compress_rope_theta", 160000.0)))
    compress.setdefault("rope_type", scaling.get("type", "default"))
    if compress["rope_type"] == "yarn":
        compress.setdefault("attention_factor", 1.0)
    for params in (main, compress):
        params.setdefault("partial_rotary_factor", partial_rotary_factor)
    return {"main": main, "compress": compress}
