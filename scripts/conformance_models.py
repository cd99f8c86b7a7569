"""The cases of the conformance sweep (scripts/conformance.py): the registries, the one shrinking function, and the
ordinary LightningModules the architectures are trained in.

- :func:`registry` lists the architectures: ``transformers``' causal-LM, seq2seq and image-text-to-text auto
  mappings, and diffusers' transformer classes that have an input recipe (:data:`DIFFUSERS`, taken from the tiny
  inits and dummy inputs of diffusers' own ``tests/models/transformers/``).
- :func:`shrink` makes a tiny config from a config class's own attributes (and those of its sub-configs):
  widths, layers, heads, key-value heads, head and feed-forward sizes, vocabulary, experts, state sizes. Every
  dropout and random draw (layer drop, router jitter) is turned off, so that one process and the pipeline can be
  bitwise comparable.
- :func:`build` returns ``(LightningModule, train rows, predict rows, collate)`` for a case: a Hugging Face model in
  :class:`HFModule` (loss from ``labels``, padded with ``-100``; ``generate()`` greedy and with ``num_beams=2`` in
  ``predict_step``), or a diffusers model in :class:`DiffusionModule` (an MSE loss against a fixed target).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn

VOCAB = 99  # as transformers' ModelTesters; the rows use ids 3 .. 47 (0 pad, 1 bos, 2 eos)
LAYERS = 4  # decoder-only: 2 blocks per stage on 2 stages; an encoder-decoder gets 2 + 2
NEW_TOKENS = 4
INIT = 0.2  # wider than 0.02, so that greedy choices are not near-ties that a microbatch's rounding flips
LR = 0.05


# ----------------------------------------------------------------------------------------------------- registry
@dataclass(frozen=True)
class Case:
    """One architecture: ``name`` is its class name; ``registry`` where it was listed; ``model_type`` the config's
    key (transformers) or the recipe (diffusers)."""

    name: str
    registry: str
    model_type: str


TRANSFORMERS_MAPPINGS = {
    "causal-lm": "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES",
    "seq2seq": "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES",
    "image-text-to-text": "MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES",
}


def registry() -> list[Case]:
    """Every architecture of the registries, each once (the first registry that lists its class)."""
    from transformers.models.auto import modeling_auto

    cases: list[Case] = []
    seen: set[str] = set()
    for reg, attr in TRANSFORMERS_MAPPINGS.items():
        for model_type, names in getattr(modeling_auto, attr).items():
            name = names[0] if isinstance(names, (tuple, list)) else names
            if name not in seen:
                seen.add(name)
                cases.append(Case(name, reg, model_type))
    cases += [Case(name, "diffusers", name) for name in DIFFUSERS]
    return cases


# ----------------------------------------------------------------------------------------------------- shrinking
WIDTH = ("hidden_size", "d_model", "n_embd", "embed_dim", "model_dim", "word_embed_proj_dim", "projection_dim",
         "vision_output_dim", "output_hidden_size", "text_hidden_size", "vision_hidden_size")
FFN = ("intermediate_size", "ffn_dim", "d_ff", "n_inner", "ffn_hidden_size", "encoder_ffn_dim", "decoder_ffn_dim",
       "ffn_dim_size", "dense_intermediate_size")
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
TOP_K = ("num_experts_per_tok", "moe_topk", "top_k", "num_selected_experts", "moe_k")
STATE = ("state_size", "d_state", "ssm_state_size", "mamba_d_state", "time_step_rank", "kv_lora_rank",
         "q_lora_rank", "linear_num_key_heads", "linear_num_value_heads", "mamba_n_heads", "mamba_d_head")
TARGETS: dict[tuple[str, ...], int] = {
    WIDTH: 32, FFN: 64, SMALL_FFN: 16, HEADS: 4, KV_HEADS: 2, HEAD_DIM: 8, POSITIONS: 128, EXPERTS: 4, TOP_K: 2,
    STATE: 8, ("vocab_size", "n_vocab", "padded_vocab_size"): VOCAB, ("n_shared_experts", "n_group", "topk_group"): 1,
    ("sliding_window", "attention_window", "local_window_size"): 8, ("image_size",): 32, ("num_channels",): 3,
}
RANDOM = ("router_jitter_noise", "jitter_noise", "layerdrop", "encoder_layerdrop", "decoder_layerdrop")


def shrink(config: Any, layers: int = LAYERS) -> Any:
    """A tiny config of ``config``'s class from its own attributes: every size it has set to a tiny value (never
    larger than the default), ``layers`` layers (lists with one entry per layer cut to their first ``layers``),
    sub-configs shrunk alike, every dropout and random draw off, eager attention, token ids 0 (pad) / 1 / 2."""
    attrs = {k: v for k, v in vars(config).items() if not k.startswith("_")}
    if attrs.get("is_encoder_decoder"):
        layers = min(layers, 2)
    old_layers = next((attrs[k] for k in LAYER_COUNTS if isinstance(attrs.get(k), int)), None)
    changes: dict[str, Any] = {}
    for key, value in attrs.items():
        if hasattr(value, "to_dict") and hasattr(value, "model_type"):  # a sub-config
            changes[key] = shrink(value, layers)
            continue
        if isinstance(value, bool) or value is None:
            continue
        lowered = key.lower()
        if isinstance(value, float) and ("drop" in lowered or key in RANDOM):
            changes[key] = 0.0
        elif isinstance(value, int) and key in LAYER_COUNTS:
            changes[key] = min(value, layers)
        elif isinstance(value, int) and key in RANDOM:
            changes[key] = 0
        elif isinstance(value, int):
            for names, target in TARGETS.items():
                if key in names and value > 0:
                    changes[key] = min(value, target)
        elif isinstance(value, list) and old_layers and len(value) == old_layers and old_layers > layers:
            changes[key] = _cut(value, layers)
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
    try:
        tiny = type(config)(**{**_constructor_view(attrs), **changes})
    except Exception:  # a config whose __init__ rejects a derived attribute: set the changes on the default
        tiny = type(config)(**{k: v for k, v in changes.items() if not hasattr(v, "model_type")})
        for key, value in changes.items():
            setattr(tiny, key, value)
    for key, value in changes.items():  # what __init__ derived otherwise (a head_dim from the old width)
        if getattr(tiny, key, value) != value and not hasattr(value, "model_type"):
            setattr(tiny, key, value)
    tiny._attn_implementation = "eager"
    return tiny


def _cut(per_layer: list, layers: int) -> list:
    """The first ``layers`` entries of a per-layer list, its last ones replaced by kinds the cut would lose (a
    hybrid's attention layers after its first Mamba layers)."""
    cut = list(per_layer[:layers])
    missing = [v for i, v in enumerate(per_layer) if v not in cut and v not in per_layer[:i]]
    for i, kind in enumerate(missing[: layers - 1]):
        cut[layers - 1 - i] = kind
    return cut


def _constructor_view(attrs: dict[str, Any]) -> dict[str, Any]:
    """The attributes a config's ``__init__`` takes back (id2label and friends are rebuilt)."""
    drop = {"transformers_version", "architectures", "id2label", "label2id", "dtype", "torch_dtype"}
    return {k: v for k, v in attrs.items() if k not in drop and not hasattr(v, "model_type")}


def quiet(model: nn.Module) -> nn.Module:
    """Every random draw in training off: dropout modules, diffusers' class-label dropout (classifier-free
    guidance), drop-path."""
    for module in model.modules():
        if isinstance(module, nn.modules.dropout._DropoutNd):
            module.p = 0.0
        for attr in ("dropout_prob", "drop_prob", "layerdrop", "p_drop"):
            if isinstance(getattr(module, attr, None), float):
                setattr(module, attr, 0.0)
    return model


def hf_model(case: Case) -> nn.Module:
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    config = shrink(CONFIG_MAPPING[case.model_type]())
    cls = getattr(transformers, case.name)
    model = cls._from_config(config, attn_implementation="eager", dtype=torch.float32)
    return quiet(model)


# ----------------------------------------------------------------------------------------------------- data
def token_rows(n: int, seed: int) -> list[dict[str, torch.Tensor]]:
    """Fine-tuning rows of 3 to 16 tokens, labels on every token (padded with ``-100`` by :func:`pad_collate`)."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n):
        ids = torch.randint(3, 48, (int(torch.randint(3, 17, (), generator=g)),), generator=g)
        rows.append({"input_ids": ids, "labels": ids.clone()})
    return rows


def pad_collate(rows: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    length = max(len(r["input_ids"]) for r in rows)
    batch = {
        "input_ids": torch.zeros(len(rows), length, dtype=torch.long),
        "attention_mask": torch.zeros(len(rows), length, dtype=torch.long),
        "labels": torch.full((len(rows), length), -100, dtype=torch.long),
    }
    for i, r in enumerate(rows):
        batch["input_ids"][i, : len(r["input_ids"])] = r["input_ids"]
        batch["attention_mask"][i, : len(r["input_ids"])] = 1
        batch["labels"][i, : len(r["labels"])] = r["labels"]
    return batch


def prompts(batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded prompts of 2 to 6 tokens from the batch's rows, and their attention mask."""
    ids = batch["input_ids"]
    lengths = [2 + (i * 3) % 5 for i in range(ids.shape[0])]
    prompt = torch.zeros(ids.shape[0], max(lengths), dtype=torch.long, device=ids.device)
    mask = torch.zeros_like(prompt)
    for i, length in enumerate(lengths):
        prompt[i, prompt.shape[1] - length:] = ids[i, :length].clamp(min=3)
        mask[i, prompt.shape[1] - length:] = 1
    return prompt, mask


# ----------------------------------------------------------------------------------------------------- modules
class Lit(L.LightningModule):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = self.loss(batch)
        self.log("train_loss", loss)
        return loss

    def loss(self, batch: Any) -> torch.Tensor:
        raise NotImplementedError

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=LR, momentum=0.9)


