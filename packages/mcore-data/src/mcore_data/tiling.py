"""Image tiling: a large image cut into a grid of tower-sized tiles plus a thumbnail, as NVLM / InternVL do.

numpy only (the pixels are cut by :func:`mcore_data.multimodal_torch.image_tiles`). With :class:`Tiling` of
``max_tiles`` N, an image of width W and height H becomes ``cols x rows`` tiles (``1 <= cols * rows <= N``), the
grid whose aspect ratio ``cols / rows`` is closest to ``W / H`` (:func:`tile_grid`); the image is resized to
``cols * S x rows * S`` and cut into S x S tiles, row-major (left to right, then top to bottom). When it is cut into
more than one tile and ``thumbnail`` is on, the whole image resized to S x S follows as one more tile. Every tile is
one image to the vision tower: ``image_tokens`` image tokens in the prompt.

With ``tags`` on, each tile's image tokens are preceded by a text tag, as NVLM-D's tile tags: ``<tile_1>`` ...
``<tile_k>`` for the grid and ``<tile_global_thumbnail>`` for the thumbnail (:func:`tile_tags`); the tags are plain
text for the tokenizer. ``max_tiles=1`` (the default) is no tiling: one image, one tile, no tag.
"""

from __future__ import annotations

from dataclasses import dataclass

from mcore_data.errors import ConfigError

__all__ = ["THUMBNAIL_TAG", "Tiling", "num_tiles", "tile_grid", "tile_tags"]

THUMBNAIL_TAG = "<tile_global_thumbnail>"


@dataclass(frozen=True)
class Tiling:
    """How images are tiled (plain values: the serving front end gets it across processes)."""

    max_tiles: int = 1
    """Most grid tiles per image (the thumbnail not counted); 1: no tiling, the whole image resized to one tile."""
    thumbnail: bool = True
    """Add the whole image as one more tile when it is cut into more than one."""
    tags: bool = True
    """A text tag before each tile's image tokens (``<tile_1>``, ..., ``<tile_global_thumbnail>``); only when tiling."""

    def __post_init__(self) -> None:
        if not isinstance(self.max_tiles, int) or isinstance(self.max_tiles, bool) or self.max_tiles < 1:
            raise ConfigError(f"max_tiles must be an integer >= 1 (1: no tiling), got {self.max_tiles!r}")

    @property
    def enabled(self) -> bool:
        return self.max_tiles > 1

    @property
    def most_tiles(self) -> int:
        """Most tiles one image can become (the thumbnail counted)."""
        return self.max_tiles + int(self.enabled and self.thumbnail)


def tile_grid(width: int, height: int, max_tiles: int, tile_size: int) -> tuple[int, int]:
    """``(cols, rows)`` with ``1 <= cols * rows <= max_tiles`` whose ratio ``cols / rows`` is closest to
    ``width / height``. Grids are tried by tile count, then by columns; a later grid as close as the best so far
    replaces it only when the image has more than half the pixels of its tiles (``0.5 * tile_size**2 * cols *
    rows``), so a small image is not blown up into many tiles."""
    if width < 1 or height < 1:
        raise ConfigError(f"an image needs a positive size, got {width} x {height}")
    aspect = width / height
    grids = sorted(((c, r) for c in range(1, max_tiles + 1) for r in range(1, max_tiles // c + 1)),
                   key=lambda g: (g[0] * g[1], g[0]))  # fmt: skip
    best, best_diff = grids[0], abs(aspect - 1.0)
    for cols, rows in grids[1:]:
        diff = abs(aspect - cols / rows)
        if diff < best_diff:
            best, best_diff = (cols, rows), diff
        elif diff == best_diff and width * height > 0.5 * tile_size * tile_size * cols * rows:
            best = (cols, rows)
    return best


def num_tiles(width: int, height: int, tiling: Tiling, tile_size: int) -> int:
    """How many tiles (the thumbnail counted) an image of ``width x height`` becomes for a tower of
    ``tile_size x tile_size`` pixels."""
    if not tiling.enabled:
        return 1
    cols, rows = tile_grid(width, height, tiling.max_tiles, tile_size)
    n = cols * rows
    return n + int(n > 1 and tiling.thumbnail)


def tile_tags(count: int, tiling: Tiling) -> list[str]:
    """The text tag before each of an image's ``count`` tiles ('' for none): ``<tile_1>`` ... and
    ``<tile_global_thumbnail>`` for the thumbnail (the last tile when ``count > 1`` and ``thumbnail``)."""
    if not (tiling.enabled and tiling.tags):
        return [""] * count
    grid = count - 1 if count > 1 and tiling.thumbnail else count
    return [f"<tile_{i + 1}>" for i in range(grid)] + [THUMBNAIL_TAG] * (count - grid)
