"""A batch's rows as microbatches cut them: containers of every kind, frames folded into the batch, images packed over
it (unit tests: no processes; the trainings are tests/test_models.py's ``qwen2_vl``, ``frames`` and
``hf_llama_encoding``)."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace
from typing import NamedTuple

import torch
from torch import nn

from lightning_pipe._calls.batch import batch_tensors, hidden_rows_per_row, left_whole, rows_dim, slice_batch
from lightning_pipe._calls.packed import PackedMedia


class Pair(NamedTuple):
    x: torch.Tensor
    y: torch.Tensor


@dataclasses.dataclass
class Sample:
    ids: torch.Tensor
    names: list


def test_every_kind_of_container_is_cut_by_rows():
    from transformers import BatchEncoding

    ids = torch.arange(24).view(8, 3)
    encoding = slice_batch(BatchEncoding({"input_ids": ids, "scale": torch.ones(2)}), 8, 2, 4)
    assert type(encoding) is BatchEncoding
    assert torch.equal(encoding["input_ids"], ids[2:4]) and encoding["scale"].shape == (2,)
    pair = slice_batch(Pair(ids, ids[:, 0]), 8, 4, 8)
    assert type(pair) is Pair and torch.equal(pair.y, ids[4:8, 0])
    sample = slice_batch(Sample(ids, [f"row {i}" for i in range(8)]), 8, 6, 8)
    assert type(sample) is Sample and sample.names == ["row 6", "row 7"] and torch.equal(sample.ids, ids[6:])
    assert [t.shape for t in batch_tensors(BatchEncoding({"a": ids, "b": [ids[0], Sample(ids, [])]}))] == [
        (8, 3), (3,), (8, 3)
    ]
    assert rows_dim((8, 3, 16), BatchEncoding({"input_ids": ids})) == 0
    assert rows_dim((3, 8, 16), BatchEncoding({"input_ids": ids})) == 1


def test_hidden_rows_per_row_of_the_batch():
    video = torch.zeros(8, 3, 4, 16)  # 8 videos of 3 frames
    assert hidden_rows_per_row(8, (video, torch.zeros(8))) == 1
    assert hidden_rows_per_row(24, (video, torch.zeros(8))) == 3  # frames folded into the batch
    assert hidden_rows_per_row(24, {"weights": torch.zeros(2), "video": video}) == 3  # the most rows that divide
    assert hidden_rows_per_row(7, (video,)) == 0  # no row of the batch makes a known share of them
    assert hidden_rows_per_row(5, [f"prompt {i}" for i in range(5)]) == 1  # strings, tokenized in the step
    assert hidden_rows_per_row(3, (torch.zeros(1, 3, 16),)) == 3  # a batch of one video: one microbatch


def test_left_whole_names_the_tensors_every_microbatch_gets_whole():
    batch = {"input_ids": torch.zeros(8, 5), "pixel_values": torch.zeros(72, 24), "step": torch.tensor(3)}
    assert list(left_whole(batch, 8)) == [("batch['pixel_values']", (72, 24))]
    assert list(left_whole(Pair(torch.zeros(8), torch.zeros(4)), 8)) == [("batch[1]", (4,))]
    assert list(left_whole(Sample(torch.zeros(4), []), 8)) == [("batch.ids", (4,))]


class _Model(nn.Module):
    """Stands in for a Hugging Face model: only its config is read."""

    def __init__(self) -> None:
        super().__init__()
        vision = SimpleNamespace(spatial_merge_size=2)
        self.config = SimpleNamespace(vision_config=vision, image_token_id=9, video_token_id=8)


def _packed_batch() -> dict[str, torch.Tensor]:
    """4 rows: row 0 two images (2 x 2 and 4 x 2 patches: 1 and 2 tokens), row 1 none, row 2 one (4 x 4: 4 tokens),
    row 3 one (2 x 2: 1 token); the patches numbered by image."""
    i = 9
    ids = torch.tensor([
        [1, i, 5, i, i, 5, 0, 0],
        [1, 5, 5, 5, 5, 5, 5, 5],
        [1, i, i, i, i, 5, 5, 0],
        [1, i, 5, 0, 0, 0, 0, 0],
    ])
    grid = torch.tensor([[1, 2, 2], [1, 4, 2], [1, 4, 4], [1, 2, 2]])
    pixels = torch.cat([torch.full((int(g.prod()), 3), float(j)) for j, g in enumerate(grid)])
    return {"input_ids": ids, "pixel_values": pixels, "image_grid_thw": grid}


def test_packed_images_are_cut_with_the_rows_that_hold_their_tokens():
    packed = PackedMedia.of(nn.Sequential(_Model()))
    assert packed is not None and packed.merge == 2
    batch = _packed_batch()
    cases = {(0, 1): [0, 1], (1, 2): [], (1, 3): [2], (2, 4): [2, 3], (0, 4): [0, 1, 2, 3]}
    for (start, stop), images in cases.items():
        part = packed.cut(batch, slice_batch(batch, 4, start, stop), start, stop)
        assert torch.equal(part["input_ids"], batch["input_ids"][start:stop])
        assert part["image_grid_thw"].tolist() == batch["image_grid_thw"][images].tolist()
        assert sorted(set(part["pixel_values"][:, 0].tolist())) == [float(j) for j in images]
        assert len(part["pixel_values"]) == int(batch["image_grid_thw"][images].prod(-1).sum())


def test_images_packed_with_as_many_placeholders_each_are_cut_with_their_rows():
    """LLaVA's layout: one image per row of `pixel_values`, the same placeholders for each (here 2)."""
    i = 9
    ids = torch.tensor([[i, i, i, i, 5], [5, 5, 5, 5, 5], [i, i, 5, 0, 0], [i, i, i, i, 5], [i, i, 5, 5, 5]])
    images = torch.arange(6.0).view(6, 1, 1, 1)  # [images, channels, height, width]
    batch = {"input_ids": ids, "pixel_values": images, "image_sizes": torch.arange(6).view(6, 1)}
    packed = PackedMedia.of(_Model())
    for (start, stop), held in {(0, 1): [0, 1], (1, 3): [2], (3, 5): [3, 4, 5], (2, 4): [2, 3, 4]}.items():
        part = packed.cut(batch, slice_batch(batch, 5, start, stop), start, stop)
        assert part["pixel_values"].flatten().tolist() == held and part["image_sizes"].flatten().tolist() == held
    ids5 = torch.cat([ids[:3], ids[4:], ids[4:]])  # 2, 0, 1, 1, 1 images: as many as rows, still cut by placeholders
    five = {"input_ids": ids5, "pixel_values": images[:5]}
    assert packed.cut(five, slice_batch(five, 5, 0, 2), 0, 2)["pixel_values"].flatten().tolist() == [0, 1]
    assert packed.cut(five, slice_batch(five, 5, 2, 4), 2, 4)["pixel_values"].flatten().tolist() == [2, 3]
    per_row = {"input_ids": ids, "pixel_values": torch.zeros(5, 2, 1, 1, 1)}  # [batch, images, ...]: cut by rows
    assert packed.cut(per_row, slice_batch(per_row, 5, 1, 3), 1, 3)["pixel_values"].shape[0] == 2


def test_packed_images_that_do_not_add_up_are_left_whole():
    packed = PackedMedia.of(_Model())
    batch = _packed_batch()
    batch["pixel_values"] = batch["pixel_values"][:-1]  # not the grids' patches: not this layout
    assert packed.cut(batch, {"input_ids": batch["input_ids"][:1]}, 0, 1).keys() == {"input_ids"}
    assert PackedMedia.of(nn.Linear(2, 2)) is None


def test_packed_media_of_a_hugging_face_vision_language_model():
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    config = Qwen2VLConfig(
        vision_config=dict(depth=1, embed_dim=8, hidden_size=16, num_heads=2, spatial_merge_size=2),
        text_config=dict(vocab_size=99, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1),
        image_token_id=90, video_token_id=93,
    )
    packed = PackedMedia.of(nn.ModuleDict({"model": Qwen2VLForConditionalGeneration(config)}))
    assert packed is not None and packed.merge == 2
    assert [(k.pixels, k.grid, k.token) for k in packed.kinds] == [
        ("pixel_values", "image_grid_thw", 90), ("pixel_values", None, 90),
        ("pixel_values_videos", "video_grid_thw", 93),
    ]