class HFModule(Lit):
    """A ``transformers`` model as shipped, with only the LightningModule around it: the loss from ``labels``; in
    ``predict_step``, ``generate()`` greedy and with ``num_beams=2`` on left-padded prompts."""

    def __init__(self, case: Case) -> None:
        super().__init__()
        self.model = hf_model(case)
        self.generates = bool(getattr(self.model, "can_generate", lambda: False)())

    def loss(self, batch: Any) -> torch.Tensor:
        return self.model(**batch).loss

    def predict_step(self, batch: Any, batch_idx: int) -> dict[str, torch.Tensor]:
        if not self.generates:
            return {"logits": self.model(**batch).logits}
        prompt, mask = prompts(batch)
        out = {}
        for name, options in (("greedy", {}), ("beam", {"num_beams": 2})):
            tokens = self.model.generate(
                input_ids=prompt, attention_mask=mask, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                do_sample=False, pad_token_id=0, **options,
            )
            out[name] = tokens[:, -NEW_TOKENS:]
        return out


@dataclass(frozen=True)
class Recipe:
    """A diffusers model: its tiny init (diffusers' tests, with more layers) and ``inputs(n, generator)``, ``n`` rows
    of every tensor argument; ``extra(rows)`` gives the arguments that are not per row."""

    init: dict[str, Any]
    inputs: Callable[[int, torch.Generator], dict[str, torch.Tensor]]
    extra: Callable[[int], dict[str, Any]] = field(default=lambda n: {})


