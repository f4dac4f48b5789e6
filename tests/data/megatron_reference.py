"""An independent, deliberately plain re-implementation of Megatron-LM's GPTDataset index building.

Written from the reference text (``megatron-data-formats.md`` §2.2) with Python loops, to check the vectorised
implementation in ``mcore_data._indices``. Slow; use on small inputs only.
"""

from __future__ import annotations

import math

import numpy as np


def split_bounds(split: str, n: int) -> list[tuple[int, int] | None]:
    import re

    w = [float(x) for x in re.findall(r"[.0-9]+", split)]
    w += [0.0] * (3 - len(w))
    total = sum(w)
    w = [x / total for x in w]
    out: list[tuple[int, int] | None] = []
    acc = 0.0
    for x in w:
        lo, hi = acc, acc + x
        acc = hi
        out.append(None if hi <= lo else (round(lo * n), round(hi * n)))
    return out


def reference_indices(
    sizes: list[int], lo: int, hi: int, seq_len: int, seed: int, num_samples: int | None, drop_last: bool = True
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    indices = list(range(lo, hi))
    tokens_per_epoch = sum(sizes[i] for i in indices)
    # number of epochs
    epochs = 1
    if num_samples is not None:
        while epochs * tokens_per_epoch < num_samples * seq_len + 1:
            epochs += 1
    separate = False
    sans_final = 0
    if epochs > 1:
        assert num_samples is not None
        sans_final = ((epochs - 1) * tokens_per_epoch - 1) // seq_len
        from_final = num_samples - sans_final
        per_epoch = (tokens_per_epoch - 1) // seq_len
        separate = from_final < int(0.80 * per_epoch)
    rs = np.random.RandomState(seed)

    def doc_index(n_epochs: int) -> np.ndarray:
        arr = np.array([d for _ in range(n_epochs) for d in indices], dtype=np.int32)
        rs.shuffle(arr)
        return arr

    if separate:
        doc = np.concatenate((doc_index(epochs - 1), doc_index(1)))
    else:
        doc = doc_index(epochs)
    # build_sample_idx, transcribed loop by loop
    total = epochs * tokens_per_epoch
    if drop_last:
        n = (total - 1) // seq_len
    else:
        n = math.ceil(float(np.float32(total - 1) / np.float32(seq_len)))
    rows = [(0, 0)]
    di, off = 0, 0
    while len(rows) <= n:
        remaining = seq_len + 1
        while remaining != 0:
            length = sizes[doc[di]] - off
            remaining -= length
            if remaining <= 0:
                off += remaining + length - 1
                remaining = 0
            else:
                if di == len(doc) - 1:
                    assert len(rows) == n
                    off = sizes[doc[di]] - 1
                    break
                di += 1
                off = 0
        rows.append((di, off))
    sample = np.array(rows, dtype=np.int32)
    # shuffle index
    size = len(rows) - 1
    first_n = sans_final if separate else size
    first = np.arange(first_n, dtype=np.uint32)
    rs.shuffle(first)
    if first_n == size:
        shuffle = first
    else:
        last = np.arange(first_n, size, dtype=np.uint32)
        rs.shuffle(last)
        shuffle = np.concatenate((first, last))
    return doc, sample, shuffle


def reference_blend(weights: list[float], size: int) -> tuple[list[int], list[int]]:
    counts = [0] * len(weights)
    which, within = [], []
    for i in range(size):
        x = max(float(i), 1.0)
        errors = [w * x - c for w, c in zip(weights, counts)]
        d = errors.index(max(errors))
        which.append(d)
        within.append(counts[d])
        counts[d] += 1
    return which, within
