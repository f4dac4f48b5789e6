"""Multimodal data: tar shards + manifest, the ``mcore-data multimodal`` CLI, synthetic PNGs, chat tokenization and
the resumable torch dataset."""

from __future__ import annotations

import json
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
from mcore_data.errors import ImageDecodeError, OutputExistsError
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
            assert [m.name for m in members] == [f"{e[0]}.{x}" for e in shard["samples"] for x in (e[1], "json")]
            by_name = {m.name: m for m in members}
        raw = path.read_bytes()
        for key, ext, io_, is_, jo, js in shard["samples"]:
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


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ('{"image": "images/000000.png", "caption": "x"', "not valid JSON"),
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
    cfg = MultimodalConfig(image_token_id=IMG, seq_length=80, image_size=kw.pop("image_size", 8), seed=3, **kw)  # type: ignore[arg-type]
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
    assert item["pixels"].shape == (3, 8, 8) and item["pixels"].dtype == torch.float32
    k = int(item["sample_index"])
    px, caption = synthetic_sample(k, size=16)
    ref = torch.nn.functional.interpolate(torch.from_numpy(px).permute(2, 0, 1)[None].float() / 255, size=(8, 8),
                                          mode="bilinear", antialias=True)[0]  # fmt: skip
    assert torch.allclose(item["pixels"], ref.clamp(0, 1))
    tokens, labels, mask = item["tokens"], item["labels"], item["loss_mask"]
    assert tokens[item["image_positions"]].tolist() == [IMG]
    assert torch.equal(tokens[1:], labels[:-1])
    answer = bytes(x for x, m in zip(labels.tolist(), mask.tolist()) if m and x < 256).decode()
    assert answer == caption + "\n" and labels[mask.bool()].tolist()[-1] == ByteTokenizer.eod


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
