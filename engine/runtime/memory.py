"""Memory: the paged KV pool, the request-slot pool (`req_to_token`), and a page-granular prefix cache.

Page p of the pool holds token indices p*page_size .. p*page_size+page_size-1. Page 0 is a padding
page that is never handed out (unused rows of `req_to_token` point into it).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict

import torch


def pages_for(tokens: int, page_size: int) -> int:
    """Pages that hold `tokens` tokens: rounded UP everywhere (the design's non-full-page tail
    fix)."""
    return -(-tokens // page_size)


class ReqToTokenPool:
    def __init__(self, num_slots: int, max_context: int, device):
        self.table = torch.zeros((num_slots, max_context), dtype=torch.int32, device=device)
        self._free = list(range(num_slots - 1, -1, -1))
        self.num_slots = num_slots

    def alloc(self) -> int | None:
        return self._free.pop() if self._free else None

    def free(self, slot: int) -> None:
        if slot in self._free:
            raise RuntimeError(f"req_to_token slot {slot} freed twice")
        self._free.append(slot)

    @property
    def available(self) -> int:
        return len(self._free)


class KVPool:
    """K and V for every layer: [layers, num_pages * page_size, kv_heads, head_dim]."""

    def __init__(self, num_pages, page_size, layers, kv_heads, head_dim, dtype, device):
        self.page_size = page_size
        self.num_pages = num_pages
        shape = (layers, num_pages * page_size, kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self._free = list(range(num_pages - 1, 0, -1))  # page 0 reserved
        # allocations that found too few free pages (the caller evicts, postpones or waits)
        self.failed_allocs = 0

    def alloc(self, n: int) -> list[int] | None:
        if n > len(self._free):
            self.failed_allocs += 1
            return None
        out = self._free[-n:][::-1] if n else []
        del self._free[len(self._free) - n :]
        return out

    def free(self, pages) -> None:
        self._free.extend(pages)

    @property
    def available(self) -> int:
        return len(self._free)

    def token_indices(self, pages: list[int], start: int, end: int) -> torch.Tensor:
        """Pool token indices of positions [start, end) of a request whose pages are `pages`."""
        ps = self.page_size
        first = start // ps
        idx = [
            p * ps + o for p in pages[first : -(-end // ps)] for o in range(ps)
        ]  # whole pages, then trim
        off = start - first * ps
        # one tensor from a Python list: cheaper than the same in small torch ops (it runs on the
        # scheduler for every admitted chunk and every KV send)
        idx = idx[off : off + end - start]
        if len(idx) != end - start:
            raise IndexError(
                f"positions [{start}, {end}) need more than the request's {len(pages)} pages"
            )
        return torch.tensor(idx, dtype=torch.int32)


class _Node:
    __slots__ = ("key", "parent", "page", "refs", "children")

    def __init__(self, key, parent, page):
        self.key, self.parent, self.page = key, parent, page
        self.refs = 0
        self.children = 0


class PrefixCache:
    """A hash chain over full pages: page i's key hashes (key of page i-1, tokens of page i).

    Requests lock the nodes they reuse (refs); only unlocked leaves are evicted, least recently used
    first, so a chain is never broken in the middle."""

    def __init__(self, pool: KVPool):
        self.pool = pool
        self.ps = pool.page_size
        self.nodes: OrderedDict[bytes, _Node] = OrderedDict()  # LRU order: oldest first
        self.hits = 0
        self.lookups = 0
        # memory pressure, for the run summary: evict() calls and the pages they freed
        self.evict_calls = 0
        self.evicted_pages = 0

    def _keys(self, tokens: list[int], n_pages: int):
        h = b""
        for i in range(n_pages):
            h = hashlib.blake2b(
                h + repr(tokens[i * self.ps : (i + 1) * self.ps]).encode(), digest_size=16
            ).digest()
            yield h

    def match(self, tokens: list[int], max_tokens: int) -> list[_Node]:
        """Longest cached chain of full pages within the first `max_tokens` tokens."""
        self.lookups += 1
        found = []
        for key in self._keys(tokens, max_tokens // self.ps):
            node = self.nodes.get(key)
            if node is None:
                break
            found.append(node)
        for node in found:
            self.nodes.move_to_end(node.key)
        self.hits += bool(found)
        return found

    @staticmethod
    def lock(nodes) -> None:
        for n in nodes:
            n.refs += 1

    @staticmethod
    def unlock(nodes) -> None:
        for n in nodes:
            if n.refs <= 0:
                raise RuntimeError("prefix cache node unlocked more often than locked")
            n.refs -= 1

    def insert(self, tokens: list[int], pages: list[int]) -> list[int]:
        """Offer a finished request's full pages to the cache. Returns the pages the cache did not
        take (already cached under the same key), which the caller frees."""
        rejected = []
        parent = None
        for i, key in enumerate(self._keys(tokens, len(pages))):
            node = self.nodes.get(key)
            if node is None:
                node = _Node(key, parent, pages[i])
                self.nodes[key] = node
                if parent is not None:
                    parent.children += 1
            else:
                self.nodes.move_to_end(key)
                if node.page != pages[i]:
                    rejected.append(pages[i])
            parent = node
        return rejected

    def evict(self, n_pages: int) -> int:
        """Free up to n_pages pages of unlocked leaves, LRU first. Returns pages freed."""
        self.evict_calls += 1
        freed = 0
        progress = True
        while freed < n_pages and progress:
            progress = False
            for key, node in list(self.nodes.items()):
                if freed >= n_pages:
                    break
                if node.refs == 0 and node.children == 0:
                    del self.nodes[key]
                    if node.parent is not None:
                        node.parent.children -= 1
                    self.pool.free([node.page])
                    freed += 1
                    progress = True
        self.evicted_pages += freed
        return freed

    @property
    def cached_pages(self) -> int:
        return len(self.nodes)

    @property
    def locked_pages(self) -> int:
        return sum(1 for n in self.nodes.values() if n.refs)
