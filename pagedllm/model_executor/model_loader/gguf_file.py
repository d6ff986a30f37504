"""Opening a GGUF file with gguf-py's reader, fast.

The reader parses the header by slicing its np.memmap one value at a time, and each slice of a memmap builds a new
memmap object (__array_finalize__): about a million for a 49k-token vocabulary and its merges, 3.8-4.3 s of
SmolLM2's 4 s to open on the AMX Xeon. Slicing a plain ndarray view of the same map instead gives the same fields
and the same tensor arrays (views of the map, which the reader keeps) in 1.4 s, and arrays read in one loop (not a
recursion per element) in 0.3 s."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import numpy as np
from gguf import GGUFReader, GGUFValueType


class _Reader(GGUFReader):
    def _plain(self) -> np.ndarray:
        plain = self.__dict__.get("_plain_view")
        if plain is None:
            plain = self._plain_view = self.data.view(np.ndarray)
        return plain

    def _get(self, offset: int, dtype, count: int = 1, override_order: str | None = None) -> np.ndarray:
        count = int(count)
        end = offset + np.dtype(dtype).itemsize * count
        if end > len(self.data):
            raise ValueError(f"truncated: the header needs bytes up to offset {end}, the file ends at {len(self.data)}")
        arr = self._plain()[offset:end].view(dtype=dtype)[:count]
        return arr.view(arr.dtype.newbyteorder(self.byte_order if override_order is None else override_order))

    def _build_tensors(self, start_offs: int, fields: list) -> None:
        """gguf's, after checking that every tensor's bytes are in the file: a cut file otherwise fails
        with a reshape error that names neither the tensor nor what is missing."""
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        for f in fields:
            _, name, _, dims, raw_type, offset = f.parts
            block, size = GGML_QUANT_SIZES[GGMLQuantizationType(int(raw_type[0]))]
            need = int(np.prod([int(d) for d in dims], dtype=np.int64)) * size // block
            start = start_offs + int(offset[0])
            have = max(0, min(need, len(self.data) - start))
            if have < need:
                raise ValueError(f"truncated or corrupt: tensor {bytes(name).decode(errors='replace')!r} needs {need} "
                                 f"bytes at offset {start}, the file holds {have} of them ({need - have} missing)")
        super()._build_tensors(start_offs, fields)

    def _get_field_parts(self, orig_offs: int, raw_type: int) -> tuple:
        """Arrays of strings or numbers in a file of this machine's byte order (a vocabulary, its merges, token
        types) in one loop: the same parts as gguf's element-by-element recursion ((length, bytes) views per
        string, a one-element view per number)."""
        if raw_type != GGUFValueType.ARRAY or self.byte_order != "I":
            return super()._get_field_parts(orig_offs, raw_type)
        itype, alen = self._get(orig_offs, np.uint32), self._get(orig_offs + 4, np.uint64)
        count, offs = int(alen[0]), orig_offs + 12
        scalar = self.gguf_scalar_to_np.get(GGUFValueType(int(itype[0])))
        if scalar is not None:  # numbers (token types): one view, a one-element part per value as gguf makes them
            arr = self._get(offs, scalar, count)
            types = [GGUFValueType.ARRAY] + ([GGUFValueType(int(itype[0]))] if count else [])
            return 12 + int(arr.nbytes), [itype, alen, *(arr[i:i + 1] for i in range(count))], \
                list(range(2, 2 + count)), types
        if itype[0] != GGUFValueType.STRING:
            return super()._get_field_parts(orig_offs, raw_type)
        plain = self._plain()
        raw = memoryview(plain)
        parts: list[np.ndarray] = [itype, alen]
        idxs: list[int] = []
        for _ in range(count):
            n = int.from_bytes(raw[offs:offs + 8], "little")
            if offs + 8 + n > len(plain):
                raise ValueError(f"truncated: the header needs bytes up to offset {offs + 8 + n}, the file ends at "
                                 f"{len(plain)}")
            parts.append(plain[offs:offs + 8].view(np.uint64))
            parts.append(plain[offs + 8:offs + 8 + n])
            idxs.append(len(parts) - 1)
            offs += 8 + n
        types = [GGUFValueType.ARRAY] + ([GGUFValueType.STRING] if idxs else [])
        return offs - orig_offs, parts, idxs, types


def open_gguf(path: str | Path, mode: Literal["r", "c"] = "r") -> GGUFReader:
    """A GGUFReader over the file (mode "c": copy-on-write pages, as the loader maps weights)."""
    return _Reader(str(path), mode)
