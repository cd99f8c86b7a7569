"""Zoo models whose batches are laid out other than one tensor row per sample (tests/zoo.py has the rest).

- ``qwen2_vl``, ``llava`` (below) generate in ``predict_step``, with their images (:class:`Generates`).
- ``qwen2_vl``: Hugging Face Qwen2-VL on image+text rows as its processor makes them: ``pixel_values`` packed over
  the batch's images (``[patches of all images, channels * patch volume]``), ``image_grid_thw`` one row per image,
  rows with no image, one, or two, of different sizes ([Note: packed vision inputs]). Its vision blocks see patches,
  its language layers the batch's rows: ``backbone="auto"`` takes the language layers.
- ``llava``: Hugging Face LLaVA on rows of 0 to 2 images, one row of ``pixel_values`` per image: its projector reads
  the vision tower's second-to-last hidden states, which Hugging Face records with hooks on the vision layers, so
  ``backbone="auto"`` takes the language layers.
- ``frames``: a video model that folds its frames into the batch before its blocks (``[batch * frames, tokens,
  width]``, as Latte and TimeSformer do) ([Note: rows folded into the batch]); its blocks record the rows they are
  given (``input_lengths``), so a test sees that each microbatch holds its share of them, not the whole batch.
- ``hf_llama_encoding``: a Hugging Face Llama fine-tuned on batches that are ``BatchEncoding``s (a ``UserDict``, not a
  ``dict``), as Hugging Face's collators return them.
- ``packed_patches``: a hand-written model whose batch packs every sample's patches into one tensor with no rule
  to cut it by: refused, naming the tensor (tests/test_errors.py).
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn.functional as F
import zoo
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

IMAGE, VISION_START, VISION_END, VIDEO = 90, 91, 92, 93  # Qwen2-VL's special tokens in a vocabulary of 99
PATCH, TEMPORAL, MERGE = 2, 2, 2


# ----------------------------------------------------------------------------------------------------- generation
class Generates:
    """``predict_step``: ``generate()`` on the batch's prompts with their images, greedy then with 2 beams, 4 new
    tokens each (the prompts left-padded, as a processor pads them for generation)."""

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        inputs = left_padded({k: v for k, v in batch.items() if k != "labels"})
        return torch.cat([
            self.model.generate(**inputs, max_new_tokens=4, min_new_tokens=4, do_sample=False, pad_token_id=0,
                                num_beams=beams)[:, -4:]
            for beams in (1, 2)
        ], dim=1)


def left_padded(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The batch's right-padded rows (and their token types) padded on the left instead."""
    mask = batch["attention_mask"]
    out = dict(batch)
    for key in ("input_ids", "attention_mask", "mm_token_type_ids"):
        if key in batch:
            value = torch.zeros_like(batch[key])
            for i, n in enumerate(mask.sum(1).tolist()):
                value[i, value.shape[1] - n:] = batch[key][i, :n]
            out[key] = value
    return out


# ----------------------------------------------------------------------------------------------------- Qwen2-VL
class Qwen2VL(Generates, zoo.Lit):
    """Hugging Face Qwen2-VL as shipped (tiny config, random weights), its loss from ``labels``."""

    def __init__(self, layers: int = 4, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

        config = Qwen2VLConfig(
            vision_config=dict(depth=2, embed_dim=16, hidden_size=32, num_heads=2, patch_size=PATCH,
                               temporal_patch_size=TEMPORAL, spatial_merge_size=MERGE, in_channels=3, mlp_ratio=2),
            text_config=dict(
                vocab_size=99, hidden_size=32, intermediate_size=64, num_hidden_layers=layers, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1]},
            ),
            image_token_id=IMAGE, vision_start_token_id=VISION_START, vision_end_token_id=VISION_END,
            video_token_id=VIDEO,
        )
        self.model = Qwen2VLForConditionalGeneration(config)

    def loss(self, batch: Any) -> torch.Tensor:
        return self.model(**batch).loss


