"""Images and videos packed over a batch, cut by the batch's rows.

[Note: packed vision inputs]
Qwen2-VL and its kin (Qwen2.5-VL, Qwen3-VL, GLM-4V, ...) take a batch's images packed: ``pixel_values`` holds every
image's patches one image after the other (``[patches of all images, channels * patch volume]``), and
``image_grid_thw`` one row ``(t, h, w)`` per image; videos alike (``pixel_values_videos``, ``video_grid_thw``, and
Qwen2.5-VL's ``second_per_grid_ts``, one per video). No first dimension of theirs is the batch's rows, so cut by rows
(:func:`~lightning_pipe._calls.batch.slice_batch`) they would reach every microbatch whole, and a microbatch's image
tokens would meet all the batch's images. Their layout says how to cut them instead: image ``j`` has ``t * h * w``
patches and ``t * h * w / merge**2`` placeholder tokens in ``input_ids`` (the model's ``image_token_id``; ``merge``
its ``vision_config.spatial_merge_size``), and the model fills the placeholders with the images in order, row by row.
So rows ``start:stop`` of the batch hold the images whose placeholders lie in those rows: a run of consecutive images,
of their patches and of their grid rows, which :meth:`PackedMedia.cut` gives the microbatch.

LLaVA, Gemma 3 (its pan-and-scan crops) and InternVL (its tiles) pack a batch's images alike, one image, crop or tile
per row of ``pixel_values`` (``[items, channels, height, width]``) with as many placeholders each, ``image_sizes``
with them: cut the same way, also where there are as many images as rows (rows of 0, 1 and 2 images). Where images
differ in their placeholders (Pixtral's sizes), the rows' placeholders rarely add up to whole images; where they do
by chance, the model's own check that its image features fill its placeholders refuses what is not the images of
those rows. ``pixel_values`` of a row per sample (Idefics3's and Mllama's ``[batch, images, ...]``) is cut by rows.
A batch whose tensors do not add up so (an image's placeholders split over two rows, patches that are not the
grids' sum) is left as it is; the first microbatch's check then names the tensors it cannot cut
(``_step/microbatch_rows.py``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import Tensor, nn


@dataclass(frozen=True)
class _Kind:
    """One kind of packed media: its pixels' key, its grid's (None: every item has as many placeholders), its
    placeholder token, and the keys with a row per item."""

    pixels: str
    grid: Optional[str]
    token: int
    per_item: tuple[str, ...] = ()


@dataclass(frozen=True)
class PackedMedia:
    """How a model takes packed media (see [Note: packed vision inputs]): the spatial merge (None: none) and the
    kinds."""

    merge: Optional[int]
    kinds: tuple[_Kind, ...]

    @classmethod
    def of(cls, module: nn.Module) -> Optional[PackedMedia]:
        """The packed media of the outermost model in ``module`` whose config has a vision config and names an image
        token, if any."""
        for sub in module.modules():
            config = getattr(sub, "config", None)
            vision = getattr(config, "vision_config", None)
            image = _token(config, "image")
            if vision is None or image is None:
                continue
            merge = getattr(vision, "spatial_merge_size", None)
            merge = merge if isinstance(merge, int) else None
            kinds = [_Kind("pixel_values", None, image, ("image_sizes",))]
            video = _token(config, "video")
            if merge is not None:
                kinds.insert(0, _Kind("pixel_values", "image_grid_thw", image))
                if video is not None:
                    kinds.append(_Kind("pixel_values_videos", "video_grid_thw", video, ("second_per_grid_ts",)))
            return cls(merge, tuple(kinds))
        return None

    def cut(self, batch: Mapping, part: Mapping, start: int, stop: int) -> Mapping:
        """``part`` (``batch``'s rows ``start:stop`` as :func:`slice_batch` cut them) with the packed media of those
        rows in place of the whole batch's."""
        ids = batch.get("input_ids")
        if not isinstance(ids, Tensor) or ids.dim() != 2:
            return part
        cut: dict[str, Any] = {}
        for kind in self.kinds:
            pixels = batch.get(kind.pixels)
            if kind.pixels in cut or not isinstance(pixels, Tensor) or pixels.dim() == 0:
                continue
            if kind.grid is None:
                span = self._uniform_items(ids, pixels, token=kind.token, rows=(start, stop))
                count = pixels.shape[0]
            else:
                grid = batch.get(kind.grid)
                if not isinstance(grid, Tensor) or grid.dim() != 2:
                    continue
                span = self._items_of(ids, grid, pixels, token=kind.token, rows=(start, stop))
                count = grid.shape[0]
                if span is not None:
                    cut[kind.grid] = grid[span[0][0]:span[0][1]].clone()
            if span is None:
                continue
            (first, last), (p0, p1) = span
            cut[kind.pixels] = pixels[p0:p1].clone()
            for key in kind.per_item:
                value = batch.get(key)
                if isinstance(value, Tensor) and value.dim() > 0 and value.shape[0] == count:
                    cut[key] = value[first:last].clone()
        if not cut:
            return part
        items = {**part, **cut}
        if isinstance(part, dict):
            return type(part)(items.items())
        try:
            return type(part)(items)  # type: ignore[call-arg]
        except Exception:
            return items

    def _items_of(
        self, ids: Tensor, grid: Tensor, pixels: Tensor, *, token: int, rows: tuple[int, int]
    ) -> Optional[tuple[tuple[int, int], tuple[int, int]]]:
        """The items (images or videos) and the pixel rows of the batch's rows ``rows`` (``start, stop``) with a grid
        per item; None when the batch is not packed as [Note: packed vision inputs] says."""
        assert self.merge is not None
        patches = grid.prod(-1).to(torch.long).cpu()
        if int(patches.sum()) != pixels.shape[0]:
            return None
        span = _span(patches // (self.merge * self.merge), ids, token, rows)
        if span is None:
            return None
        pixel_ends = torch.cat([patches.new_zeros(1), patches.cumsum(0)])
        return span, (int(pixel_ends[span[0]]), int(pixel_ends[span[1]]))

    def _uniform_items(
        self, ids: Tensor, pixels: Tensor, *, token: int, rows: tuple[int, int]
    ) -> Optional[tuple[tuple[int, int], tuple[int, int]]]:
        """The items and pixel rows of the batch's rows ``rows`` where every item (a row of ``pixels``: an image, a
        crop, a tile, ``[items, channels, height, width]``) has as many placeholders; None when the placeholders do
        not add up so, or ``pixels`` is laid out otherwise (a row per sample: ``[batch, images, ...]``)."""
        items, placeholders = pixels.shape[0], int((ids == token).sum())
        if pixels.dim() != 4 or not placeholders or placeholders % items:
            return None
        span = _span(torch.full((items,), placeholders // items, dtype=torch.long), ids, token, rows)
        return None if span is None else (span, span)


def _span(tokens: Tensor, ids: Tensor, token: int, rows: tuple[int, int]) -> Optional[tuple[int, int]]:
    """The items whose placeholders (``tokens[j]`` for item ``j``, filled in order, row by row) lie in the rows
    ``rows`` of ``ids``; None when they do not add up to the rows' placeholders or one lies over a boundary."""
    start, stop = rows
    per_row = (ids == token).sum(-1).cpu()
    before, through = int(per_row[:start].sum()), int(per_row[:stop].sum())
    ends = torch.cat([tokens.new_zeros(1), tokens.cumsum(0)])  # placeholders before each item, and in all
    if int(ends[-1]) != int(per_row.sum()):
        return None
    first, last = int(torch.searchsorted(ends, before)), int(torch.searchsorted(ends, through))
    if int(ends[first]) != before or int(ends[last]) != through:  # an item's placeholders over two rows' parts
        return None
    return first, last


def _token(config: Any, kind: str) -> Optional[int]:
    for name in (f"{kind}_token_id", f"{kind}_token_index"):
        value = getattr(config, name, None)
        if isinstance(value, int):
            return value
    return None
