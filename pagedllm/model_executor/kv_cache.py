"""The KV pool of one layer, in the compute dtype or compact (FP8 with scales)."""

from __future__ import annotations

import torch


class KVCache:
    """K and V pools `[num_blocks, block_size, num_kv_heads, head_dim]`."""

    lossy = False
    rotated = False  # the pool holds heads times an orthogonal matrix (kv_quant.IntKVCache.rotate)
    POOLS: tuple[str, ...] = ("k", "v")  # the attributes holding a block's state, indexed by block id first
    # of those, the ones a cache in another shape's pages keeps apart (per-head scales: their bytes do not scale
    # with the head size, so no whole number of them fills another shape's page)
    OWN_POOLS: tuple[str, ...] = ()

    def __init__(self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, compute_dtype: torch.dtype, device: torch.device | str = "cpu") -> None:
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        # zeros, not empty: decode attention reads whole blocks (masking the unused slots), and a
        # never-written slot holding NaN bits would poison the masked softmax
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.compute_dtype = compute_dtype
        self.block_size = block_size
        self.head_dim = head_dim  # (a pool's last dimension may be bytes of blocks: kv_quant.IntKVCache)

    def write(self, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v: [T, KVH, D] written to flat slots [T]."""
        self.k.view(-1, *self.k.shape[2:]).index_copy_(0, slot_mapping, k.to(self.k.dtype))
        self.v.view(-1, *self.v.shape[2:]).index_copy_(0, slot_mapping, v.to(self.v.dtype))

    def op_args(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None,
                               torch.Tensor | None]:
        """(k pool, v pool, k scales, v scales, fp8 decode table) as the C++ attention op reads them."""
        return self.k, self.v, None, None, None

    def gather(self, block_tables: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """block_tables: [B, nb] -> k, v: [B, nb * block_size, KVH, D] in the compute dtype."""
        b, nb = block_tables.shape
        k = self.k[block_tables].view(b, nb * self.block_size, *self.k.shape[2:])
        v = self.v[block_tables].view(b, nb * self.block_size, *self.v.shape[2:])
        return k.to(self.compute_dtype), v.to(self.compute_dtype)

    def pools(self) -> list[torch.Tensor]:
        """Every tensor holding a block's state, indexed by block id first, as bytes (uint8 views): a block
        saved as these and read back into them is the same block (the disk tier)."""
        return [getattr(self, name).view(torch.uint8) for name in self.POOLS]

    def page_parts(self) -> tuple[int, ...]:
        """Bytes of one block in each pool tensor that shares pages (all but OWN_POOLS)."""
        return tuple(getattr(self, n).shape[1:].numel() * getattr(self, n).element_size()
                     for n in self.POOLS if n not in self.OWN_POOLS)

    def share_pages(self, host: KVCache, per_page: int) -> None:
        """Keep this cache's blocks in host's pages, per_page of them a page: block b * per_page + j is part j of
        host's block b, in every pool tensor but OWN_POOLS, which get blocks of their own (page-size
        unification: kv_spec.py). Each tensor keeps its shape past the first dimension, so the kernels read
        this cache as any other."""
        num_blocks = host.k.shape[0] * per_page
        for name in self.POOLS:
            mine = getattr(self, name)
            if name in self.OWN_POOLS:
                setattr(self, name, mine.new_zeros((num_blocks, *mine.shape[1:])))
                continue
            theirs = getattr(host, name).view(torch.uint8)
            page = theirs.shape[1:].numel()
            if mine.shape[1:].numel() * mine.element_size() * per_page != page:
                raise ValueError(f"{name}: {per_page} blocks of {tuple(mine.shape[1:])} {mine.dtype} do not fill a "
                                 f"page of {page} bytes")
            setattr(self, name, theirs.view(-1).view(mine.dtype).view(-1, *mine.shape[1:]))  # [blocks * per_page, ...]

    def copy_own(self, src: int, dst: int) -> None:
        """Copy-on-write of the OWN_POOLS of a cache in another's pages (the host's copy moves the rest)."""
        for name in self.OWN_POOLS:
            t = getattr(self, name)
            t[dst].copy_(t[src])

    @staticmethod
    def own_bytes_per_token(num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        """What OWN_POOLS hold per token: paid apart by a layer in another shape's pages."""
        return 0

    def copy_block(self, src: int, dst: int) -> None:
        self.k[dst].copy_(self.k[src])
        self.v[dst].copy_(self.v[src])

    @staticmethod
    def bytes_per_token(num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_kv_heads * head_dim * torch.tensor([], dtype=dtype).element_size()
