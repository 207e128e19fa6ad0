"""KV-cache block allocators (vLLM's block manager): paged blocks with a block table per request.

A contiguous allocator is the same object with block_size = max_model_len: each request reserves one
max_model_len slot at admission, and the reserved-but-unused part is the waste paging removes.
"""
from __future__ import annotations

from functools import lru_cache

from sim.policy.decode_set import DecodeSet
from sim.policy.request import Request


@lru_cache(maxsize=2)
def _descending_ids(num_blocks: int) -> tuple[int, ...]:
    """Block ids from the last down to 0, shared by the allocators of one size: a capacity search builds allocators
    of the same size for every probe, and copying the ids takes a tenth of the time of making them."""
    return tuple(range(num_blocks - 1, -1, -1))


class BlockAllocator:
    """Fixed pool of KV blocks; request.block_table lists the physical block ids a request holds."""

    # prefix caching (PrefixCachingAllocator): off here, so its counters read zero
    prefix_caching = False
    queried_tokens = hit_tokens = shared_refs = 0
    hybrid = False  # KV cache groups by attention kind (HybridBlockAllocator)
    window_frees = 0  # its count of blocks freed out of a window
    peak_by_kind: dict | None = None  # its most blocks held at once, by kind

    def __init__(self, num_blocks: int, block_size: int, watermark: float = 0.0, num_swap_blocks: int = 0,
                 contiguous: bool = False):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.contiguous = contiguous
        # the class's flags copied onto the instance: Python 3.11 specializes an instance attribute's read, not a class
        # attribute's read through an instance (the hot paths ask these at every event)
        self.hybrid, self.shared_refs = self.hybrid, self.shared_refs
        self.watermark_blocks = int(watermark * num_blocks)
        self.free_blocks: list[int] = list(_descending_ids(num_blocks))  # pop() hands out block 0 first
        self.num_swap_blocks = num_swap_blocks
        self.free_host_blocks: list[int] = list(range(num_swap_blocks - 1, -1, -1))
        self.peak_used = 0

    @property
    def num_free(self) -> int:
        return self.free_count()

    def free_count(self) -> int:
        """num_free as a method: the scheduler asks at every step, and a property's call costs more."""
        return len(self.free_blocks)

    @property
    def num_used(self) -> int:
        return self.used_blocks()

    def used_blocks(self) -> int:
        """num_used as a method: the simulator's KV sample asks at every event, and a property's call costs more."""
        return self.num_blocks - len(self.free_blocks)

    def note_peak(self) -> None:
        used = self.num_blocks - len(self.free_blocks)
        if used > self.peak_used:  # max() without the call: asked at every step
            self.peak_used = used

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def extra_blocks(self, req: Request, num_tokens: int) -> int:
        """Blocks `req` still needs so that `num_tokens` of its tokens fit."""
        n = -(-num_tokens // self.block_size) - len(req.block_table)  # blocks_for, and max(0, n), inline
        return n if n > 0 else 0

    def can_allocate(self, req: Request, num_tokens: int, watermark: bool = False) -> bool:
        reserve = self.watermark_blocks if watermark else 0
        return len(self.free_blocks) - self.extra_blocks(req, num_tokens) >= reserve

    def admit_blocks(self, computed: int, num_tokens: int, held: int) -> int:
        """Blocks a waiting request holding `held` blocks (of a cached prefix) takes for `num_tokens` slots."""
        n = -(-num_tokens // self.block_size) - held  # blocks_for, and max(0, n), inline: asked at every step
        return n if n > 0 else 0

    def align_chunk(self, req: Request, computed: int, n: int) -> int:
        """A prompt chunk of `n` tokens as this allocator needs it cut (unchanged here)."""
        return n

    def make_decode_set(self) -> DecodeSet:
        """The decode set whose block calendar hands this allocator's blocks to decoding rows."""
        return DecodeSet(self.block_size)

    def detach(self, req: Request) -> list[int]:
        """A handed-off request's blocks, kept for sending while it holds none."""
        blocks, req.block_table = req.block_table, []
        return blocks

    def allocate(self, req: Request, num_tokens: int) -> None:
        """Grow req.block_table to hold `num_tokens` tokens (the caller checked can_allocate)."""
        need = self.extra_blocks(req, num_tokens)
        if need > len(self.free_blocks):
            raise RuntimeError(f"request {req.id}: needs {need} blocks, {len(self.free_blocks)} free")
        if need:
            req.block_table.extend(reversed(self.free_blocks[-need:]))
            del self.free_blocks[-need:]

    def append_block(self, req: Request) -> None:
        req.block_table.append(self.free_blocks.pop())

    def trim(self, req: Request, num_tokens: int) -> None:
        """Return the blocks past those `num_tokens` tokens need (speculative slots of rejected drafts)."""
        keep = self.blocks_for(num_tokens)
        if len(req.block_table) > keep:
            self.release(req.block_table[keep:])
            del req.block_table[keep:]

    def free(self, req: Request) -> None:
        self.release(req.block_table)
        req.block_table = []
        req.num_registered = 0

    def release(self, block_table: list[int]) -> None:
        """Give back the blocks of a table no request holds any more (a handed-off prefill's, once sent)."""
        self.free_blocks.extend(reversed(block_table))

    @property
    def num_free_swap_blocks(self) -> int:
        return len(self.free_host_blocks)

    def can_swap_out(self, req: Request) -> bool:
        return len(req.block_table) <= len(self.free_host_blocks)

    def swap_out(self, req: Request) -> list[tuple[int, int]]:
        """Move req's blocks to host memory; returns (device block, host block) copies to make before the
        device blocks are written again (i.e. before the step's forward)."""
        n = len(req.block_table)
        host = self.free_host_blocks[-n:][::-1] if n else []
        del self.free_host_blocks[len(self.free_host_blocks) - n:]
        pairs = list(zip(req.block_table, host))
        req.host_block_table = host
        self.free(req)
        return pairs

    def swap_in(self, req: Request, num_tokens: int) -> list[tuple[int, int]]:
        """Bring a swapped request back with room for `num_tokens`; returns (host block, device block)
        copies to make before the step's forward."""
        self.allocate(req, num_tokens)
        pairs = list(zip(req.host_block_table, req.block_table))
        self.free_host_blocks.extend(reversed(req.host_block_table))
        req.host_block_table = ()
        return pairs


class FreeBlockQueue:
    """The free blocks of a prefix-caching allocator, least recently freed first (vLLM's free block queue): a block
    freed with a cached prefix in it stays findable until it is handed out again, so the blocks freed longest ago
    go first. `pop()` hands one out (evicting its prefix) as the decode fast path pops from a plain list.

    The queue is two lists read from `head` on (each entry a block and the stamp it was queued with), so that a
    prompt's blocks are handed out and freed by slices, checked in C; an entry is current while its block's stamp is
    still its own: taking a block (a hit, or handed out) or freeing it again makes its entry stale.

    `lazy` (PrefixCachingAllocator): until its first block is registered no free block holds a prefix, none is
    taken back and none is shared, so the queue is a plain first-in first-out list of blocks, its entries all
    current, and the allocator's reference counts all 1 for a block in use; `track` starts stamps and counts."""

    def __init__(self, kv: "PrefixCachingAllocator", blocks: list[int], lazy: bool = False):
        self.kv = kv
        self.blocks = list(blocks)
        self.stamps = [0] * len(blocks)
        self.head = 0
        self.stamp = [0] * kv.num_blocks  # each block's current entry's stamp; -1: none (in use)
        self.next_stamp = 1
        self.size = len(blocks)
        self.tracking = not lazy

    def track(self) -> None:
        """Stamps and reference counts from now on: each entry current, each block out of the queue held once."""
        if self.tracking:
            return
        live = self.blocks[self.head:]
        self.blocks, self.head, self.stamps = live, 0, [0] * len(live)
        self.stamp = [-1] * self.kv.num_blocks
        ref = self.kv._ref
        ref[:] = [1] * len(ref)
        for b in live:
            self.stamp[b] = ref[b] = 0
        self.tracking = True

    def __len__(self) -> int:
        return self.size

    def __iter__(self):
        """The free blocks, least recently freed first."""
        stamp, h = self.stamp, self.head
        if not self.tracking:
            return iter(self.blocks[h:])
        return (b for b, s in zip(self.blocks[h:], self.stamps[h:]) if stamp[b] == s)

    @property
    def num_entries(self) -> int:
        """Entries in the queue, stale ones included."""
        return len(self.blocks) - self.head

    def extend(self, blocks: list[int]) -> None:
        """Blocks freed, in the order they should be handed out again."""
        if not self.tracking:
            self.blocks += blocks
            self.size += len(blocks)
            if self.head > self.kv.num_blocks:  # the entries handed out: dropped now and then
                del self.blocks[:self.head]
                self.head = 0
            return
        first = self.next_stamp
        self.next_stamp = first + len(blocks)
        stamps = range(first, self.next_stamp)
        stamp = self.stamp
        for b, s in zip(blocks, stamps):
            stamp[b] = s
        self.blocks += blocks
        self.stamps += stamps
        self.size += len(blocks)
        if self.head > len(stamp):  # the entries handed out: dropped now and then
            del self.blocks[:self.head], self.stamps[:self.head]
            self.head = 0
        if len(self.blocks) - self.head > 4 * len(stamp) + 64:  # hits leave stale entries: a hot prefix freed again
            live = [(b, s) for b, s in zip(self.blocks[self.head:], self.stamps[self.head:]) if stamp[b] == s]
            self.blocks, self.stamps, self.head = [b for b, _ in live], [s for _, s in live], 0

    def revive(self, block: int) -> None:
        """A free block with a cached prefix comes back into use (a prefix hit); its queue entry goes stale."""
        self.stamp[block] = -1
        self.size -= 1

    def pop(self) -> int:
        """One block handed out (the decode fast path's call, as on a plain list): take(1) without its list."""
        h = self.head
        block = self.blocks[h]
        if not self.tracking:
            self.head = h + 1
            self.size -= 1
            return block
        blocks, stamps, stamp = self.blocks, self.stamps, self.stamp
        while stamp[block] != stamps[h]:  # taken back by a prefix hit, or freed again since
            h += 1
            block = blocks[h]
        self.head = h + 1
        stamp[block] = -1
        kv = self.kv
        kv._ref[block] = 1
        hash_of = kv.hash_of
        if hash_of and block in hash_of:
            del kv.cached[hash_of.pop(block)]
        self.size -= 1
        return block

    def take(self, n: int) -> list[int]:
        """Hand out `n` free blocks (the caller checked there are): each a new block, its cached prefix evicted."""
        blocks, stamps, stamp, h = self.blocks, self.stamps, self.stamp, self.head
        out = blocks[h:h + n]
        if not self.tracking:
            self.head = h + n
            self.size -= n
            return out
        if [stamp[b] for b in out] == stamps[h:h + n]:  # the next n entries all current: the usual case
            h += n
        else:  # the first n current ones: taken back by a prefix hit, or freed again since, are not
            out = []
            while len(out) < n:
                if stamp[blocks[h]] == stamps[h]:
                    out.append(blocks[h])
                h += 1
        self.head = h
        kv = self.kv
        ref, hash_of = kv._ref, kv.hash_of
        for block in out:
            stamp[block] = -1
            ref[block] = 1
        if hash_of:
            cached = kv.cached
            for block in out:
                if block in hash_of:
                    del cached[hash_of.pop(block)]
        self.size -= n
        return out


class PrefixCachingAllocator(BlockAllocator):
    """Paged blocks shared between requests whose prompts begin alike (vLLM's automatic prefix caching).

    A full block of prompt tokens, once computed, is registered under its hash (`Request.block_hashes`: the
    prompt's content up to and including that block); a request admitted later takes the blocks of its longest
    cached prefix instead of computing them. Blocks count references; one nobody holds is free but keeps its
    prefix until the free queue hands it out again (least recently freed first).
    """

    prefix_caching = True

    def __init__(self, num_blocks: int, block_size: int, watermark: float = 0.0, num_swap_blocks: int = 0):
        super().__init__(num_blocks, block_size, watermark, num_swap_blocks)
        self._ref = [0] * num_blocks
        self.cached: dict[int, int] = {}  # block hash -> block
        self.hash_of: dict[int, int] = {}  # block -> the hash it is registered under
        self.free_blocks = FreeBlockQueue(self, list(range(num_blocks)), lazy=True)
        self.queried_tokens = 0  # tokens of the requests admitted (vLLM's prefix cache queries), and those found cached
        self.hit_tokens = 0
        self.shared_refs = 0  # references past the first to blocks held (their tokens are stored once)

    def free_count(self) -> int:  # the free queue's own count, without a call of its __len__: asked at every event
        return self.free_blocks.size

    def used_blocks(self) -> int:
        return self.num_blocks - self.free_blocks.size

    def note_peak(self) -> None:
        used = self.num_blocks - self.free_blocks.size
        if used > self.peak_used:
            self.peak_used = used

    @property
    def ref(self) -> list[int]:
        """Each block's references (the requests holding it)."""
        self.free_blocks.track()
        return self._ref

    def cached_prefix(self, req: Request) -> tuple[int, int]:
        """(blocks of `req`'s prompt found cached, how many of those are free now); at least the prompt's last token
        is left to compute, as its logits sample the first output token."""
        hashes, cached, ref = req.block_hashes, self.cached, self._ref  # a block is cached once counts are kept
        limit = min(len(hashes), (req.num_tokens - 1) // self.block_size)
        hits = free = 0
        while hits < limit:
            block = cached.get(hashes[hits])
            if block is None:
                break
            hits += 1
            free += ref[block] == 0
        return hits, free

    def take_prefix(self, req: Request, hits: int) -> None:
        """Give a request with no blocks the first `hits` blocks of its cached prefix (from cached_prefix)."""
        self.queried_tokens += req.prompt_len + req.num_generated  # num_tokens, inline: once per prompt admitted
        self.hit_tokens += hits * self.block_size
        ref = self._ref
        for h in req.block_hashes[:hits]:
            block = self.cached[h]
            if ref[block] == 0:
                self.free_blocks.revive(block)
            else:
                self.shared_refs += 1
            ref[block] += 1
            req.block_table.append(block)
        req.num_computed = hits * self.block_size

    def register(self, req: Request, num_computed: int | None = None) -> None:
        """Make the full blocks `req` has computed (or its first `num_computed` tokens) findable (a prefix computed
        twice at once keeps the block registered first; the other stays private)."""
        computed = req.num_computed if num_computed is None else num_computed
        upto = min(len(req.block_hashes), computed // self.block_size, len(req.block_table))
        if upto > req.num_registered:
            self.free_blocks.track()
        for j in range(req.num_registered, upto):
            h, block = req.block_hashes[j], req.block_table[j]
            if h not in self.cached and block not in self.hash_of:
                self.cached[h] = block
                self.hash_of[block] = h
        req.num_registered = max(req.num_registered, upto)

    def allocate(self, req: Request, num_tokens: int) -> None:
        need = self.extra_blocks(req, num_tokens)
        if need > self.free_blocks.size:  # the queue's count without its __len__ call: once per prompt admitted
            raise RuntimeError(f"request {req.id}: needs {need} blocks, {self.free_blocks.size} free")
        if need:
            req.block_table.extend(self.free_blocks.take(need))

    def release(self, block_table: list[int]) -> None:
        # the last blocks first: a prompt's tail is the part other requests are least likely to share
        if not self.free_blocks.tracking:  # nothing registered yet: nothing shared
            self.free_blocks.extend(block_table[::-1])
            return
        ref = self._ref
        if [ref[b] for b in block_table].count(1) == len(block_table):  # none shared: all freed
            for block in block_table:
                ref[block] = 0
            self.free_blocks.extend(block_table[::-1])
            return
        freed = []
        add = freed.append
        for block in reversed(block_table):
            left = ref[block] = ref[block] - 1
            if left:
                self.shared_refs -= 1
            else:
                add(block)
        self.free_blocks.extend(freed)
