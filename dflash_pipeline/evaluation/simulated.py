"""Teacher-forced ("simulated") acceptance length of a drafter on held-out tokenized rows.

The same blocks as in training (anchors where the anchor and its next token are supervised), the
exported drafter, the target's taps of the row itself: tau = 1 + the number of leading block
slots the drafter gets right, averaged over blocks. Training reports the same quantity on its
batches; the parity gate compares this one with the tau of the real decoding loop. For DFlash2 a
slot is right when the selector, teacher-forced, picks the gold token: while every earlier slot
was right that is exactly its greedy walk, so tau is the walk's (not the logits' argmax's).

The rows are the first ``max_rows`` held-out rows (with a supervised block) in the order of the
files given; the evaluate job gives the tokenize stage's per-shard held-out objects
(``outputs/tokenize-NNNNN.heldout.parquet``), which hold exactly those rows of each shard in shard
order, and files are opened one at a time, only until enough rows are found.
"""

from __future__ import annotations

from collections.abc import Iterator

import pyarrow.compute as pc
import pyarrow.parquet as pq
import torch

from dflash_pipeline.data.sharding import HELDOUT
from dflash_pipeline.model.inference import load_drafter
from dflash_pipeline.model.target import load_target, target_embeddings
from dflash_pipeline.model.taps import TargetTaps
from dflash_pipeline.training.blocks import block_loss, block_metrics, blocks_forward, build_blocks, sample_anchors
from dflash_pipeline.training.selector import selector_loss


def _hits(hidden, head, blocks, chunk_rows: int) -> torch.Tensor:
    rows = blocks.supervised.flatten().nonzero().flatten()
    flat = hidden.reshape(-1, hidden.shape[-1])[rows]
    labels = blocks.labels.flatten()[rows]
    hits = torch.zeros(blocks.labels.numel(), dtype=torch.bool, device=hidden.device)
    for start in range(0, len(rows), chunk_rows):
        logits = flat[start : start + chunk_rows] @ head.t().to(flat.dtype)
        hits[rows[start : start + chunk_rows]] = logits.argmax(-1) == labels[start : start + chunk_rows]
    return hits.reshape(blocks.labels.shape)


def _selector_hits(drafter, hidden, head, blocks, chunk_rows: int) -> torch.Tensor:
    selector = drafter.candidate_selector
    base = block_loss(hidden, head, blocks, chunk_rows, top_k=selector.top_k)
    return selector_loss(selector, hidden, head, blocks, base.rows, base.top_ids).hits


def split_rows(paths: list[str], split: str = HELDOUT) -> Iterator[tuple[str, list[int], list[int]]]:
    """(id, input_ids, loss_mask) of the rows of ``split`` in ``paths``, file by file and in file
    order; a file is opened only when the rows before it have been consumed."""
    for path in paths:
        table = pq.read_table(path, columns=["id", "split", "input_ids", "loss_mask"])
        table = table.filter(pc.equal(table["split"], split))
        for i in range(table.num_rows):
            yield table["id"][i].as_py(), table["input_ids"][i].as_py(), table["loss_mask"][i].as_py()


@torch.no_grad()
def simulated_tau(
    drafter_dir: str,
    target_dir: str,
    tokenized_paths: list[str],
    *,
    split: str = HELDOUT,
    max_rows: int = 64,
    num_anchors: int = 512,
    chunk_rows: int = 2048,
    device: str | None = None,
    seed: int = 0,
    target=None,
) -> dict:
    """``target``: the target model, already loaded (the evaluate job shares it with the loop);
    otherwise it is loaded from ``target_dir``."""
    if target is None:
        device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        target = load_target(target_dir, device, torch.bfloat16 if device.startswith("cuda") else torch.float32)
    embed, head = target_embeddings(target)
    device, dtype = embed.device, embed.dtype
    drafter = load_drafter(drafter_dir, device=device, dtype=dtype).eval()
    config = drafter.config
    taps = TargetTaps(target, config.target_layer_ids)
    generator = torch.Generator().manual_seed(seed)
    runs, used = [], []
    for sample_id, row_ids, row_mask in split_rows(tokenized_paths, split):
        if len(used) >= max_rows:
            break  # no further file is opened
        ids = torch.tensor([row_ids], device=device)
        mask = torch.tensor([row_mask], device=device)
        anchors, keep = sample_anchors(mask, num_anchors, generator)
        if not keep.any():
            continue
        blocks = build_blocks(
            ids, mask, anchors, keep, block_size=config.block_size,
            mask_token_id=config.mask_token_id, gamma=7.0,
        )  # fmt: skip
        hidden = blocks_forward(drafter, taps(ids), embed, blocks)
        if drafter.candidate_selector is not None:
            hits = _selector_hits(drafter, hidden, head, blocks, chunk_rows)
        else:
            hits = _hits(hidden, head, blocks, chunk_rows)
        metrics = block_metrics(hits, blocks)
        runs.append((metrics["accept_len"], metrics["blocks"]))
        used.append(sample_id)
    rows_used = len(used)
    blocks_total = sum(n for _, n in runs)
    if not blocks_total:
        raise ValueError(f"no {split} rows with a supervised block in {tokenized_paths}")
    tau = sum(t * n for t, n in runs) / blocks_total
    return {
        "tau": round(tau, 4),
        "blocks": blocks_total,
        "rows": rows_used,
        "split": split,
        "row_ids": used,
        "algorithm": config.algorithm,
    }
