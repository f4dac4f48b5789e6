"""Image tiling: the grid rule against a brute-force formulation, tile counts and tags, and the pixels of
``image_tiles`` against crops of the resized image."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from mcore_data.errors import ConfigError
from mcore_data.tiling import THUMBNAIL_TAG, Tiling, num_tiles, tile_grid, tile_tags


def brute_force_grid(width: int, height: int, max_tiles: int, size: int) -> tuple[int, int]:
    """The set formulation of the rule: among every grid of at most ``max_tiles`` tiles, those whose ``cols / rows``
    is closest to the image's aspect; of these (ordered by tile count, then columns) the last one after the first
    whose tiles hold less than twice the image's pixels, else the first."""
    aspect = width / height
    grids = [(c, r) for c in range(1, max_tiles + 1) for r in range(1, max_tiles + 1) if c * r <= max_tiles]
    best = min(abs(aspect - c / r) for c, r in grids)
    tied = sorted((g for g in grids if abs(aspect - g[0] / g[1]) == best), key=lambda g: (g[0] * g[1], g[0]))
    later = [g for g in tied[1:] if width * height > 0.5 * size * size * g[0] * g[1]]
    return later[-1] if later else tied[0]


def test_tile_grid_equals_the_brute_force_rule() -> None:
    sizes = [1, 2, 3, 5, 7, 8, 10, 12, 15, 16, 20, 24, 31, 32, 33, 48, 63, 64, 96, 100, 128, 200, 448, 1000]
    for width, height in itertools.product(sizes, sizes):
        for max_tiles in (1, 2, 3, 4, 6, 9, 12):
            for size in (8, 16, 448):
                got = tile_grid(width, height, max_tiles, size)
                assert got == brute_force_grid(width, height, max_tiles, size), (width, height, max_tiles, size)
                assert 1 <= got[0] * got[1] <= max_tiles


def test_tile_grid_cases() -> None:
    assert tile_grid(32, 16, 4, 16) == (2, 1)  # 2:1
    assert tile_grid(16, 32, 4, 16) == (1, 2)
    assert tile_grid(48, 16, 6, 16) == (3, 1)
    assert tile_grid(100, 10, 4, 16) == (4, 1)  # as wide as the grids go
    # square: (1, 1) and (2, 2) tie; the larger grid only when the image has more than half its pixels
    assert tile_grid(16, 16, 4, 16) == (1, 1)
    assert tile_grid(23, 23, 4, 16) == (2, 2)  # 529 > 0.5 * 256 * 4
    assert tile_grid(22, 22, 4, 16) == (1, 1)  # 484 < 512
    assert tile_grid(1000, 1000, 9, 16) == (3, 3)
    # 2:1 ties with 4:2 (8 tiles): a large image takes the larger grid, a small one keeps (2, 1)
    assert tile_grid(2000, 1000, 8, 16) == (4, 2) and tile_grid(40, 20, 8, 16) == (2, 1)
    assert tile_grid(5, 5, 1, 16) == (1, 1)
    with pytest.raises(ConfigError, match="positive size"):
        tile_grid(0, 5, 4, 16)


def test_num_tiles_and_tags() -> None:
    for width, height in [(16, 16), (32, 16), (48, 16), (100, 10), (1000, 1000), (23, 23)]:
        for max_tiles in (1, 2, 4, 9):
            for thumbnail in (True, False):
                t = Tiling(max_tiles, thumbnail=thumbnail)
                cols, rows = tile_grid(width, height, max_tiles, 16)
                expected = 1 if max_tiles == 1 else cols * rows + int(thumbnail and cols * rows > 1)
                assert num_tiles(width, height, t, 16) == expected
    assert num_tiles(1000, 1000, Tiling(1), 16) == 1  # no tiling: one tile whatever the size
    assert tile_tags(3, Tiling(4)) == ["<tile_1>", "<tile_2>", THUMBNAIL_TAG]
    assert tile_tags(5, Tiling(4)) == ["<tile_1>", "<tile_2>", "<tile_3>", "<tile_4>", THUMBNAIL_TAG]
    assert tile_tags(1, Tiling(4)) == ["<tile_1>"]  # one tile: no thumbnail
    assert tile_tags(2, Tiling(4, thumbnail=False)) == ["<tile_1>", "<tile_2>"]
    assert tile_tags(3, Tiling(4, tags=False)) == ["", "", ""]
    assert tile_tags(1, Tiling()) == [""]  # no tiling, no tag
    assert Tiling(4).most_tiles == 5 and Tiling(4, thumbnail=False).most_tiles == 4 and Tiling().most_tiles == 1
    for bad in (0, -1, 2.0, True):
        with pytest.raises(ConfigError, match="max_tiles"):
            Tiling(bad)  # type: ignore[arg-type]


def _resize(t: object, height: int, width: int) -> object:
    import torch

    assert isinstance(t, torch.Tensor)
    out = torch.nn.functional.interpolate(t[None], size=(height, width), mode="bilinear", antialias=True,
                                          align_corners=False)[0]  # fmt: skip
    return out.clamp(0.0, 1.0)


@pytest.mark.parametrize(("width", "height", "max_tiles"), [(48, 16, 4), (16, 40, 6), (37, 29, 4), (64, 64, 4)])
@pytest.mark.parametrize("thumbnail", [True, False])
def test_image_tiles_are_crops_of_the_resized_image(width: int, height: int, max_tiles: int, thumbnail: bool) -> None:
    torch = pytest.importorskip("torch")
    from mcore_data.multimodal_torch import image_tiles

    size = 16
    px = torch.from_numpy(np.random.default_rng(width * height).random((3, height, width), dtype=np.float32))
    tiling = Tiling(max_tiles, thumbnail=thumbnail)
    tiles = image_tiles(px, size, tiling)
    cols, rows = tile_grid(width, height, max_tiles, size)
    assert tiles.shape == (num_tiles(width, height, tiling, size), 3, size, size) and tiles.is_contiguous()
    big = _resize(px, rows * size, cols * size)
    for r in range(rows):
        for c in range(cols):
            crop = big[:, r * size : (r + 1) * size, c * size : (c + 1) * size]  # type: ignore[index]
            assert torch.equal(tiles[r * cols + c], crop), (r, c)
    if thumbnail and cols * rows > 1:
        assert torch.equal(tiles[-1], _resize(px, size, size))


def test_no_tiling_is_the_plain_resize() -> None:
    torch = pytest.importorskip("torch")
    from mcore_data.multimodal_torch import image_tiles

    px = torch.from_numpy(np.random.default_rng(0).random((3, 30, 50), dtype=np.float32))
    for tiling in (None, Tiling()):
        tiles = image_tiles(px, 16, tiling)
        assert tiles.shape == (1, 3, 16, 16) and torch.equal(tiles[0], _resize(px, 16, 16))
    near_square = px[:, :, :32]  # 32 x 30 on 64 px tiles: a 1 x 1 grid, the plain resize, no thumbnail
    tiles = image_tiles(near_square, 64, Tiling(4))
    assert tiles.shape == (1, 3, 64, 64) and torch.equal(tiles[0], _resize(near_square, 64, 64))
    same = image_tiles(px[:, :16, :16].contiguous(), 16)  # already the tower's size: unchanged
    assert torch.equal(same[0], px[:, :16, :16])