def _r(*shape: int) -> Callable[[int, torch.Generator], torch.Tensor]:
    return lambda n, g: torch.randn(n, *shape, generator=g)


def _steps(n: int, g: torch.Generator) -> torch.Tensor:
    return torch.randint(0, 1000, (n,), generator=g)


def _float_steps(n: int, g: torch.Generator) -> torch.Tensor:
    return torch.randint(0, 1000, (n,), generator=g).float()


def _rand(n: int, g: torch.Generator) -> torch.Tensor:
    return torch.rand(n, generator=g)


def _flux_ids(n: int) -> dict[str, torch.Tensor]:
    """Flux's position ids of a 4 x 4 latent and 8 text tokens (not per row)."""
    side = torch.arange(4)
    return {"img_ids": torch.stack([torch.zeros(16), side.repeat(4), side.repeat_interleave(4)], 1),
            "txt_ids": torch.zeros(8, 3)}


def _ones(length: int, dtype: torch.dtype = torch.bool) -> Callable[[int, torch.Generator], torch.Tensor]:
    return lambda n, g: torch.ones(n, length, dtype=dtype)


def _inputs(**specs: Callable[[int, torch.Generator], torch.Tensor]) -> Callable:
    return lambda n, g: {k: spec(n, g) for k, spec in specs.items()}


