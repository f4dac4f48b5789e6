"""Multimodal data: tar shards + manifest, the ``mcore-data multimodal`` CLI, synthetic PNGs, chat tokenization and
the resumable torch dataset."""

from __future__ import annotations

import json
import re
import subprocess
import tarfile
import zlib
from pathlib import Path

import numpy as np
import pytest

from mcore_data import ByteTokenizer
from mcore_data._png import decode_png, encode_png
from mcore_data.chat import apply_chat_template, tokenize_conversation
from mcore_data.cli import main
from mcore_data.errors import ConfigError, ImageDecodeError, IndexFormatError, OutputExistsError
from mcore_data.multimodal import ShardReader, ShardWriter
from mcore_data.multimodal_prep import synthetic_sample, write_synthetic, write_synthetic_folder

IMG = 300  # outside the byte tokenizer's vocabulary (0..258)


def test_writer_reader_round_trip_bytes_offsets_and_tar(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    samples = [(rng.bytes(int(rng.integers(1, 3000))), "jpg" if i % 3 else "png", {"caption": f"c{i} ü"})
               for i in range(11)]  # fmt: skip
    with ShardWriter(tmp_path / "ds", shard_size=4) as w:
        for img, ext, rec in samples:
            w.add(img, ext, rec)
    r = ShardReader(tmp_path / "ds")
    assert len(r) == 11 and r.shard_counts == [4, 4, 3]
    assert r.shard_names == ["ds-000000.tar", "ds-000001.tar", "ds-000002.tar"]
    for i, (img, ext, rec) in enumerate(samples):
        s = r[i]
        assert (s.image, s.image_ext, s.record, s.key) == (img, ext, rec, f"{i:09d}")
    manifest = json.loads((tmp_path / "ds.json").read_text())
    for shard in manifest["shards"]:
        path = tmp_path / shard["name"]
        with tarfile.open(path) as tf:  # standard tar reader: names in order, data at the manifest's offsets
            members = tf.getmembers()
            assert [m.name for m in members] == [f"{e[0]}.{x}" for e in shard["samples"] for x in (e[1][0][0], "json")]
            by_name = {m.name: m for m in members}
        raw = path.read_bytes()
        for key, [[ext, io_, is_]], jo, js in shard["samples"]:
            assert (by_name[f"{key}.{ext}"].offset_data, by_name[f"{key}.{ext}"].size) == (io_, is_)
            assert by_name[f"{key}.json"].offset_data == jo
            assert json.loads(raw[jo : jo + js]) == samples[int(key)][2]
    listing = subprocess.run(["tar", "tf", str(tmp_path / "ds-000002.tar")], capture_output=True, text=True)
    assert listing.stdout.split() == [f"{k:09d}.{x}" for k in (8, 9, 10) for x in (samples[k][1], "json")]
    # shards are reproducible byte for byte
    with ShardWriter(tmp_path / "again", shard_size=4) as w:
        for img, ext, rec in samples:
            w.add(img, ext, rec)
    assert (tmp_path / "again-000001.tar").read_bytes() == (tmp_path / "ds-000001.tar").read_bytes()


def test_several_images_and_none_round_trip(tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    samples = [[(rng.bytes(int(rng.integers(1, 1500))), ("png", "jpg")[int(rng.integers(2))]) for _ in range(n)]
               for n in (2, 0, 1, 3, 2)]  # fmt: skip
    with ShardWriter(tmp_path / "m", shard_size=3) as w:
        for i, images in enumerate(samples):
            assert w.add_images(images, {"caption": f"c{i}"}) == f"{i:09d}"
        assert w.add_images([(b"x", "png")], {"caption": "k"}, key="mine") == "mine"
        for bad, message in [([(b"x", "gif")], "extension"), ([], "without '.'")]:
            with pytest.raises(ValueError, match=message):
                w.add_images(bad, {}, key="a.b" if not bad else None)
    r = ShardReader(tmp_path / "m")
    assert len(r) == 6 and r.version == 2 and [r.num_images(i) for i in range(6)] == [2, 0, 1, 3, 2, 1]
    for i, images in enumerate(samples):
        s = r[i]
        assert (s.images, s.image_exts) == ([d for d, _ in images], [e for _, e in images])
        assert s.record == {"caption": f"c{i}"}
        if images:
            assert (s.image, s.image_ext) == images[0]
    with pytest.raises(ValueError, match="000000001 holds no image"):
        _ = r[1].image
    assert r[5].key == "mine" and r[5].image == b"x"
    stored = {**{f"{i:09d}": [d for d, _ in images] for i, images in enumerate(samples)}, "mine": [b"x"]}
    names = []
    for shard in ("m-000000.tar", "m-000001.tar"):
        with tarfile.open(tmp_path / shard) as tf:  # a standard tar reader: the names, then each image's bytes
            for m in tf.getmembers():
                names.append(m.name)
                key, _, rest = m.name.partition(".")  # webdataset's key: before the first dot
                if rest != "json":
                    j = int(rest.split(".")[0]) if "." in rest else 0
                    assert tf.extractfile(m).read() == stored[key][j], m.name  # type: ignore[union-attr]
    ext = [[x for _, x in images] for images in samples]
    assert names == [f"000000000.0.{ext[0][0]}", f"000000000.1.{ext[0][1]}", "000000000.json", "000000001.json",
                     f"000000002.{ext[2][0]}", "000000002.json",
                     *(f"000000003.{j}.{ext[3][j]}" for j in range(3)), "000000003.json",
                     f"000000004.0.{ext[4][0]}", f"000000004.1.{ext[4][1]}", "000000004.json",
                     "mine.png", "mine.json"]  # fmt: skip
    manifest = json.loads((tmp_path / "m.json").read_text())
    assert manifest["version"] == 2 and manifest["sample_fields"] == ["key", "images", "json_offset", "json_size"]


def test_version_1_manifest_still_reads(tmp_path: Path) -> None:
    """A one-image-per-sample manifest as the first format wrote it: ``[key, ext, off, size, json_off, json_size]``."""
    write_synthetic(tmp_path / "s", 5, shard_size=2)  # one image a sample: the same member names as version 1
    path = tmp_path / "s.json"
    m = json.loads(path.read_text())
    new = ShardReader(tmp_path / "s")
    expected = [new[i] for i in range(5)]
    m["version"] = 1
    m["sample_fields"] = ["key", "image_ext", "image_offset", "image_size", "json_offset", "json_size"]
    for shard in m["shards"]:
        shard["samples"] = [[k, ext, off, size, jo, js] for k, [[ext, off, size]], jo, js in shard["samples"]]
    path.write_text(json.dumps(m))
    old = ShardReader(tmp_path / "s")
    assert old.version == 1 and len(old) == 5 and [old[i] for i in range(5)] == expected
    assert old[3].image == expected[3].images[0] and old[3].image_ext == "png"
    m["version"] = 3
    path.write_text(json.dumps(m))
    with pytest.raises(IndexFormatError, match="version 1 or 2"):
        ShardReader(tmp_path / "s")
    m["version"] = 2  # version 1 entries under version 2
    path.write_text(json.dumps(m))
    with pytest.raises(IndexFormatError, match="sample entry must be"):
        ShardReader(tmp_path / "s")


def test_writer_refuses_to_overwrite(tmp_path: Path) -> None:
    write_synthetic(tmp_path / "s", 5, shard_size=2)
    with pytest.raises(OutputExistsError):
        write_synthetic(tmp_path / "s", 3)
    write_synthetic(tmp_path / "s", 3, overwrite=True)  # the old third shard is removed
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s-000000.tar", "s.json"]
    assert len(ShardReader(tmp_path / "s")) == 3


def test_png_codec_and_synthetic_pixels() -> None:
    px, caption = synthetic_sample(3, size=16, seed=5)
    assert np.array_equal(decode_png(encode_png(px)), px)
    assert caption.endswith("background")
    again, caption2 = synthetic_sample(3, size=16, seed=5)
    assert np.array_equal(again, px) and caption2 == caption
    # the pixels say what the caption says: centre pixel of a shape (not stripes) has the named colour
    from mcore_data.multimodal_prep import _BACKGROUNDS, COLORS

    for i in range(30):
        px, cap = synthetic_sample(i, size=32)
        color, bg = next(w for w in cap.split() if w in COLORS), cap.split()[-2]
        assert tuple(px[0, 0]) in (COLORS[color], _BACKGROUNDS[bg])
        if "stripes" not in cap:
            assert tuple(px[16, 16]) == COLORS[color] and tuple(px[0, 0]) == _BACKGROUNDS[bg]
    # every filter type decodes (a hand-made PNG with Sub/Up/Average/Paeth rows)
    import struct

    img = np.random.default_rng(1).integers(0, 256, (5, 4, 3), dtype=np.uint8)
    rows, prev = [], np.zeros(12, np.int32)
    for y in range(5):
        ft, cur = y % 5, img[y].reshape(-1).astype(np.int32)
        left = np.concatenate([np.zeros(3, np.int32), cur[:-3]])
        upleft = np.concatenate([np.zeros(3, np.int32), prev[:-3]])
        pa, pb, pc = abs(prev - upleft), abs(left - upleft), abs(left + prev - 2 * upleft)
        paeth = np.where((pa <= pb) & (pa <= pc), left, np.where(pb <= pc, prev, upleft))
        pred = [0, left, prev, (left + prev) // 2, paeth][ft]
        rows.append(bytes([ft]) + ((cur - pred) & 0xFF).astype(np.uint8).tobytes())
        prev = cur

    def chunk(k: bytes, d: bytes) -> bytes:
        return struct.pack(">I", len(d)) + k + d + struct.pack(">I", zlib.crc32(k + d))

    png = b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", 4, 5, 8, 2, 0, 0, 0))
    png += chunk(b"IDAT", zlib.compress(b"".join(rows))) + chunk(b"IEND", b"")
    assert np.array_equal(decode_png(png), img)


def test_cli_folder_to_shards(tmp_path: Path) -> None:
    jsonl = write_synthetic_folder(tmp_path / "raw", 7)
    with open(jsonl, "a") as f:
        conv = [{"role": "user", "content": "What is it? <image>"}, {"role": "assistant", "content": "a shape"}]
        f.write(json.dumps({"image": "images/000000.png", "conversations": conv}) + "\n")
    out = tmp_path / "out" / "mm"
    assert main(["multimodal", "--input", str(tmp_path / "raw"), "--output", str(out), "--shard-size", "3",
                 "--no-progress"]) == 0  # fmt: skip
    r = ShardReader(out)
    assert len(r) == 8 and r.shard_counts == [3, 3, 2]
    assert r[0].image == (tmp_path / "raw" / "images" / "000000.png").read_bytes()
    assert r[0].record == {"caption": synthetic_sample(0)[1], "source": "images/000000.png"}
    assert r[7].record["conversations"] == conv
    assert main(["multimodal", "--input", str(jsonl), "--output", str(out), "--no-progress"]) == 2  # exists
    assert main(["multimodal", "--input", str(jsonl), "--output", str(out), "--no-progress", "--overwrite"]) == 0


def test_cli_records_with_image_lists(tmp_path: Path) -> None:
    jsonl = write_synthetic_folder(tmp_path / "raw", 3)
    two = [{"role": "user", "content": "<image> and <image>: the same?"}, {"role": "assistant", "content": "no"}]
    bare = [{"role": "user", "content": "what is it?"}, {"role": "assistant", "content": "a shape"}]
    with open(jsonl, "w") as f:
        f.write(json.dumps({"images": ["images/000002.png", "images/000000.png"], "conversations": two}) + "\n")
        f.write(json.dumps({"images": ["images/000001.png"], "caption": "one", "id": 7}) + "\n")
        f.write(json.dumps({"images": ["images/000001.png"], "conversations": bare}) + "\n")
    out = tmp_path / "mm"
    assert main(["multimodal", "--input", str(jsonl), "--output", str(out), "--no-progress"]) == 0
    r = ShardReader(out)
    raw = [(tmp_path / "raw" / "images" / f"{i:06d}.png").read_bytes() for i in range(3)]
    assert r[0].images == [raw[2], raw[0]] and r[0].image_exts == ["png", "png"]
    assert r[0].record == {"conversations": two, "source": ["images/000002.png", "images/000000.png"]}
    assert r[1].images == [raw[1]] and r[1].record == {"caption": "one", "id": 7, "source": ["images/000001.png"]}
    assert r[2].images == [raw[1]] and r[2].record["conversations"] == bare
    with tarfile.open(tmp_path / "mm-000000.tar") as tf:
        assert tf.getnames()[:4] == ["000000000.0.png", "000000000.1.png", "000000000.json", "000000001.png"]


_TWO = '"images": ["images/000000.png", "images/000001.png"]'


def _conv(user: str) -> str:
    return f'"conversations": [{{"role": "user", "content": "{user}"}}, {{"role": "assistant", "content": "y"}}]'


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ('{"image": "images/000000.png", "caption": "x"', "not valid JSON"),
        ('{"image": "images/000000.png", "images": ["images/000000.png"], "caption": "x"}', "exactly one of 'image'"),
        ('{"caption": "x"}', "exactly one of 'image' (a path relative to the JSONL file) and 'images'"),
        ('{"images": [], "caption": "x"}', "'images' must be a non-empty list"),
        ('{"images": "images/000000.png", "caption": "x"}', "'images' must be a non-empty list"),
        ('{"images": ["images/000000.png", 3], "caption": "x"}', "images[1] must be an image path, not 3"),
        ("{" + _TWO + ', "caption": "x"}', "a caption record takes exactly one image, got 2"),
        ('{"images": ["images/000000.png", "images/nope.png"], ' + _conv("<image><image>") + "}", "nope.png not found"),
        (
            '{"image": "images/000000.png", ' + _conv("<image> <image>") + "}",
            "2 <image> placeholder(s) in the conversation but 1 image(s)",
        ),
        ("{" + _TWO + ", " + _conv("no image here") + "}", "0 <image> placeholder(s) in the conversation but 2"),
        (
            '{"images": ["images/000000.png", "images/000001.png", "images/000000.png"], '
            + _conv("<image><image>")
            + "}",
            "2 <image> placeholder(s) in the conversation but 3 image(s)",
        ),
        ('{"image": "images/missing.png", "caption": "x"}', "missing.png not found"),
        ('{"image": "images/000000.png", "caption": "x", "colour": 1}', "unknown key(s) ['colour']"),
        ('{"image": "images/000000.png"}', "exactly one of 'caption' and 'conversations'"),
        ('{"image": "data.jsonl", "caption": "x"}', "neither PNG nor JPEG"),
        ('{"image": "images/000000.png", "conversations": [{"role": "bot", "content": "x"}]}', "role 'bot'"),
    ],
)
def test_cli_errors_name_the_file_and_line(tmp_path: Path, capsys: pytest.CaptureFixture[str], line: str,
                                           message: str) -> None:  # fmt: skip
    jsonl = write_synthetic_folder(tmp_path / "raw", 2)
    with open(jsonl, "a") as f:
        f.write("\n" + line + "\n")  # a blank line 3 is skipped; the bad record is line 4
    out = tmp_path / "mm"
    assert main(["multimodal", "--input", str(jsonl), "--output", str(out), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert f"{jsonl}:4:" in err and message in err and "Traceback" not in err, err
    assert not list(tmp_path.glob("mm*"))  # nothing written


def _dataset(prefix: Path, **kw: object) -> object:
    from mcore_data.multimodal_torch import MultimodalConfig, MultimodalDataset

    num = kw.pop("num_samples", None)
    kw = {"seq_length": 80, "image_size": 8, **kw}
    cfg = MultimodalConfig(image_token_id=IMG, seed=3, **kw)  # type: ignore[arg-type]
    return MultimodalDataset(prefix, ByteTokenizer(), cfg, num_samples=num)  # type: ignore[arg-type]


def test_chat_template_and_loss_masks() -> None:
    msgs = [{"role": "user", "content": "<image>\nhi"}, {"role": "assistant", "content": "ok"}]
    assert apply_chat_template(msgs) == "<|user|>\n<image>\nhi\n<|assistant|>\nok\n<|assistant|>\n"
    assert apply_chat_template(msgs, add_generation_prompt=False).endswith("ok\n")
    tok = ByteTokenizer()
    t = tokenize_conversation(tok, msgs, image_token_id=IMG, image_tokens=3)
    head = list(b"<|user|>\n")
    assert t.tokens.tolist() == head + [IMG] * 3 + list(b"\nhi\n<|assistant|>\nok\n") + [tok.eod]
    assert t.image_positions.tolist() == [len(head), len(head) + 1, len(head) + 2] and t.num_images == 1
    trained = "".join(chr(x) for x, m in zip(t.tokens.tolist(), t.loss_mask.tolist()) if m and x < 256)
    assert trained == "ok\n" and t.loss_mask[-1] == 1.0
    every = tokenize_conversation(tok, msgs, image_token_id=IMG, loss_on="all")
    assert every.loss_mask[every.image_positions].sum() == 0
    assert every.loss_mask.sum() == len(every.tokens) - 1


def test_dataset_items_and_resize(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    write_synthetic(tmp_path / "s", 6, size=16)
    ds = _dataset(tmp_path / "s", image_size=8)
    item = ds[0]  # type: ignore[index]
    assert item["pixels"].shape == (1, 3, 8, 8) and item["pixels"].dtype == torch.float32
    assert item["num_tiles"].shape == () and int(item["num_tiles"]) == 1
    k = int(item["sample_index"])
    px, caption = synthetic_sample(k, size=16)
    ref = torch.nn.functional.interpolate(torch.from_numpy(px).permute(2, 0, 1)[None].float() / 255, size=(8, 8),
                                          mode="bilinear", antialias=True)  # fmt: skip
    assert torch.allclose(item["pixels"], ref.clamp(0, 1))
    tokens, labels, mask = item["tokens"], item["labels"], item["loss_mask"]
    assert item["image_mask"].dtype == torch.bool and item["image_mask"].shape == (80,)
    assert tokens[item["image_mask"]].tolist() == [IMG] and "image_positions" not in item
    assert torch.equal(tokens[1:], labels[:-1])
    answer = bytes(x for x, m in zip(labels.tolist(), mask.tolist()) if m and x < 256).decode()
    assert answer == caption + "\n" and labels[mask.bool()].tolist()[-1] == ByteTokenizer.eod


WIDE = np.random.default_rng(2).integers(0, 256, (8, 24, 3), dtype=np.uint8)  # 3 x 1 tiles of 8 px + thumbnail
SQUARE = np.random.default_rng(3).integers(0, 256, (16, 16, 3), dtype=np.uint8)  # 2 x 2 + thumbnail
SMALL = np.random.default_rng(4).integers(0, 256, (8, 8, 3), dtype=np.uint8)  # one tile
MEAN, STD = (0.5, 0.4, 0.3), (0.2, 0.25, 0.3)


def _turns(user: str, answer: str = "the first") -> dict[str, object]:
    return {"conversations": [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]}


def _tiled_shards(prefix: Path) -> None:
    """Samples of 2, 0, 1 and 3 images (the one-image one without a placeholder)."""
    png = {k: (encode_png(a), "png") for k, a in {"w": WIDE, "q": SQUARE, "s": SMALL}.items()}
    with ShardWriter(prefix, shard_size=2) as w:
        w.add_images([png["w"], png["q"]], _turns("<image> or <image>?"))
        w.add_images([], _turns("no image", "text only"))
        w.add_images([png["q"]], _turns("which colour?", "many"))
        w.add_images([png["s"], png["w"], png["s"]], _turns("<image>, <image>\nand <image>", "three"))


def _ordered(ds: object, stored: int) -> int:
    """The item that reads stored sample ``stored``."""
    return next(i for i in range(len(ds)) if ds.stored_index(i) == stored)  # type: ignore[arg-type, attr-defined]


def test_items_with_two_tiled_images(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    from mcore_data.multimodal_torch import image_tiles
    from mcore_data.tiling import Tiling, tile_tags

    _tiled_shards(tmp_path / "t")
    tiling = Tiling(4)
    ds = _dataset(tmp_path / "t", image_tokens=2, tiling=tiling, seq_length=200, loss_on="all", mean=MEAN, std=STD)
    item = ds[_ordered(ds, 0)]  # type: ignore[index]
    assert int(item["sample_index"]) == 0 and int(item["num_tiles"]) == 4 + 5
    tokens, mask, loss = item["tokens"], item["image_mask"], item["loss_mask"]
    assert mask.dtype == torch.bool and mask.shape == (200,) and int(mask.sum()) == 9 * 2
    assert torch.equal(mask, tokens == IMG)
    # in order: the user header, each tile's tag then its 2 image tokens, the text between, the answer
    pieces = [("<|user|>\n", "x")]
    for count, after in ((4, " or "), (5, "?\n<|assistant|>\nthe first\n")):
        for tag in tile_tags(count, tiling):
            pieces += [(tag, "t"), ("##", "i")]
        pieces.append((after, "x"))
    assert [t for t, _ in pieces[1:9:2]] == ["<tile_1>", "<tile_2>", "<tile_3>", "<tile_global_thumbnail>"]
    text = "".join(t for t, _ in pieces)
    kind = "".join(k * len(t) for t, k in pieces)
    got = bytes(ord("#") if t == IMG else t for t in tokens[: len(text)].tolist()).decode()
    assert got == text and int(tokens[len(text)]) == ByteTokenizer.eod
    # loss_on="all": every text target has loss 1, never a tag or an image token
    assert loss[: len(text) - 1].tolist() == [float(k == "x") for k in kind[1:]]
    assert loss[len(text) - 1] == 1.0 and loss[len(text) :].sum() == 0  # the EOD, then padding
    # the pixels: decoding + tiling by hand, normalized after tiling
    ref = torch.cat(
        [image_tiles(torch.from_numpy(a).permute(2, 0, 1).float() / 255, 8, tiling) for a in (WIDE, SQUARE)]
    )
    ref = (ref - torch.tensor(MEAN).view(3, 1, 1)) / torch.tensor(STD).view(3, 1, 1)
    assert item["pixels"].shape == (9, 3, 8, 8) and torch.equal(item["pixels"], ref)
    assert torch.equal(ds.pixels(_ordered(ds, 0)), ref)  # type: ignore[attr-defined]
    text_part = ds.text(_ordered(ds, 0))  # type: ignore[attr-defined]
    assert text_part.keys() == {"tokens", "labels", "loss_mask", "image_mask", "num_tiles"}
    assert all(np.array_equal(v, item[k].numpy()) for k, v in text_part.items())
    # no image: no tiles; one image without a placeholder: first in the first user turn
    empty = ds[_ordered(ds, 1)]  # type: ignore[index]
    assert empty["pixels"].shape == (0, 3, 8, 8) and int(empty["num_tiles"]) == 0 and not empty["image_mask"].any()
    one = ds[_ordered(ds, 2)]  # type: ignore[index]
    head = bytes(ord("#") if t == IMG else t for t in one["tokens"][:90].tolist()).decode()
    assert head.startswith("<|user|>\n<tile_1>##<tile_2>##<tile_3>##<tile_4>##<tile_global_thumbnail>##\nwhich colour?")
    # tags off: the image tokens alone; no tiling: one tile an image
    plain = _dataset(tmp_path / "t", image_tokens=2, tiling=Tiling(4, tags=False), seq_length=200)
    item = plain[_ordered(plain, 0)]  # type: ignore[index]
    assert bytes(ord("#") if t == IMG else t for t in item["tokens"][:20].tolist()) == b"<|user|>\n" + b"#" * 8 + b" or"
    assert int(item["image_mask"].sum()) == 18 and item["pixels"].shape == (9, 3, 8, 8)
    untiled = _dataset(tmp_path / "t", image_tokens=2)
    item = untiled[_ordered(untiled, 0)]  # type: ignore[index]
    assert int(item["num_tiles"]) == 2 and int(item["image_mask"].sum()) == 4 and item["pixels"].shape == (2, 3, 8, 8)


def test_collate_concatenates_the_tiles_and_workers_give_the_same_batches(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    from mcore_data.multimodal_torch import build_multimodal_dataloader, collate_multimodal
    from mcore_data.tiling import Tiling

    _tiled_shards(tmp_path / "t")
    ds = _dataset(tmp_path / "t", tiling=Tiling(4), seq_length=160, num_samples=10)
    items = [ds[i] for i in range(3)]  # type: ignore[index]
    batch = collate_multimodal(items)
    assert list(batch) == list(items[0])
    assert torch.equal(batch["pixels"], torch.cat([it["pixels"] for it in items]))
    assert batch["pixels"].shape[0] == int(batch["num_tiles"].sum()) and batch["num_tiles"].shape == (3,)
    for key in ("tokens", "labels", "loss_mask", "image_mask", "position_ids", "sample_index"):
        assert torch.equal(batch[key], torch.stack([it[key] for it in items])), key
    with pytest.raises(ValueError, match="at least one item"):
        collate_multimodal([])
    with pytest.raises(ValueError, match="item 1 has fields"):
        collate_multimodal([items[0], {"tokens": items[1]["tokens"]}])
    serial = list(build_multimodal_dataloader(ds, 2, num_workers=0))  # type: ignore[arg-type]
    parallel = list(build_multimodal_dataloader(ds, 2, num_workers=2))  # type: ignore[arg-type]
    assert len(serial) == len(parallel) == 5
    assert len({int(b["num_tiles"].sum()) for b in serial}) > 1  # batches of different tile counts
    for a, b in zip(serial, parallel):
        assert list(a) == list(b) and all(torch_equal(a[k], b[k]) for k in a)
    second = collate_multimodal([ds[2], ds[3]])  # type: ignore[index]  (a batch is its items, collated)
    assert all(torch_equal(serial[1][k], second[k]) for k in serial[1])


def test_image_count_and_length_errors_name_the_sample(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    from mcore_data.tiling import Tiling

    png = (encode_png(SQUARE), "png")
    with ShardWriter(tmp_path / "e") as w:
        w.add_images([png, png], _turns("just <image>"))
        w.add_images([png, png], {"caption": "two images, one prompt"})
        w.add_images([], {"caption": "no image"})
        w.add_images([png], _turns("<image><image>"))
    ds = _dataset(tmp_path / "e")
    messages = {0: "1 <image> placeholder(s) in the conversation but 2 image(s)",
                1: "1 <image> placeholder(s) in the conversation but 2 image(s)",
                2: "1 <image> placeholder(s) in the conversation but 0 image(s)",
                3: "2 <image> placeholder(s) in the conversation but 1 image(s)"}  # fmt: skip
    for stored, message in messages.items():
        i = _ordered(ds, stored)
        with pytest.raises(ConfigError, match=rf"e-000000\.tar:{stored:09d}: " + re.escape(message)):
            ds[i]  # type: ignore[index]
        with pytest.raises(ConfigError, match=re.escape(message)):
            ds.text(i)  # type: ignore[attr-defined]
    with ShardWriter(tmp_path / "long") as w:
        w.add_images([png], _turns("a long question before the image: <image>"))
    ok = _dataset(tmp_path / "long", tiling=Tiling(4), image_tokens=2, seq_length=160)
    assert int(ok[0]["image_mask"].sum()) == 10  # type: ignore[index]
    short = _dataset(tmp_path / "long", tiling=Tiling(4), image_tokens=2, seq_length=100)
    with pytest.raises(
        ConfigError,
        match=r"long-000000\.tar:000000000: the images need 10 image tokens \(5 tile\(s\) x 2\)"
        r".* past seq_length 100: set a larger data\.seq_length, fewer max_tiles, or the pixel shuffle",
    ):
        short[0]  # type: ignore[index]
    cut = _dataset(tmp_path / "long", tiling=Tiling(4), image_tokens=2, seq_length=110)[0]  # type: ignore[index]
    assert int(cut["image_mask"].sum()) == 10 and ByteTokenizer.eod not in cut["tokens"].tolist()  # the answer cut
    assert int(_dataset(tmp_path / "long", image_tokens=2, seq_length=100)[0]["num_tiles"]) == 1  # type: ignore[index]


def test_order_is_seeded_and_resume_is_bit_exact(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    from mcore_data.multimodal_torch import build_multimodal_dataloader

    write_synthetic(tmp_path / "s", 10, size=12, shard_size=4)
    ds = _dataset(tmp_path / "s", num_samples=24)  # 2.4 epochs
    order = [ds.stored_index(i) for i in range(24)]  # type: ignore[attr-defined]
    assert sorted(order[:10]) == list(range(10)) and order[:10] != order[10:20]
    assert order == [_dataset(tmp_path / "s", num_samples=24).stored_index(i) for i in range(24)]  # type: ignore[attr-defined]
    full = list(build_multimodal_dataloader(ds, 2, num_workers=0))  # type: ignore[arg-type]
    resumed = list(build_multimodal_dataloader(ds, 2, consumed_samples=10, num_workers=2))  # type: ignore[arg-type]
    assert len(full) == 12 and len(resumed) == 7
    for a, b in zip(full[5:], resumed):
        assert a.keys() == b.keys()
        for key in a:
            assert torch_equal(a[key], b[key]), key


def torch_equal(a: object, b: object) -> bool:
    import torch

    assert isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
    return a.dtype == b.dtype and a.shape == b.shape and bool(torch.equal(a, b))


def test_undecodable_image_names_the_sample(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    with ShardWriter(tmp_path / "bad") as w:
        w.add(b"\xff\xd8\xff not really a jpeg", "jpg", {"caption": "x"})
    ds = _dataset(tmp_path / "bad")
    with pytest.raises(ImageDecodeError, match=r"bad-000000\.tar:000000000"):
        ds.pixels(0)  # type: ignore[attr-defined]
    assert ds.text(0)["image_mask"].sum() == 1  # type: ignore[attr-defined]  (one tile: no decoding for the tokens)
    from mcore_data.tiling import Tiling

    with ShardWriter(tmp_path / "bad2") as w:
        w.add_images([(encode_png(SMALL), "png"), (b"\x89PNG\r\n\x1a\n broken", "png")], _turns("<image><image>"))
    tiled = _dataset(tmp_path / "bad2", tiling=Tiling(4))
    with pytest.raises(ImageDecodeError, match=r"bad2-000000\.tar:000000000 image 1: cannot decode"):
        tiled.text(0)  # type: ignore[attr-defined]  (with tiling the tile count needs the image's size)
