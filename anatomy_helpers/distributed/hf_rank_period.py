"""What a data-parallel rank of a Hugging Face fine-tune must satisfy for its step to repeat layer by layer, beyond
what :func:`~anatomy_helpers.prediction.periodic.periodic_trace`'s checks see in dry runs of 3, 4 and 5 layers:
each returns why not (None: it does). distributed/hf_fit.py's ``periodic_dry_run_hf_rank`` asks them.

* ZeRO-1 (:func:`zero1_share`): ZeroRedundancyOptimizer gives each rank whole parameters, largest first to the
  rank holding the fewest elements (:func:`~anatomy_helpers.distributed.fake_world.zero1_partition`), so which of a
  layer's parameters a rank updates can change with the depth (a large embedding on one rank until the layers
  behind it outweigh it). The partition is computed from the model's shapes at 3, 4, 5 layers and the full depth
  (built on the meta device) and must give the rank the same parameters of every layer in between, of the first
  and of the last layer, and outside the layers, at every depth.
* DDP's gradient buckets (:func:`ddp_buckets`, ZeRO stages 0 and 1): a bucket closes once it holds its cap's bytes
  (torch's first bucket 1 MiB, then ``bucket_cap_mb``), so a bucket that grows with the depth may be split in two
  at the full depth where no shallow run shows it. Trusted: buckets that do not grow (their sizes at 4 and 5 layers
  and at the full depth all seen at 3), or, where one grows, every bucket below the smallest cap at the full depth
  (then none closed for its size, at any depth).
"""

from __future__ import annotations

import re

import torch
import torch.distributed as dist

from ..prediction.hf_fixes import layers_of
from ..prediction.hf_step import FineTune, make_hf_model
from ..prediction.periodic import DEPTHS
from ..tracking.events import CATEGORIES
from ..tracking.trace import Trace
from .fake_world import zero1_partition

COMMUNICATION = CATEGORIES.index("communication")


def _share(cfg, ft: FineTune, depth: int, world_size: int, rank: int, word: str) -> tuple:
    """The trained parameters ZeRO-1 gives ``rank`` at ``depth`` layers, by place: (outside the layers, the first
    layer's, the last layer's, the set of each layer's in between), each parameter named within its layer."""
    with torch.device("meta"):
        model = make_hf_model(layers_of(cfg, depth), ft)
    trains = [(n, p) for n, p in model.named_parameters() if p.requires_grad]  # as ranks.run_job's optimizer
    layer = re.compile(rf"(^|\.){re.escape(word)}\.(\d+)\.")
    outside, per_layer = set(), [set() for _ in range(depth)]
    for i in zero1_partition([p.numel() for _, p in trains], world_size)[rank]:
        name = trains[i][0]
        match = layer.search(name)
        if match is None:
            outside.add(name)
        else:
            per_layer[int(match.group(2))].add(name[match.end() :])
    between = frozenset(frozenset(s) for s in per_layer[1:-1])
    return frozenset(outside), frozenset(per_layer[0]), frozenset(per_layer[-1]), between


def zero1_share(cfg, ft: FineTune, world_size: int, rank: int, path: str) -> str | None:
    """Why rank ``rank``'s ZeRO-1 share of the trained parameters does not repeat layer by layer (None: it does);
    ``path``: the model's list of layers (prediction/hf_periodic.block_list)."""
    word = path.rsplit(".", 1)[-1]
    shares = {d: _share(cfg, ft, d, world_size, rank, word) for d in (*DEPTHS, cfg.num_hidden_layers)}
    if all(len(s[3]) <= 1 for s in shares.values()) and len(set(shares.values())) == 1:
        return None
    return (
        f"ZeRO-1's partition (largest parameter first, to the rank holding the fewest elements) gives rank {rank} "
        "other parameters of the layers at other depths"
    )


def ddp_buckets(traces: list[Trace]) -> str | None:
    """Why DDP's gradient buckets in ``traces`` (the rank's Traces at 3, 4 and 5 layers, then the built one at full
    depth) may be cut otherwise at the full depth (None: they cannot)."""

    def buckets(tr: Trace) -> list[int]:  # communication storages alive before the step: DDP's buckets
        alive = tr.alloc_category[tr.baseline_ids] == COMMUNICATION
        return [int(b) for b in tr.baseline_bytes[alive]]

    sizes = [buckets(tr) for tr in traces]
    if all(set(s) <= set(sizes[0]) for s in sizes[1:]):
        return None
    cap = dist._DEFAULT_FIRST_BUCKET_BYTES  # torch's smallest cap (its first bucket's)
    if max(sizes[-1], default=0) < cap:
        return None
    return (
        f"a DDP gradient bucket grows with the depth to {max(sizes[-1]):,} bytes, past torch's first bucket cap of "
        f"{cap:,}: the full depth may cut its buckets otherwise"
    )