DIFFUSERS: dict[str, Recipe] = {
    "FluxTransformer2DModel": Recipe(
        dict(patch_size=1, in_channels=4, num_layers=2, num_single_layers=2, attention_head_dim=16,
             num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=32, axes_dims_rope=(4, 4, 8)),
        _inputs(hidden_states=_r(16, 4), encoder_hidden_states=_r(8, 32), pooled_projections=_r(32),
                timestep=_rand),
        _flux_ids,
    ),
    "SD3Transformer2DModel": Recipe(
        dict(sample_size=8, patch_size=2, in_channels=4, num_layers=4, attention_head_dim=8, num_attention_heads=4,
             caption_projection_dim=32, joint_attention_dim=32, pooled_projection_dim=64, out_channels=4,
             pos_embed_max_size=8),
        _inputs(hidden_states=_r(4, 8, 8), encoder_hidden_states=_r(8, 32), pooled_projections=_r(64),
                timestep=_steps),
    ),
    "PixArtTransformer2DModel": Recipe(
        dict(sample_size=8, num_layers=4, patch_size=2, attention_head_dim=8, num_attention_heads=3,
             caption_channels=32, in_channels=4, cross_attention_dim=24, out_channels=8, attention_bias=True,
             activation_fn="gelu-approximate", num_embeds_ada_norm=1000, norm_type="ada_norm_single",
             norm_elementwise_affine=False, norm_eps=1e-6),
        _inputs(hidden_states=_r(4, 8, 8), encoder_hidden_states=_r(8, 32), timestep=_steps),
        lambda n: {"added_cond_kwargs": {"aspect_ratio": None, "resolution": None}},
    ),
    "DiTTransformer2DModel": Recipe(
        dict(in_channels=4, out_channels=8, activation_fn="gelu-approximate", num_attention_heads=2,
             attention_head_dim=4, attention_bias=True, num_layers=4, norm_type="ada_norm_zero",
             num_embeds_ada_norm=8, patch_size=2, sample_size=8),
        _inputs(hidden_states=_r(4, 8, 8), timestep=_steps,
                class_labels=lambda n, g: torch.randint(0, 4, (n,), generator=g)),
    ),
    "SanaTransformer2DModel": Recipe(
        dict(patch_size=1, in_channels=4, out_channels=4, num_layers=4, attention_head_dim=4, num_attention_heads=2,
             num_cross_attention_heads=2, cross_attention_head_dim=4, cross_attention_dim=8, caption_channels=8,
             sample_size=8),
        _inputs(hidden_states=_r(4, 8, 8), encoder_hidden_states=_r(8, 8), timestep=_steps),
    ),
    "WanTransformer3DModel": Recipe(
        dict(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=4, out_channels=4,
             text_dim=16, freq_dim=256, ffn_dim=32, num_layers=4, cross_attn_norm=True,
             qk_norm="rms_norm_across_heads", rope_max_seq_len=32),
        _inputs(hidden_states=_r(4, 2, 8, 8), encoder_hidden_states=_r(12, 16), timestep=_steps),
    ),
    "SkyReelsV2Transformer3DModel": Recipe(
        dict(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=4, out_channels=4,
             text_dim=16, freq_dim=256, ffn_dim=32, num_layers=4, cross_attn_norm=True,
             qk_norm="rms_norm_across_heads", rope_max_seq_len=32),
        _inputs(hidden_states=_r(4, 2, 8, 8), encoder_hidden_states=_r(12, 16), timestep=_steps),
    ),
    "CogVideoXTransformer3DModel": Recipe(
        dict(num_attention_heads=2, attention_head_dim=8, in_channels=4, out_channels=4, time_embed_dim=2,
             text_embed_dim=8, num_layers=4, sample_width=8, sample_height=8, sample_frames=8, patch_size=2,
             patch_size_t=None, temporal_compression_ratio=4, max_text_seq_length=8),
        _inputs(hidden_states=_r(1, 4, 8, 8), encoder_hidden_states=_r(8, 8), timestep=_steps),
    ),
    "HunyuanVideoTransformer3DModel": Recipe(
        dict(in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=10, num_layers=2,
             num_single_layers=2, num_refiner_layers=1, patch_size=1, patch_size_t=1, guidance_embeds=True,
             text_embed_dim=16, pooled_projection_dim=8, rope_axes_dim=(2, 4, 4), image_condition_type=None),
        _inputs(hidden_states=_r(4, 1, 8, 8), timestep=_float_steps,
                encoder_hidden_states=_r(12, 16), pooled_projections=_r(8),
                encoder_attention_mask=_ones(12, torch.long),
                guidance=_float_steps),
    ),
    "LTXVideoTransformer3DModel": Recipe(
        dict(in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=8, cross_attention_dim=16,
             num_layers=4, qk_norm="rms_norm_across_heads", caption_channels=16),
        _inputs(hidden_states=_r(2 * 8 * 8, 4), encoder_hidden_states=_r(16, 16), timestep=_steps,
                encoder_attention_mask=_ones(16)),
        lambda n: {"num_frames": 2, "height": 8, "width": 8},
    ),
    "QwenImageTransformer2DModel": Recipe(
        dict(patch_size=2, in_channels=16, out_channels=4, num_layers=4, attention_head_dim=16, num_attention_heads=4,
             joint_attention_dim=16, guidance_embeds=False, axes_dims_rope=(8, 4, 4)),
        _inputs(hidden_states=_r(16, 16), encoder_hidden_states=_r(8, 16),
                encoder_hidden_states_mask=_ones(8, torch.long), timestep=lambda n, g: torch.ones(n)),
        lambda n: {"img_shapes": [(1, 4, 4)] * n},
    ),
    "AuraFlowTransformer2DModel": Recipe(
        dict(sample_size=16, patch_size=2, in_channels=4, num_mmdit_layers=2, num_single_dit_layers=2,
             attention_head_dim=8, num_attention_heads=4, caption_projection_dim=32, joint_attention_dim=32,
             out_channels=4, pos_embed_max_size=64),
        _inputs(hidden_states=_r(4, 16, 16), encoder_hidden_states=_r(16, 32), timestep=_steps),
    ),
    "Lumina2Transformer2DModel": Recipe(
        dict(sample_size=16, patch_size=2, in_channels=4, hidden_size=24, num_layers=4, num_refiner_layers=1,
             num_attention_heads=3, num_kv_heads=1, multiple_of=2, ffn_dim_multiplier=None, norm_eps=1e-5,
             scaling_factor=1.0, axes_dim_rope=(4, 2, 2), axes_lens=(128, 128, 128), cap_feat_dim=32),
        _inputs(hidden_states=_r(4, 16, 16), encoder_hidden_states=_r(16, 32),
                timestep=_rand, encoder_attention_mask=_ones(16)),
    ),
    "MochiTransformer3DModel": Recipe(
        dict(patch_size=2, num_attention_heads=2, attention_head_dim=8, num_layers=4, pooled_projection_dim=16,
             in_channels=4, out_channels=None, qk_norm="rms_norm", text_embed_dim=16, time_embed_dim=4,
             activation_fn="swiglu", max_sequence_length=16),
        _inputs(hidden_states=_r(4, 2, 8, 8), encoder_hidden_states=_r(16, 16), timestep=_steps,
                encoder_attention_mask=_ones(16)),
    ),
    "AllegroTransformer3DModel": Recipe(
        dict(num_attention_heads=2, attention_head_dim=8, in_channels=4, out_channels=4, num_layers=4,
             cross_attention_dim=16, sample_width=8, sample_height=8, sample_frames=8, caption_channels=8),
        _inputs(hidden_states=_r(4, 2, 8, 8), encoder_hidden_states=_r(16, 8), timestep=_steps),
    ),
    "CogView4Transformer2DModel": Recipe(
        dict(patch_size=2, in_channels=4, num_layers=4, attention_head_dim=4, num_attention_heads=4, out_channels=4,
             text_embed_dim=8, time_embed_dim=8, condition_dim=4),
        _inputs(hidden_states=_r(4, 8, 8), encoder_hidden_states=_r(8, 8), timestep=_steps,
                original_size=lambda n, g: torch.tensor([[64, 64]]).repeat(n, 1),
                target_size=lambda n, g: torch.tensor([[64, 64]]).repeat(n, 1),
                crop_coords=lambda n, g: torch.zeros(n, 2, dtype=torch.long)),
    ),
    "ChromaTransformer2DModel": Recipe(
        dict(patch_size=1, in_channels=4, num_layers=2, num_single_layers=2, attention_head_dim=16,
             num_attention_heads=2, joint_attention_dim=32, axes_dims_rope=[4, 4, 8], approximator_num_channels=8,
             approximator_hidden_dim=16, approximator_layers=1),
        _inputs(hidden_states=_r(16, 4), encoder_hidden_states=_r(8, 32), timestep=_rand),
        _flux_ids,
    ),
    "LatteTransformer3DModel": Recipe(
        dict(sample_size=8, num_layers=4, patch_size=2, attention_head_dim=4, num_attention_heads=2,
             caption_channels=8, in_channels=4, cross_attention_dim=8, out_channels=8, attention_bias=True,
             activation_fn="gelu-approximate", num_embeds_ada_norm=1000, norm_type="ada_norm_single",
             norm_elementwise_affine=False, norm_eps=1e-6),
        _inputs(hidden_states=_r(4, 1, 8, 8), encoder_hidden_states=_r(8, 8), timestep=_steps),
        lambda n: {"enable_temporal_attentions": True},
    ),
}


