"""The cases of the conformance sweep (scripts/conformance.py): the registries, the models made tiny by the one
shrinking function (``conformance_shrink.py``), and the ordinary LightningModules the architectures are trained in.

- :func:`registry` lists the architectures: ``transformers``' causal-LM, seq2seq and image-text-to-text auto
  mappings, and diffusers' transformer classes that have an input recipe (:data:`DIFFUSERS`, taken from the tiny
  inits and dummy inputs of diffusers' own ``tests/models/transformers/``).
- :func:`~conformance_shrink.shrink` makes a tiny config from a config class's own attributes (and those of its
  sub-configs): widths, layers, heads, key-value heads, head and feed-forward sizes, vocabulary, experts, state
  sizes, made consistent by generic rules (derived sizes derived again, rope sections, hybrids' layer kinds,
  per-layer overrides: see its docstring). Every dropout and random draw (layer drop, router jitter) is turned off,
  so that one process and the pipeline can be bitwise comparable. :func:`hf_config` takes the model class's own
  config class where the registry's config is a composite holding it (a causal LM of a multimodal model's text part).
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
from conformance_shrink import shrink
from torch import nn

NEW_TOKENS = 4
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


# ----------------------------------------------------------------------------------------------------- models
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


def hf_config(case: Case) -> Any:
    """The tiny config of a transformers case: its model type's default, shrunk; the model class's own config class
    where that is a part of the default (a causal LM of a composite's text or decoder config)."""
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    config = CONFIG_MAPPING[case.model_type]()
    want = getattr(getattr(transformers, case.name), "config_class", None)
    if want is not None and not isinstance(config, want):
        config = next((v for v in vars(config).values() if isinstance(v, want)), config)
    return shrink(config)


def hf_model(case: Case) -> nn.Module:
    import transformers

    cls = getattr(transformers, case.name)
    model = cls._from_config(hf_config(case), attn_implementation="eager", dtype=torch.float32)
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