def image_text_rows(n: int, seed: int) -> list[dict[str, torch.Tensor]]:
    """Rows of 0, 1 or 2 images (grids of 2 x 2 to 4 x 4 patches, so 1 to 4 image tokens each) before 3 to 8 text
    tokens; the labels leave out the images' tokens."""
    g = torch.Generator().manual_seed(seed)
    grids = [(2, 2), (4, 2), (2, 4), (4, 4)]
    rows = []
    for i in range(n):
        count = (1, 2, 0, 1)[i % 4]
        ids, labels, pixels, grid = [], [], [], []
        for j in range(count):
            h, w = grids[(i + j) % 4]
            pixels.append(torch.randn(h * w, 3 * TEMPORAL * PATCH * PATCH, generator=g))
            grid.append(torch.tensor([1, h, w]))
            image = [VISION_START] + [IMAGE] * (h * w // MERGE**2) + [VISION_END]
            ids += image
            labels += [-100] * len(image)
        text = torch.randint(3, 80, (int(torch.randint(3, 9, (), generator=g)),), generator=g).tolist()
        rows.append({
            "input_ids": torch.tensor(ids + text), "labels": torch.tensor(labels + text),
            "pixel_values": torch.cat(pixels) if pixels else torch.zeros(0, 3 * TEMPORAL * PATCH * PATCH),
            "image_grid_thw": torch.stack(grid) if grid else torch.zeros(0, 3, dtype=torch.long),
        })
    return rows


def image_text_collate(rows: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """As Qwen2-VL's processor batches: text padded (label ``-100``), images packed in row order."""
    batch = zoo.pad_collate([{"input_ids": r["input_ids"], "labels": r["labels"]} for r in rows])
    batch["mm_token_type_ids"] = (batch["input_ids"] == IMAGE).long()
    batch["pixel_values"] = torch.cat([r["pixel_values"] for r in rows])
    batch["image_grid_thw"] = torch.cat([r["image_grid_thw"] for r in rows])
    return batch


# ----------------------------------------------------------------------------------------------------- LLaVA
class Llava(Generates, zoo.Lit):
    """Hugging Face LLaVA as shipped (tiny config, random weights): a CLIP vision tower, whose second-to-last layer's
    hidden states (recorded by Hugging Face's hooks on its layers) the projector reads, and a Llama."""

    def __init__(self, layers: int = 4, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        from transformers import LlavaConfig, LlavaForConditionalGeneration

        config = LlavaConfig(
            vision_config=dict(model_type="clip_vision_model", hidden_size=16, intermediate_size=32,
                               num_hidden_layers=3, num_attention_heads=2, image_size=8, patch_size=2,
                               projection_dim=16),
            text_config=dict(model_type="llama", vocab_size=99, hidden_size=32, intermediate_size=64,
                             num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                             max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=2),
            image_token_id=IMAGE, vision_feature_layer=-2, vision_feature_select_strategy="default",
        )
        self.model = LlavaForConditionalGeneration(config)

    def loss(self, batch: Any) -> torch.Tensor:
        return self.model(**batch).loss


def llava_rows(n: int, seed: int) -> list[dict[str, torch.Tensor]]:
    """Rows of 0, 1 or 2 images of 8 x 8 pixels (16 image tokens each: 4 x 4 patches, the class token dropped) before
    3 to 8 text tokens; the labels leave out the images' tokens."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for i in range(n):
        count = (1, 2, 0, 1)[i % 4]
        text = torch.randint(3, 80, (int(torch.randint(3, 9, (), generator=g)),), generator=g).tolist()
        rows.append({
            "input_ids": torch.tensor([IMAGE] * 16 * count + text),
            "labels": torch.tensor([-100] * 16 * count + text),
            "pixel_values": torch.randn(count, 3, 8, 8, generator=g),
        })
    return rows


def llava_collate(rows: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """As LLaVA's processor batches: text padded (label ``-100``), one row of ``pixel_values`` per image."""
    batch = zoo.pad_collate([{"input_ids": r["input_ids"], "labels": r["labels"]} for r in rows])
    batch["pixel_values"] = torch.cat([r["pixel_values"] for r in rows])
    return batch


# ----------------------------------------------------------------------------------------------------- frames
FRAMES, TOKENS, WIDTH = 3, 4, 16


class FrameBlock(nn.Module):
    """Attention over one frame's tokens and an MLP; records the rows of every real hidden state it is given."""

    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(WIDTH, 2, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(WIDTH, 2 * WIDTH), nn.GELU(), nn.Linear(2 * WIDTH, WIDTH))
        self.input_lengths: set[int] = set()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if type(x) is torch.Tensor:  # not a ghost: the block computes on it
            self.input_lengths.add(x.shape[0])
        x = x + self.attn(x, x, x, need_weights=False)[0]
        return x + self.mlp(x)


class Frames(zoo.Lit):
    """A video classifier that folds the frames into the batch for its blocks, and unfolds them for the head."""

    def __init__(self, layers: int = 4, classes: int = 5, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.embed = nn.Linear(8, WIDTH)
        self.blocks = nn.ModuleList(FrameBlock() for _ in range(layers))
        self.head = nn.Linear(WIDTH, classes)

    def forward(self, video: torch.Tensor) -> torch.Tensor:
        b = video.shape[0]
        x = self.embed(video).flatten(0, 1)  # [batch * frames, tokens, width]
        for block in self.blocks:
            x = block(x)
        return self.head(x.unflatten(0, (b, FRAMES)).mean((1, 2)))

    def loss(self, batch: Any) -> torch.Tensor:
        video, label = batch
        return F.cross_entropy(self(video), label)


def videos(n: int, seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(n, FRAMES, TOKENS, 8, generator=g), torch.randint(0, 5, (n,), generator=g))


# ----------------------------------------------------------------------------------------------------- others
def encoding_collate(rows: list[dict[str, torch.Tensor]]) -> Any:
    from transformers import BatchEncoding

    return BatchEncoding(zoo.pad_collate(rows))


class PackedPatches(zoo.Lit):
    """Every sample's patches packed into one ``[patches, width]`` tensor, pooled per sample by ``lengths`` before a
    backbone over the samples' rows: nothing says how to cut the patches by rows."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.embed = nn.Linear(8, WIDTH)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()) for _ in range(4))
        self.head = nn.Linear(WIDTH, 5)

    def loss(self, batch: Any) -> torch.Tensor:
        pooled = torch.stack([p.mean(0) for p in self.embed(batch["patches"]).split(batch["lengths"].tolist())])
        for block in self.blocks:
            pooled = block(pooled)
        return F.cross_entropy(self.head(pooled), batch["label"])


def packed_patches(n: int, seed: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [{"patches": torch.randn(1 + i % 3, 8, generator=g), "label": torch.tensor(i % 5)} for i in range(n)]


def packed_collate(rows: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    return {
        "patches": torch.cat([r["patches"] for r in rows]),
        "lengths": torch.tensor([len(r["patches"]) for r in rows]),
        "label": torch.stack([r["label"] for r in rows]),
    }


MODELS: dict[str, Callable[..., zoo.Lit]] = {
    "qwen2_vl": Qwen2VL,
    "llava": Llava,
    "frames": Frames,
    "hf_llama_encoding": lambda **kw: zoo.HFFineTuned("llama", **kw),
    "packed_patches": PackedPatches,
}


def make(name: str, seed: int = 1234, **kwargs: Any) -> Any:
    if name not in MODELS:
        return zoo.make(name, seed, **kwargs)
    torch.manual_seed(seed)
    return MODELS[name](**kwargs)


def loader(name: str, n: int = 32, batch_size: int = 8, seed: int = 0, **kwargs: Any) -> DataLoader:
    if name == "qwen2_vl":
        return DataLoader(image_text_rows(n, seed), batch_size=batch_size, collate_fn=image_text_collate)
    if name == "llava":
        return DataLoader(llava_rows(n, seed), batch_size=batch_size, collate_fn=llava_collate)
    if name == "frames":
        return DataLoader(videos(n, seed), batch_size=batch_size)
    if name == "hf_llama_encoding":
        return DataLoader(zoo.finetuning(n, seed), batch_size=batch_size, collate_fn=encoding_collate)
    if name == "packed_patches":
        return DataLoader(packed_patches(n, seed), batch_size=batch_size, collate_fn=packed_collate)
    return zoo.loader(name, n, batch_size, seed, **kwargs)
