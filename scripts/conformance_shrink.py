"""The conformance sweep's one shrinking function (scripts/conformance.py): a tiny config of a config class from its
own attributes, with eager attention and every random draw off. :mod:`conformance_models` builds the cases' models
with it.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import re
from typing import Any, Optional

VOCAB = 99  # as transformers' ModelTesters; the rows use ids 3 .. 47 (0 pad, 1 bos, 2 eos)
LAYERS = 4  # decoder-only: 2 blocks per stage on 2 stages; an encoder-decoder gets 2 + 2
INIT = 0.2  # wider than 0.02, so that greedy choices are not near-ties that a microbatch's rounding flips


WIDTH = ("hidden_size", "d_model", "n_embd", "embed_dim", "model_dim", "word_embed_proj_dim", "projection_dim",
         "vision_output_dim", "output_hidden_size", "text_hidden_size", "vision_hidden_size")
FFN = ("intermediate_size", "ffn_dim", "d_ff", "n_inner", "ffn_hidden_size", "encoder_ffn_dim", "decoder_ffn_dim",
       "ffn_dim_size", "dense_intermediate_size", "mamba_d_ssm")
SMALL_FFN = ("moe_intermediate_size", "shared_expert_intermediate_size", "expert_intermediate_size")
LAYER_COUNTS = ("num_hidden_layers", "n_layer", "num_layers", "n_layers", "encoder_layers", "decoder_layers",
                "num_decoder_layers", "num_encoder_layers", "depth", "text_layers", "vision_layers")
HEADS = ("num_attention_heads", "n_head", "num_heads", "encoder_attention_heads", "decoder_attention_heads",
         "n_heads", "attention_heads", "num_attention_heads_per_layer")
KV_HEADS = ("num_key_value_heads", "num_kv_heads", "multi_query_group_num", "n_kv_heads", "num_query_groups")
HEAD_DIM = ("head_dim", "d_kv", "kv_channels", "attention_head_dim", "qk_nope_head_dim", "qk_rope_head_dim",
            "v_head_dim", "linear_key_head_dim", "linear_value_head_dim")
POSITIONS = ("max_position_embeddings", "n_positions", "max_seq_len", "n_ctx", "max_sequence_length", "seq_length")
EXPERTS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts", "num_experts_total")
TOP_K = ("num_experts_per_tok", "moe_topk", "top_k", "num_selected_experts", "moe_k", "num_experts_per_token",
         "top_k_experts")
STATE = ("state_size", "d_state", "ssm_state_size", "mamba_d_state", "time_step_rank", "kv_lora_rank",
         "q_lora_rank", "linear_num_key_heads", "linear_num_value_heads", "mamba_n_heads", "mamba_d_head")
SLIDING = ("sliding_window", "attention_window", "local_window_size")
SHARED_EXPERTS = ("n_shared_experts", "n_group", "topk_group", "num_expert_group")  # shared experts, expert groups
VOCABS = ("vocab_size", "n_vocab", "padded_vocab_size", "unpadded_vocab_size", "vocab_size_per_layer_input")
TARGETS: dict[tuple[str, ...], int] = {
    WIDTH: 32, FFN: 64, SMALL_FFN: 16, HEADS: 4, KV_HEADS: 2, HEAD_DIM: 8, POSITIONS: 128, EXPERTS: 4, TOP_K: 2,
    STATE: 8, VOCABS: VOCAB, SHARED_EXPERTS: 1, SLIDING: 8, ("image_size",): 32, ("num_channels",): 3,
}
RANDOM = ("router_jitter_noise", "jitter_noise", "layerdrop", "encoder_layerdrop", "decoder_layerdrop")
GROUPS = ("n_groups", "mamba_n_groups", "mamba_ngroups")  # groups of a state-space mixer's heads
EXPANDS = ("expand", "mamba_expand")  # a state-space mixer's width, as a multiple of the width
#: counts of one kind of layer (Switch Transformers' sparse layers), scaled with the layers, at least 1
LAYER_KIND_COUNTS = ("num_sparse_encoder_layers", "num_sparse_decoder_layers")
#: a hybrid's list of attention layers; one that names none (unset) gets the last layer
ATTENTION_INDICES = ("attn_layer_indices",)
#: layers at the end that reuse the keys and values of the last earlier layer of their kind (Gemma 3n)
KV_SHARED_LAYERS = ("num_kv_shared_layers",)
CLIPS = ("clip_qkv",)  # clipping bounds, None where off
ATTENTION_SUBCONFIGS = ("attn_config",)  # the attention part of a config, given its rope base
MLA_PARTS = ("qk_nope_head_dim", "qk_rope_head_dim")  # a latent attention's query-key head, in two parts


def shrink(config: Any, layers: int = LAYERS) -> Any:
    """A tiny config of ``config``'s class from its own attributes: every size it has set to a tiny value (never
    larger than the default), ``layers`` layers (lists with one entry per layer cut to their first ``layers``),
    sub-configs shrunk alike, every dropout and random draw off, eager attention, token ids 0 (pad) / 1 / 2.

    What the default leaves inconsistent once its sizes are tiny is made consistent by generic rules:

    - what ``__post_init__`` derives from the sizes (a head size, an attention width, a layer count from the one
      it is given) is derived again (:func:`_constructor_view`), never larger than the default's;
    - what the class leaves unset (None) but its model reads gets its tiny value (:func:`_unset_sizes`);
    - a size per layer (a list) is shrunk like the global one; a list with a distinct value per layer (layer
      indices) is cut to its first entries, one of kinds keeps every kind (:func:`_cut`);
    - counts of a kind of layer (sparse layers, key-value-sharing layers) and of consecutive parts of the layers
      (input / recurrent / output) are scaled with the layers; a ``*_layer_period`` / ``*_layer_offset`` pair keeps
      at least one layer of its kind within the cut, and a hybrid whose layer kinds name no attention layer (or
      whose attention-layer list is unset) gets one, the last;
    - a state-space mixer's heads times head size stay its expanded width (``expand`` times the width) where the
      default has it so, and its groups divide its heads; a latent attention's query-key head stays the sum of its
      no-rope and rope parts;
    - rope parameters: their positions are cut like the config's, none at all (where the model reads them per
      layer type) become the default rope, and multimodal rope sections (``mrope_section``: the default's, or
      thirds where the class declares the key and the default leaves it to the model) sum to half the tiny rope
      head size; an attention sub-config (DBRX's) gets the rope base the model reads from it;
    - heterogeneous per-layer overrides (``per_layer_config``) are shrunk per layer, following the layers the cut
      keeps, with the ratio to the global value kept;
    - a clipping bound that is off (None) becomes one that no value reaches (``torch.clamp`` needs a bound)."""
    attrs = {k: v for k, v in vars(config).items() if not k.startswith("_")}
    if attrs.get("is_encoder_decoder"):
        layers = min(layers, 2)
    old_layers = next((attrs[k] for k in LAYER_COUNTS if isinstance(attrs.get(k), int)), None)
    changes: dict[str, Any] = {}
    inputs: set[str] = set()  # changes that __post_init__ derives from, not values to keep
    declared = _declared(type(config))
    sources: Optional[list[int]] = None  # the default's layers that the tiny one's are
    shared = 0  # layers at the end that reuse an earlier layer's keys and values, in the tiny config
    for key in KV_SHARED_LAYERS:
        if isinstance(attrs.get(key), int) and attrs[key] > 0 and old_layers and old_layers > layers:
            shared = changes[key] = min(layers, max(1, attrs[key] * layers // old_layers))
    for key, value in attrs.items():
        if hasattr(value, "to_dict") and hasattr(value, "model_type"):  # a sub-config
            changes[key] = shrink(value, layers)
            continue
        if isinstance(value, bool) or value is None:
            continue
        lowered = key.lower()
        if isinstance(value, float) and ("drop" in lowered or key in RANDOM):
            changes[key] = 0.0
        elif isinstance(value, int) and key in LAYER_COUNTS and isinstance(declared.get(key), int) \
                and key in _derived(type(config)):  # a count __post_init__ derives from the one it is given (HRM's
            changes[key] = min(declared[key], layers)  # cycles times its layers): given the tiny one, derived
            inputs.add(key)
        elif isinstance(value, int) and key in LAYER_COUNTS:
            changes[key] = min(value, layers)
        elif isinstance(value, int) and key in RANDOM:
            changes[key] = 0
        elif isinstance(value, int) and key in LAYER_KIND_COUNTS and old_layers and old_layers > layers:
            changes[key] = max(1, value * layers // old_layers) if value > 0 else value
        elif isinstance(value, int):
            for names, target in TARGETS.items():
                if key in names and value > 0:
                    changes[key] = min(value, target)
        elif isinstance(value, list) and old_layers and len(value) == old_layers and old_layers > layers:
            changes[key], kept = _cut(value, layers, shared)
            if sources is None or key == "layer_types":
                sources = kept
            target = next((t for names, t in TARGETS.items() if key in names), None)
            if target and all(isinstance(v, int) and not isinstance(v, bool) for v in value):  # a size per layer
                changes[key] = [min(v, target) if v > 0 else v for v in changes[key]]
        elif isinstance(value, list) and value and all(isinstance(v, int) and not isinstance(v, bool) for v in value) \
                and ("layer" in lowered and ("indices" in lowered or "ids" in lowered or lowered.endswith("layers"))):
            changes[key] = [v for v in value if v < layers] or [layers - 1]  # layer indices
    heads = next((changes[k] for k in HEADS if k in changes), None)
    for key in KV_HEADS:  # keep the kind of attention: multi-head stays multi-head (and MLA), multi-query stays
        if key in changes and heads and attrs[key] == next(attrs[k] for k in HEADS if k in changes):
            changes[key] = heads
    for key in ("rotary_dim",):
        if isinstance(attrs.get(key), int):
            changes[key] = min(attrs[key], 4)
    for key in ("pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id"):
        if key in attrs or (key == "decoder_start_token_id" and attrs.get("is_encoder_decoder")):
            changes[key] = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}.get(key, 0)
    if "initializer_range" in attrs:
        changes["initializer_range"] = INIT
    if "output_router_logits" in attrs:
        changes["output_router_logits"] = False  # the load-balancing loss is a statistic per microbatch
    if "use_cache" in attrs:
        changes["use_cache"] = True
    _layer_parts(attrs, changes, old_layers)
    _unset_sizes(config, attrs, changes)
    _layer_kinds(attrs, changes, layers)
    _state_heads(attrs, changes)
    _head_sums(attrs, changes)
    rope = _rope(config, attrs, changes)
    if rope is not None:
        changes["rope_parameters"] = rope
    spec = config.__dict__.get("_heterogeneity_spec")
    if spec is not None:
        changes["per_layer_config"] = _per_layer(spec.per_layer_overrides, attrs, changes,
                                                 sources or list(range(min(layers, old_layers or layers))))
    theta = (attrs.get("rope_parameters") or {}).get("rope_theta") if isinstance(attrs.get("rope_parameters"), dict) \
        else None
    for key in CLIPS:  # no clip (None) as a bound that no value reaches: the same model, and clamp() has a bound
        if key in attrs and attrs[key] is None:
            changes[key] = 1e4
    for key in ATTENTION_SUBCONFIGS:  # an attention sub-config that the model reads its rope base from (DBRX)
        if key in changes and theta is not None and not hasattr(changes[key], "rope_theta"):
            changes[key].rope_theta = theta
    try:
        tiny = type(config)(**{**_constructor_view(config, attrs), **changes})
    except Exception:  # a config whose __init__ rejects a derived attribute: set the changes on the default
        tiny = type(config)(**{k: v for k, v in changes.items() if not hasattr(v, "model_type")})
        for key, value in changes.items():
            if key != "per_layer_config":
                setattr(tiny, key, value)
    for key, value in changes.items():  # what __init__ derived otherwise (a head_dim from the old width)
        if key != "per_layer_config" and key not in inputs and not hasattr(value, "model_type") \
                and _raw(tiny, key, value) != value:
            setattr(tiny, key, value)
    for key, value in attrs.items():  # a size derived again is never larger than the default's
        if key not in changes and isinstance(value, int) and not isinstance(value, bool) \
                and isinstance(_raw(tiny, key), int) and _raw(tiny, key) > value > 0:
            setattr(tiny, key, value)
    tiny._attn_implementation = "eager"
    return tiny


def _raw(config: Any, key: str, default: Any = None) -> Any:
    """An attribute of a config, a per-layer one of a heterogeneous config (or of its text part) included, read
    globally."""
    if key in vars(config):
        return vars(config)[key]
    try:
        return getattr(config, key, default)
    except Exception:  # a heterogeneous config's per-layer attribute (AmbiguousGlobalPerLayerAttributeError)
        return default


def _now(attrs: dict[str, Any], changes: dict[str, Any], names: tuple[str, ...]) -> Optional[int]:
    """The tiny value of the first of ``names`` the config has (changed or not)."""
    for key in names:
        value = changes.get(key, attrs.get(key))
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def _layer_parts(attrs: dict[str, Any], changes: dict[str, Any], old_layers: Optional[int]) -> None:
    """Counts of consecutive parts of the layers (``n_input_layers``, ``n_recurrent_layers``, ``n_output_layers``)
    that sum to the default's layers are scaled to sum to the tiny ones, each at least 1."""
    layers = _now(attrs, changes, LAYER_COUNTS)
    names = [k for k, v in attrs.items() if isinstance(v, int) and not isinstance(v, bool) and v > 0
             and re.fullmatch(r"(n|num)_\w+_layers", k) and k not in LAYER_COUNTS + LAYER_KIND_COUNTS]
    if not old_layers or not layers or layers >= old_layers or len(names) > 8:
        return
    for size in range(len(names), 1, -1):
        for parts in itertools.combinations(names, size):
            if sum(attrs[k] for k in parts) == old_layers and layers >= size:
                tiny = [max(1, attrs[k] * layers // old_layers) for k in parts]
                largest = max(range(size), key=lambda i: attrs[parts[i]])
                tiny[largest] += layers - sum(tiny)
                if tiny[largest] >= 1:
                    changes.update(zip(parts, tiny))
                return


def _unset_sizes(config: Any, attrs: dict[str, Any], changes: dict[str, Any]) -> None:
    """What the class leaves None (its ``__post_init__`` does not derive it) and its model reads gets its tiny
    value: a head size (the width over the heads), key-value heads (the heads: multi-head attention), a top-k
    (where the config has experts); the expert counts and sizes of a mixture of experts that sets none (DiffusionGemma,
    dots.llm1; not where a switch such as ``enable_moe_block`` is off); a sliding window where the layer kinds slide;
    ``layer_types`` (full attention) and ``mlp_layer_types`` (sparse where there are experts); a ``default_X`` the
    first of the config's ``Xs`` (X-MOD's ``default_language``)."""
    derived = _derived(type(config))
    unset = [k for k, v in attrs.items() if v is None and k not in derived]
    width, heads = _now(attrs, changes, WIDTH), _now(attrs, changes, HEADS)
    switches = [v for k, v in attrs.items() if isinstance(v, bool) and "moe" in k]  # Gemma 4's enable_moe_block
    moe = (any(k in attrs for k in EXPERTS) and any(k in attrs for k in SMALL_FFN) or any(switches)) \
        and not any(v is False for v in switches)
    if moe and not _now(attrs, changes, EXPERTS):  # a mixture of experts whose sizes are unset
        for names, target in ((EXPERTS, TARGETS[EXPERTS]), (("n_shared_experts",), 1), (SMALL_FFN, TARGETS[SMALL_FFN])):
            changes.update({key: target for key in unset if key in names})
    for key in unset:
        if key == "head_dim" and width and heads:
            changes[key] = width // heads
        elif key in KV_HEADS and heads:
            changes[key] = heads
        elif key in TOP_K and _now(attrs, changes, EXPERTS):
            changes[key] = min(TARGETS[TOP_K], _now(attrs, changes, EXPERTS))
        elif key in SLIDING and "sliding_attention" in (changes.get("layer_types") or attrs.get("layer_types") or ()):
            changes[key] = TARGETS[SLIDING]
        elif key.startswith("default_") and isinstance(attrs.get(key[len("default_"):] + "s"), (list, tuple)) \
                and attrs[key[len("default_"):] + "s"]:  # X-MOD's default_language: the first of its languages
            changes[key] = attrs[key[len("default_"):] + "s"][0]
        elif key == "layer_types" and _now(attrs, changes, LAYER_COUNTS):
            changes[key] = ["full_attention"] * _now(attrs, changes, LAYER_COUNTS)
        elif key == "mlp_layer_types" and _now(attrs, changes, LAYER_COUNTS):
            changes[key] = ["sparse" if _now(attrs, changes, EXPERTS) else "dense"] * _now(attrs, changes, LAYER_COUNTS)


def _layer_kinds(attrs: dict[str, Any], changes: dict[str, Any], layers: int) -> None:
    """Every kind of layer the default has stays within the cut: a ``*_layer_period`` / ``*_layer_offset`` pair
    that would select no layer is scaled to the cut (the offset keeps its place within the period); a hybrid
    whose layer kinds name no attention layer, or whose attention-layer list is unset, gets one (the last), as
    the caches of such models expect."""
    from transformers.configuration_utils import ALLOWED_ATTN_LAYER_TYPES

    for key, period in attrs.items():
        offset_key = key[: -len("_period")] + "_offset"
        if key.endswith("_layer_period") and isinstance(period, int) and isinstance(attrs.get(offset_key), int) \
                and period > 0 and (period > layers or attrs[offset_key] >= layers):
            changes[key] = min(period, layers)
            changes[offset_key] = attrs[offset_key] % period * changes[key] // period
    if not _now(attrs, changes, HEADS):
        return
    for key in ATTENTION_INDICES:
        if key in attrs and not changes.get(key, attrs[key]):
            changes[key] = [layers - 1]
    for key, kinds in list(changes.items()):
        if isinstance(kinds, list) and kinds and all(isinstance(k, str) and k in ALLOWED_ATTN_LAYER_TYPES
                                                     for k in kinds) \
                and not any(("attention" in k and k != "linear_attention") or k.startswith("hybrid") for k in kinds) \
                and "linear_attention" in kinds:
            changes[key] = kinds[:-1] + ["full_attention"]


def _state_heads(attrs: dict[str, Any], changes: dict[str, Any]) -> None:
    """A state-space mixer's heads times its head size equal its expanded width (``expand`` times the width) where
    the default has it so: the head size is derived again from the tiny heads; its groups divide its heads."""
    width0, width = _now(attrs, {}, WIDTH), _now(attrs, changes, WIDTH)
    if not width0 or not width:
        return
    head_counts = [k for k, v in attrs.items() if isinstance(v, int) and (k in HEADS or "heads" in k)]
    head_sizes = [k for k, v in attrs.items() if isinstance(v, int) and (k in HEAD_DIM or "head_dim" in k
                                                                         or "d_head" in k or "headdim" in k)]
    for expand_key in EXPANDS:
        expand = attrs.get(expand_key)
        if not isinstance(expand, int) or isinstance(expand, bool):
            continue
        for h in head_counts:
            for d in head_sizes:
                if attrs[h] * attrs[d] != width0 * expand or not (h in changes or d in changes):
                    continue
                n = changes.get(h, attrs[h])
                if n * changes.get(d, attrs[d]) != width * expand and (width * expand) % n == 0:
                    changes[d] = min(attrs[d], width * expand // n)
                for g in GROUPS:
                    if isinstance(attrs.get(g), int) and attrs[g] > 0 and n % attrs[g]:
                        changes[g] = math.gcd(attrs[g], n)


def _head_sums(values: dict[str, Any], tiny: dict[str, Any]) -> None:
    """A query-key head size that is the sum of its no-rope and rope parts in ``values`` (a latent attention's)
    stays their sum in ``tiny`` (changed in place)."""
    parts = [values.get(k) for k in MLA_PARTS]
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in parts):
        return
    for total in ("head_dim", "qk_head_dim"):
        if values.get(total) == sum(parts) and any(k in tiny for k in MLA_PARTS):
            tiny[total] = sum(tiny.get(k, values[k]) for k in MLA_PARTS)


def _rope(config: Any, attrs: dict[str, Any], changes: dict[str, Any]) -> Optional[dict]:
    """The tiny rope parameters, or None where the default's need no change: their positions cut like the
    config's; multimodal rope sections (``mrope_section``) rescaled to sum to half the tiny rope head size, or,
    where the class declares the key (``ignore_keys_at_rope_validation``) and the default leaves it to the model,
    set in thirds."""
    rope = attrs.get("rope_parameters")
    if not isinstance(rope, dict):
        return None
    kinds = attrs.get("layer_types")
    if not rope and isinstance(kinds, list) and kinds:  # none at all, where the model reads them per layer type
        theta = getattr(type(config), "default_theta", 10000.0)
        rope = {kind: {"rope_type": "default", "rope_theta": theta} for kind in dict.fromkeys(kinds)}
    declared = "mrope_section" in (getattr(type(config), "ignore_keys_at_rope_validation", None) or ())
    old_dim, new_dim = _rope_dim(attrs, {}), _rope_dim(attrs, changes)

    def tiny(params: dict) -> dict:
        out = dict(params)
        for key, value in params.items():
            if key in POSITIONS and isinstance(value, int) and value > 0:
                out[key] = min(value, TARGETS[POSITIONS])
            elif "section" in key and isinstance(value, list) and value and all(isinstance(v, int) for v in value) \
                    and old_dim and new_dim:
                out[key] = _sections(value, max(1, round(sum(value) * new_dim / old_dim)))
        if declared and "mrope_section" not in params and new_dim:
            half = int(new_dim) // 2  # thirds, the rest to the last
            out["mrope_section"] = [half // 3, half // 3, half - 2 * (half // 3)]
        return out

    if rope and all(isinstance(v, dict) for v in rope.values()):  # per layer type
        new = {kind: tiny(params) for kind, params in rope.items()}
    else:
        new = tiny(rope)
    return None if new == attrs["rope_parameters"] else new


def _rope_dim(attrs: dict[str, Any], changes: dict[str, Any]) -> Optional[float]:
    """The rotated size of a head: the rope head size of a latent attention, else the head size times the partial
    rotary factor."""
    rope_head = _now(attrs, changes, ("qk_rope_head_dim",))
    if rope_head:
        return rope_head
    head = _now(attrs, changes, ("head_dim",))
    if not head:
        width, heads = _now(attrs, changes, WIDTH), _now(attrs, changes, HEADS)
        head = width // heads if width and heads else None
    rope = attrs.get("rope_parameters") or {}
    factor = rope.get("partial_rotary_factor", attrs.get("partial_rotary_factor")) if isinstance(rope, dict) else None
    return head * (factor if isinstance(factor, (int, float)) and factor else 1.0) if head else None


def _sections(sections: list[int], total: int) -> list[int]:
    """``sections`` rescaled to sum to ``total``, each at least 1 where ``total`` allows (largest remainders)."""
    total = max(int(total), 0)
    scale = [v * total / sum(sections) for v in sections]
    out = [max(int(v), 1 if total >= len(sections) else 0) for v in scale]
    order = sorted(range(len(out)), key=lambda i: scale[i] - int(scale[i]), reverse=True)
    k = 0
    while sum(out) < total:
        out[order[k % len(out)]] += 1
        k += 1
    while sum(out) > total:
        out[max(range(len(out)), key=lambda i: out[i])] -= 1
    return out


def _per_layer(overrides: dict[int, dict[str, Any]], attrs: dict[str, Any], changes: dict[str, Any],
               sources: list[int]) -> dict[int, dict[str, Any]]:
    """Heterogeneous per-layer overrides (``per_layer_config``) for the tiny layers, each from the default layer
    it was cut from: a size the global config shrinks keeps its ratio to the global value (a layer with twice the
    head size keeps twice the tiny one), another is shrunk as the global ones are; a layer whose key-value heads
    equal its heads keeps them equal."""
    out: dict[int, dict[str, Any]] = {}
    for i, source in enumerate(sources):
        layer = overrides.get(source)
        if not layer:
            continue
        tiny: dict[str, Any] = {}
        for key, value in layer.items():
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                old, new = attrs.get(key), changes.get(key)
                if isinstance(old, int) and isinstance(new, int) and old > 0:
                    tiny[key] = min(value, max(1, value * new // old))
                else:
                    target = next((t for names, t in TARGETS.items() if key in names), None)
                    tiny[key] = min(value, target) if target else value
            else:
                tiny[key] = value
        now = {**{k: changes[k] for k in MLA_PARTS if k in changes}, **tiny}
        _head_sums({**attrs, **layer}, now)
        tiny.update({k: v for k, v in now.items() if k in layer or v != changes.get(k, attrs.get(k))})
        layer_heads = next((k for k in HEADS if k in layer), None)
        for key in KV_HEADS:
            if key in layer and layer_heads and layer[key] == layer[layer_heads]:
                tiny[key] = tiny[layer_heads]
        out[i] = tiny
    return out


def _cut(per_layer: list, layers: int, shared: int = 0) -> tuple[list, list[int]]:
    """The first ``layers`` entries of a per-layer list, its last ones replaced by kinds the cut would lose (a
    hybrid's attention layers after its first Mamba layers); and the indices of the entries kept. With ``shared``
    layers at the end that reuse an earlier layer's keys and values, those are the default's last ones, and the
    others are cut from the rest (so that they have every kind)."""
    if 0 < shared < layers:
        head = len(per_layer) - shared
        _, kept = _cut(per_layer[:head], layers - shared)
        kept += list(range(head, len(per_layer)))
        return [per_layer[i] for i in kept], kept
    kept = list(range(min(layers, len(per_layer))))
    if len(set(map(repr, per_layer))) == len(per_layer):  # no kinds: a value per layer (a layer index)
        return [per_layer[i] for i in kept], kept
    missing = [i for i, v in enumerate(per_layer) if v not in per_layer[:layers] and v not in per_layer[:i]]
    for i, source in enumerate(missing[: layers - 1]):
        kept[layers - 1 - i] = source
    return [per_layer[i] for i in kept], kept


def _constructor_view(config: Any, attrs: dict[str, Any]) -> dict[str, Any]:
    """The attributes a config's ``__init__`` takes back (id2label and friends are rebuilt), less what the class
    derives itself (``__post_init__``: DeepSeek's ``qk_head_dim`` from the head sizes, Zamba's attention width from
    the width) where it holds the class default's derived value: sizes and structures are derived again from the
    tiny sizes; a derived scale (a float: an attention multiplier, an init variance) keeps the default's value. A
    value that differs from the class default's (set by a composite parent for its sub-config) is passed back."""
    drop = {"transformers_version", "architectures", "id2label", "label2id", "dtype", "torch_dtype"}
    derived = _derived(type(config))
    return {k: v for k, v in attrs.items() if k not in drop and not hasattr(v, "model_type")
            and not (k in derived and _same_value(v, derived[k]) and not isinstance(v, (float, bool)))}


_DERIVED: dict[type, dict[str, Any]] = {}


def _declared(cls: type) -> dict[str, Any]:
    """The defaults a config class declares for its fields."""
    declared = {}
    for f in dataclasses.fields(cls) if dataclasses.is_dataclass(cls) else ():
        if f.default is not dataclasses.MISSING:
            declared[f.name] = f.default
        elif f.default_factory is not dataclasses.MISSING:
            declared[f.name] = f.default_factory()
    return declared


def _derived(cls: type) -> dict[str, Any]:
    """What ``cls()`` holds that its declaration does not: attributes that are not dataclass fields, and fields
    whose declared default (None, "auto") ``__post_init__`` replaced."""
    if cls not in _DERIVED:
        try:
            fresh = vars(cls())
        except Exception:
            fresh = {}
        declared = _declared(cls)
        _DERIVED[cls] = {k: v for k, v in fresh.items() if not k.startswith("_") and not hasattr(v, "model_type")
                         and (k not in declared or not _same_value(declared[k], v))}
    return _DERIVED[cls]


def _same_value(a: Any, b: Any) -> bool:
    try:
        return type(a) is type(b) and bool(a == b)
    except Exception:
        return False
