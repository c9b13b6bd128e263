"""The KV page allocator: ref-counted pages, and the prefix cache over them.

A page holds `page_size` consecutive positions of one request, in the target's pool and the
drafter's alike (one page id names both). Page 0 is the null page (`models.kv_cache.NULL_PAGE`)
and is never handed out.

Prefix caching, as vLLM's: a full page of prompt tokens is keyed by a chained hash (the hash of
the page before it and its own token ids), so equal keys mean equal prefixes and equal K/V. The
hash is a 128-bit BLAKE2b digest, not Python's `hash`: a prompt crafted to collide with another
request's key would be served that request's K/V. A
page whose last user frees it keeps its key and waits in the free list, least recently freed
first; a new request whose prompt starts with cached pages takes them (ref count + 1) instead of
computing them, and an allocation that finds no fresh page evicts the oldest cached one.
"""
from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass

from drafttree.models.kv_cache import NULL_PAGE


@dataclass
class PrefixStats:
    queries: int = 0    # prompt tokens looked up in the prefix cache
    hits: int = 0       # of those, tokens found (their K/V not computed again)

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


def page_keys(ids: list[int], page_size: int, pages: int, known: list[bytes] | None = None) -> list[bytes]:
    """The chained hashes of the first `pages` full pages of ids; `known`: those of its first
    pages, computed before (extended in place, so a growing request hashes each page once)."""
    keys = known if known is not None else []
    parent = keys[-1] if keys else b""
    for p in range(len(keys), pages):
        h = hashlib.blake2b(parent, digest_size=16)
        h.update(array("q", ids[p * page_size:(p + 1) * page_size]).tobytes())
        parent = h.digest()
        keys.append(parent)
    return keys[:pages]


class PagePool:
    def __init__(self, num_pages: int, page_size: int, prefix_caching: bool = True) -> None:
        if num_pages < 2:
            raise ValueError(f"a page pool needs the null page and one more, got {num_pages}")
        self.num_pages, self.page_size, self.prefix_caching = num_pages, page_size, prefix_caching
        self.ref = [0] * num_pages
        self.key: list[bytes | None] = [None] * num_pages
        self.by_key: dict[bytes, int] = {}
        # free pages in allocation order: fresh ones first, then cached ones least recently freed
        self.free_pages: OrderedDict[int, None] = OrderedDict((p, None) for p in range(num_pages) if p != NULL_PAGE)
        self.stats = PrefixStats()

    @property
    def usable(self) -> int:
        """Pages a request may hold (all but the null page)."""
        return self.num_pages - 1

    @property
    def num_free(self) -> int:
        return len(self.free_pages)

    def allocate(self, n: int) -> list[int] | None:
        """n pages, or None (nothing taken) if fewer are free. A cached page taken is evicted."""
        if n > len(self.free_pages):
            return None
        out = []
        for _ in range(n):
            page, _ = self.free_pages.popitem(last=False)
            if self.key[page] is not None:
                del self.by_key[self.key[page]]
                self.key[page] = None
            self.ref[page] = 1
            out.append(page)
        return out

    def free(self, pages: list[int]) -> None:
        """Drop one reference to each page; a page nobody holds becomes free (last page first,
        so that a request's tail is evicted before the prefix others may share)."""
        for page in reversed(pages):
            assert self.ref[page] > 0, f"page {page} freed twice"
            self.ref[page] -= 1
            if self.ref[page] == 0:
                if self.key[page] is None:
                    self.free_pages[page] = None
                    self.free_pages.move_to_end(page, last=False)   # fresh pages are taken first
                else:
                    self.free_pages[page] = None

    def match(self, ids: list[int], limit: int) -> list[int]:
        """Take the cached pages that hold the longest prefix of ids, at most `limit` pages
        (each gains a reference)."""
        if not self.prefix_caching or limit <= 0:
            return []
        out = []
        for key in page_keys(ids, self.page_size, limit):
            page = self.by_key.get(key)
            if page is None:
                break
            if self.ref[page] == 0:
                del self.free_pages[page]
            self.ref[page] += 1
            out.append(page)
        return out

    def register(self, ids: list[int], pages: list[int], first: int, last: int,
                 known: list[bytes] | None = None) -> None:
        """Key pages first..last-1 of a request (full pages of ids, their K/V final) so that later
        requests may share them; `known`: the request's keys so far (`page_keys`). A key already
        held by another page stays with it."""
        if not self.prefix_caching or last <= first:
            return
        keys = page_keys(ids, self.page_size, last, known)
        for p in range(first, last):
            page, key = pages[p], keys[p]
            if self.key[page] is None and key not in self.by_key:
                self.key[page] = key
                self.by_key[key] = page