class DiffusionModule(Lit):
    """A diffusers transformer as shipped (tiny init), trained to match a fixed target with an MSE loss; its
    ``predict_step`` returns the output."""

    def __init__(self, case: Case) -> None:
        super().__init__()
        import diffusers

        self.recipe = DIFFUSERS[case.name]
        self.model = quiet(getattr(diffusers, case.name)(**self.recipe.init))

    def output(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        inputs = {k: v for k, v in batch.items() if k != "target"}
        extra = {k: v.to(batch["hidden_states"].device) if torch.is_tensor(v) else v
                 for k, v in self.recipe.extra(batch["hidden_states"].shape[0]).items()}
        return self.model(**inputs, **extra, return_dict=False)[0]

    def loss(self, batch: Any) -> torch.Tensor:
        return F.mse_loss(self.output(batch), batch["target"])

    def predict_step(self, batch: Any, batch_idx: int) -> dict[str, torch.Tensor]:
        return {"output": self.output(batch)}


def diffusion_rows(module: DiffusionModule, n: int, seed: int) -> list[dict[str, torch.Tensor]]:
    """``n`` rows of the recipe's inputs, each with a target shaped like the model's output (a forward of one row
    learns the shape; no parameter changes)."""
    g = torch.Generator().manual_seed(seed)
    batch = module.recipe.inputs(n, g)
    with torch.no_grad():
        shape = module.output({k: v[:1] for k, v in batch.items()}).shape[1:]
    batch["target"] = torch.randn(n, *shape, generator=g)
    return [{k: v[i] for k, v in batch.items()} for i in range(n)]


def build(case: Case, n: int = 24, seed: int = 1234) -> tuple[L.LightningModule, list, list, Optional[Callable]]:
    """The case's LightningModule (built after seeding ``seed``), ``n`` training rows, 8 predict rows, and the
    collate function (None: the default)."""
    torch.manual_seed(seed)
    if case.registry == "diffusers":
        module = DiffusionModule(case)
        return module, diffusion_rows(module, n, 0), diffusion_rows(module, 8, 1), None
    return HFModule(case), token_rows(n, 0), token_rows(8, 1), pad_collate
