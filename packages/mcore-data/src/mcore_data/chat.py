"""The chat format of training and serving, and tokenizing a conversation with its loss mask and image tokens.

The template is the one mcore-infer's server applies (``mcore_infer.protocol.apply_chat_template``): each message
becomes ``<|{role}|>\\n{content}\\n`` and a prompt for generation ends with ``<|assistant|>\\n``; generation stops at
the end-of-document token or at ``<|user|>`` / ``<|system|>``. Training on conversations tokenized here therefore
matches what the server sends: the model learns to answer after ``<|assistant|>\\n`` and to end its answer with EOD.

:func:`tokenize_conversation` encodes the pieces separately (role headers, text between ``<image>`` placeholders,
the closing newline), so the image placeholder becomes exactly the image token id (repeated ``image_tokens``
times) and the loss mask follows the turn boundaries exactly. With a BPE tokenizer, encoding pieces separately can
differ from encoding the joined string at the piece boundaries; the server's prompts are plain text, which is why
the boundaries are newlines, where BPE merges rarely cross.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from mcore_data.errors import ConfigError
from mcore_data.tokenizer import Tokenizer

__all__ = [
    "CHAT_ROLES",
    "CHAT_STOP",
    "IMAGE_PLACEHOLDER",
    "TokenizedConversation",
    "apply_chat_template",
    "caption_conversation",
    "tokenize_conversation",
]

CHAT_ROLES = ("system", "user", "assistant", "tool", "developer")
CHAT_STOP = ["<|user|>", "<|system|>"]
IMAGE_PLACEHOLDER = "<image>"


def _turns(messages: Sequence[dict[str, Any]]) -> list[tuple[str, str]]:
    if not messages:
        raise ConfigError("a conversation needs at least one message")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in CHAT_ROLES:
            raise ConfigError(f"messages[{i}] needs a role in {CHAT_ROLES}")
        content = m.get("content", "")
        if not isinstance(content, str):
            raise ConfigError(f"messages[{i}].content must be a string")
        out.append((m["role"], content))
    return out


def apply_chat_template(messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True) -> str:
    """The prompt text: ``<|role|>\\ncontent\\n`` per message, then ``<|assistant|>\\n`` (for generation)."""
    text = "".join(f"<|{role}|>\n{content}\n" for role, content in _turns(messages))
    return text + ("<|assistant|>\n" if add_generation_prompt else "")


def caption_conversation(caption: str, prompt: str = IMAGE_PLACEHOLDER) -> list[dict[str, str]]:
    """A caption as a two-turn conversation: the user sends ``prompt`` (the image), the assistant the caption."""
    return [{"role": "user", "content": prompt}, {"role": "assistant", "content": caption}]


@dataclass
class TokenizedConversation:
    """Token ids of a whole conversation, the loss mask of each token (1: trained on) and the image token positions."""

    tokens: npt.NDArray[np.int64]
    loss_mask: npt.NDArray[np.float32]
    image_positions: npt.NDArray[np.int64]
    num_images: int = 0
    """Image placeholders."""
    num_tiles: int = 0
    """Images the vision tower sees (with tiling, an image is several tiles; else one per placeholder)."""
    pieces: list[tuple[str, int]] = field(default_factory=list)
    """(text, loss) of each encoded piece, for inspection."""


def tokenize_conversation(
    tokenizer: Tokenizer,
    messages: Sequence[dict[str, Any]],
    *,
    image_token_id: int,
    image_tokens: int = 1,
    loss_on: str = "assistant",
    append_eod: bool = True,
    tiles: Sequence[Sequence[str]] | None = None,
) -> TokenizedConversation:
    """Encode ``messages`` in the chat format; ``<image>`` becomes ``image_tokens`` copies of ``image_token_id``.

    ``loss_on``: ``assistant`` (default: the content and closing newline of assistant turns, and the final EOD), or
    ``all`` (every text token: headers, prompts and answers). Image tokens never carry loss.

    ``tiles``: for each placeholder in order, the text tag of each of its tiles ('' for none; see
    :func:`mcore_data.tiling.tile_tags`): the placeholder becomes, per tile, its tag's tokens (no loss) and
    ``image_tokens`` image tokens. None: one untagged tile per placeholder. A count that differs from the
    placeholders' is a ConfigError.
    """
    if loss_on not in ("assistant", "all"):
        raise ConfigError(f"loss_on must be 'assistant' or 'all', not {loss_on!r}")
    if image_tokens < 1:
        raise ConfigError(f"image_tokens must be >= 1, got {image_tokens}")
    ids: list[int] = []
    mask: list[float] = []
    pieces: list[tuple[str, int]] = []
    positions: list[int] = []
    placeholders = sum(content.count(IMAGE_PLACEHOLDER) for _, content in _turns(messages))
    if tiles is not None and len(tiles) != placeholders:
        raise ConfigError(f"{placeholders} {IMAGE_PLACEHOLDER} placeholder(s) in the conversation but tiles for "
                          f"{len(tiles)} image(s)")  # fmt: skip
    layout = [[""] for _ in range(placeholders)] if tiles is None else [list(t) for t in tiles]
    if any(not t for t in layout):
        raise ConfigError("every image needs at least one tile")
    image = 0

    def add(text: str, loss: bool) -> None:
        if text:
            enc = tokenizer.encode(text)
            ids.extend(enc)
            mask.extend([float(loss)] * len(enc))
            pieces.append((text, int(loss)))

    for role, content in _turns(messages):
        answer = loss_on == "all" or role == "assistant"
        add(f"<|{role}|>\n", loss_on == "all")
        for j, part in enumerate(content.split(IMAGE_PLACEHOLDER)):
            if j:
                for tag in layout[image]:
                    add(tag, False)
                    positions.extend(range(len(ids), len(ids) + image_tokens))
                    ids.extend([image_token_id] * image_tokens)
                    mask.extend([0.0] * image_tokens)
                    pieces.append((IMAGE_PLACEHOLDER, 0))
                image += 1
            add(part, answer)
        add("\n", answer)
    if append_eod:
        ids.append(tokenizer.eod)
        mask.append(1.0)
    return TokenizedConversation(
        tokens=np.asarray(ids, dtype=np.int64),
        loss_mask=np.asarray(mask, dtype=np.float32),
        image_positions=np.asarray(positions, dtype=np.int64),
        num_images=placeholders,
        num_tiles=len(positions) // image_tokens,
        pieces=pieces,
    )
