"""The KV cache's pages: which are free, which sequences hold, and which hold a prefix of ids
that a later sequence may reuse (prefix caching).

A page is free, held (by one or more sequences: a reference count), or cached: held by none but
registered under the hash of its ids and of every id before it (`page_hash`), so a sequence
whose ids start the same takes it instead of computing it again (`lookup`). A cached page is
given to a new use only when no free page is left, the least recently released first."""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence


def page_hash(parent: bytes, ids: Sequence[int]) -> bytes:
    """The key of a page holding `ids` after the page keyed `parent` (b"" for the first): a
    digest of both, so equal keys mean equal ids from position 0."""
    h = hashlib.blake2b(parent, digest_size=16)
    h.update(b"".join(int(i).to_bytes(4, "little", signed=True) for i in ids))
    return h.digest()


class PagePool:
    def __init__(self, pages: int) -> None:
        self.pages = pages
        self._free = list(range(pages - 1, -1, -1))  # holding nothing to reuse
        self._refs = [0] * pages
        self._key_of: dict[int, bytes] = {}  # registered pages
        self._page_of: dict[bytes, int] = {}
        self._cached: OrderedDict[int, None] = OrderedDict()  # held by none, oldest first
        self.reused = 0  # pages taken from the cache (lookups)
        self.evicted = 0  # cached pages given to a new use

    @property
    def free(self) -> int:
        """Pages a sequence may take: the free ones and the cached ones."""
        return len(self._free) + len(self._cached)

    @property
    def cached(self) -> int:
        return len(self._cached)

    def refs(self, page: int) -> int:
        return self._refs[page]

    def take(self, n: int) -> list[int] | None:
        """n pages to write, or None (and nothing taken) if fewer are free; cached pages are
        evicted once no free one is left, the least recently released first."""
        if n > self.free:
            return None
        k = min(n, len(self._free))
        taken = self._free[len(self._free) - k :][::-1]
        del self._free[len(self._free) - k :]
        while len(taken) < n:
            page, _ = self._cached.popitem(last=False)
            del self._page_of[self._key_of.pop(page)]
            self.evicted += 1
            taken.append(page)
        for p in taken:
            self._refs[p] = 1
        return taken

    def give(self, pages: Sequence[int]) -> None:
        """A sequence is done with `pages` (its own order): each is free again, or cached where
        it is registered, once no sequence holds it. The later pages of a sequence are
        released first, so they are evicted first: a shorter prefix stays longer."""
        for p in reversed(pages):
            self._refs[p] -= 1
            if self._refs[p]:
                continue
            if p in self._key_of:
                self._cached[p] = None
            else:
                self._free.append(p)

    def register(self, page: int, key: bytes) -> None:
        """`page` (held, its 16 positions written) holds the prefix keyed `key`; where another
        page already does, that one stays the cache's."""
        if key in self._page_of or page in self._key_of:
            return
        self._page_of[key] = page
        self._key_of[page] = key

    def lookup(self, keys: Sequence[bytes]) -> list[int]:
        """The pages of the longest run of `keys` (a sequence's leading pages' keys) that are
        cached or held, each taken (its count up)."""
        out: list[int] = []
        for key in keys:
            page = self._page_of.get(key)
            if page is None:
                break
            self._cached.pop(page, None)
            self._refs[page] += 1
            out.append(page)
        self.reused += len(out)
        return out
