"""Which global layers each pipeline stage (and virtual stage) holds.

Layers are numbered globally from 0. With ``pp`` stages and ``vpp`` virtual stages (model chunks) per rank, the
layers are cut into ``pp * vpp`` equal blocks and chunk ``v`` of rank ``p`` holds block ``v * pp + p``
(Megatron's interleaved assignment), so the forward pass visits rank 0, 1, …, pp-1, then rank 0 again. Without
virtual stages, ``first_stage_layers`` / ``last_stage_layers`` give the first and last stage a different count
(e.g. fewer layers next to the embedding and the output layer) and the rest are split evenly over the middle stages.
A split that does not add up raises ``ValueError`` with the numbers; layers are never dropped silently.
"""

from __future__ import annotations

__all__ = ["stage_layer_range", "stage_layer_counts"]


def stage_layer_counts(
    num_layers: int,
    pp_size: int,
    first_stage_layers: int | None = None,
    last_stage_layers: int | None = None,
) -> list[int]:
    """Number of layers of each pipeline stage (no virtual stages), checked to add up to ``num_layers``."""
    if num_layers < 0 or pp_size < 1:
        raise ValueError(f"num_layers={num_layers} must be >= 0 and pp_size={pp_size} >= 1")
    for name, value in (("first_stage_layers", first_stage_layers), ("last_stage_layers", last_stage_layers)):
        if value is not None and value < 0:
            raise ValueError(f"{name}={value} must be >= 0")
    if first_stage_layers is None and last_stage_layers is None:
        if num_layers % pp_size:
            raise ValueError(
                f"num_layers={num_layers} is not divisible by pp={pp_size}; choose a multiple of {pp_size} or set "
                "first_stage_layers / last_stage_layers to give the outer stages a different count"
            )
        return [num_layers // pp_size] * pp_size
    if pp_size == 1:
        given = first_stage_layers if first_stage_layers is not None else last_stage_layers
        if given != num_layers or (first_stage_layers is not None and last_stage_layers is not None and
                                   first_stage_layers != last_stage_layers):  # fmt: skip
            raise ValueError(
                f"with pp=1 the only stage holds all num_layers={num_layers} layers, but first_stage_layers="
                f"{first_stage_layers} and last_stage_layers={last_stage_layers}; leave them unset"
            )
        return [num_layers]
    first = first_stage_layers
    last = last_stage_layers
    middle_stages = pp_size - (first is not None) - (last is not None)
    rest = num_layers - (first or 0) - (last or 0)
    if rest < 0 or (middle_stages == 0 and rest != 0):
        raise ValueError(
            f"first_stage_layers={first} + last_stage_layers={last} do not add up to num_layers={num_layers} "
            f"over pp={pp_size} stages ({rest} layers left for {middle_stages} other stages)"
        )
    if middle_stages and rest % middle_stages:
        raise ValueError(
            f"the {rest} layers left after first_stage_layers={first} and last_stage_layers={last} do not divide "
            f"evenly over the {middle_stages} other stages (num_layers={num_layers}, pp={pp_size}); adjust the counts"
        )
    per = rest // middle_stages if middle_stages else 0
    counts = [per] * pp_size
    if first is not None:
        counts[0] = first
    if last is not None:
        counts[-1] = last
    return counts


def stage_layer_range(
    num_layers: int,
    pp_size: int,
    pp_rank: int,
    vpp_size: int = 1,
    vpp_rank: int = 0,
    first_stage_layers: int | None = None,
    last_stage_layers: int | None = None,
) -> range:
    """Global layer numbers held by chunk ``vpp_rank`` of pipeline rank ``pp_rank``."""
    if not 0 <= pp_rank < pp_size:
        raise ValueError(f"pp_rank={pp_rank} must be in [0, pp_size={pp_size})")
    if vpp_size < 1 or not 0 <= vpp_rank < vpp_size:
        raise ValueError(f"vpp_rank={vpp_rank} must be in [0, vpp_size={vpp_size}) and vpp_size >= 1")
    if vpp_size > 1:
        if first_stage_layers is not None or last_stage_layers is not None:
            raise ValueError(
                f"first_stage_layers={first_stage_layers} / last_stage_layers={last_stage_layers} are not supported "
                f"with virtual pipeline stages (vpp={vpp_size}); use an even split"
            )
        blocks = pp_size * vpp_size
        if num_layers % blocks:
            raise ValueError(
                f"num_layers={num_layers} is not divisible by pp*vpp = {pp_size}*{vpp_size} = {blocks}; "
                f"the interleaved schedule needs a multiple of {blocks} layers"
            )
        per = num_layers // blocks
        start = (vpp_rank * pp_size + pp_rank) * per
        return range(start, start + per)
    counts = stage_layer_counts(num_layers, pp_size, first_stage_layers, last_stage_layers)
    start = sum(counts[:pp_rank])
    return range(start, start + counts[pp_rank])
