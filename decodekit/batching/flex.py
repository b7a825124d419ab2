"""Decode rows' attention over the paged cache through FlexAttention (torch.nn.attention.flex_attention): the
compiled step's route where the keys and values are read in place by one fused kernel, instead of each row's blocks
being gathered into a dense tensor first (paged.decode_attention).

The pools are flex's keys and values as they are ([slots, KV, D] seen as [1, KV, slots, D]); each decode row is one
query of a batch of rows, and its block table becomes its row of a block mask whose key blocks are the cache's
blocks (the mask's key block size is the cache's block size). Of the blocks a row sees, those wholly inside what it
attends are "full" (no mask evaluated on them in the fused kernel); the first and the last it sees are "partial",
where the mask reads each slot's position in the row. Only a compiled step runs it: called eagerly, flex attention
computes a score for every slot of the pool.
"""

from __future__ import annotations

import inspect

import torch

Q_BLOCK = 128  # the mask's query block: one per row (of one query), a multiple of every kernel's query tile
KEY_TILES = (64, 32, 16)  # the fused kernel's key tiles that fit a cache block (a tile must divide the mask's block)


def key_tile(block_size: int) -> int | None:
    """The largest key tile of KEY_TILES that divides `block_size` (the GPU kernel's BLOCK_N), None where none does:
    the fused kernel's defaults (64 or 128 keys a tile) divide no cache block of 16."""
    return next((tile for tile in KEY_TILES if block_size % tile == 0), None)


def available() -> str | None:
    """None where this torch has what the route needs, else why not."""
    try:
        from torch.nn.attention.flex_attention import BlockMask
    except ImportError:
        return f"torch {torch.__version__} has no torch.nn.attention.flex_attention (2.5 added it)"
    if "compute_q_blocks" not in inspect.signature(BlockMask.from_kv_blocks).parameters:
        return f"torch {torch.__version__}'s BlockMask.from_kv_blocks takes no compute_q_blocks (2.6 added it)"
    return None


def paged_block_mask(tables, owner, positions, block_size: int, pool_blocks: int, window):
    """The BlockMask of decode rows over the pool: query row i (of table row owner[i], at positions[i]) sees the
    slots of positions max(0, position - window + 1)..position of its row."""
    from torch.nn.attention.flex_attention import BlockMask

    rows = tables.index_select(0, owner)  # [N, width]: the blocks of each query's row, in order
    n, width = rows.shape
    low = (positions - window + 1).clamp(min=0) if window else torch.zeros_like(positions)
    first, last = low // block_size, positions // block_size  # the first and last blocks the row sees
    col = torch.arange(width, device=rows.device)
    seen = (col >= first[:, None]) & (col <= last[:, None])
    # Each pool block's place in the row (-1: not the row's, or not seen), for the mask: column pool_blocks takes the
    # blocks not seen, so that padding entries of the table (block 0, the scratch block) cannot overwrite a real one.
    place = torch.full((n, pool_blocks + 1), -1, dtype=torch.int32, device=rows.device)
    place.scatter_(1, torch.where(seen, rows, pool_blocks), col.to(torch.int32).expand(n, width).contiguous())

    def mask_mod(b, h, q, kv):
        at = place[b, kv // block_size]
        position = at * block_size + kv % block_size
        seen = (at >= 0) & (position <= positions[b])
        return seen & (position > positions[b] - window) if window else seen

    def indices(columns):
        # kv_indices as flex's lowering wants them: as many columns as the pool has blocks.
        out = torch.zeros((n, 1, 1, pool_blocks), dtype=torch.int32, device=rows.device)
        out[:, 0, 0, : columns.shape[1]] = rows.gather(1, columns.clamp(0, width - 1)).to(torch.int32)
        return out

    partial = torch.stack((first, last), 1)  # one block where first == last
    inner = first[:, None] + 1 + col  # the full blocks: first + 1 .. last - 1
    return BlockMask.from_kv_blocks(
        (1 + (last > first)).to(torch.int32)[:, None, None],
        indices(partial),
        (last - first - 1).clamp(min=0).to(torch.int32)[:, None, None],
        indices(inner),
        BLOCK_SIZE=(Q_BLOCK, block_size),
        mask_mod=mask_mod,
        seq_lengths=(1, pool_blocks * block_size),
        compute_q_blocks=False,
    )


def flex_decode_attention(
    tokens, k, v, keys, values, slots, tables, owner, positions, block_size: int, window, mask=None
):
    """paged.decode_attention's contract through flex attention: each token's key and value written at its slot,
    then its query [N, H, D] attends its row's positions (within `window`; 0 or None: none). Returns [N, H, D].
    `mask`: paged_block_mask's for these rows and window, where the caller made it once for every layer."""
    from torch.nn.attention.flex_attention import flex_attention

    keys.index_copy_(0, slots, k)
    values.index_copy_(0, slots, v)
    if mask is None:
        mask = paged_block_mask(tables, owner, positions, block_size, keys.shape[0] // block_size, window)
    query = tokens.to(keys.dtype)[:, :, None, :]  # [N, H, 1, D]: a batch of rows, one query each
    out = flex_attention(
        query,
        keys.transpose(0, 1)[None],
        values.transpose(0, 1)[None],
        block_mask=mask,
        enable_gqa=keys.shape[1] != tokens.shape[1],
        kernel_options={"BLOCK_N": key_tile(block_size)} if keys.is_cuda else None,
    )
    return out[:, :, 0, :].to(tokens.dtype)
