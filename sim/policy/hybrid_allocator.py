"""KV blocks of a hybrid model as vLLM's hybrid KV cache manager keeps them (v1 `KVCacheManager` over a
`HybridKVCacheCoordinator`): one pool of blocks, drawn by groups of layers of one attention kind each
(sim/config/kv_groups.py), each group its own block table per request.

- A full-attention group holds a block per block_size tokens of the sequence (FullAttentionManager).
- A sliding-window group frees the blocks that fell out of the window before each allocation (SlidingWindowManager:
  tokens before num_computed - W + 1 are skipped), so a long prompt in chunks holds its window and a chunk, and a
  decoding sequence its window.
- A chunked-local group frees the chunks before the one the next token is in (ChunkedLocalAttentionManager).
- A linear-attention group holds one block per sequence, its state (MambaManager; its block spans max_model_len). With
  prefix caching (vLLM's mamba "align" mode) its blocks span block_size tokens: prompt chunks end at block boundaries,
  each boundary's state is a new block, and the one before it is freed a step later (cached, for a prompt that
  begins alike to start from).

Groups of one kind are alike (same tables, same frees), so a request keeps, per kind, one table of bundles: a tuple of
one block per group of that kind, or None where the blocks were freed or never taken (vLLM's null block).
`r.group_tables[k]` is kind k's table and `r.group_dropped[k]` how many of its first entries are None; past them a
window's entries are all held, a linear group's at most two.

Prefix caching is per group: a full group reuses the blocks of the longest cached prefix, a sliding-window group only
needs (and can only reuse) the blocks inside the window at the reuse point, a chunked group those of the current
chunk, a linear group the last state kept within it; the hit is the length every kind agrees on
(HybridKVCacheCoordinator.find_longest_cache_hit).
"""
from __future__ import annotations

from sim.config.kv_groups import KVGroups, cdiv
from sim.policy.block_manager import BlockAllocator, FreeBlockQueue
from sim.policy.decode_set import HybridDecodeSet
from sim.policy.request import Request

# how a kind's table moves: windows free their first entries as the sequence grows; a linear group holds one state
# block ("state"), or with prefix caching (vLLM's mamba "align" mode) a block per block_size tokens of which only the
# last state and, for one step after a boundary, the one before it are kept ("state_align")
MOVING = ("sliding_window", "chunked_local", "state_align")


class HybridBlockAllocator(BlockAllocator):
    """One pool of blocks over a hybrid model's KV cache groups; `step_tokens`: the most tokens of one sequence a step
    computes (a whole prompt, or a prefill chunk), which sizes what a sliding window holds at its peak."""

    hybrid = True

    def __init__(self, groups: KVGroups, num_blocks: int, watermark: float = 0.0, num_swap_blocks: int = 0,
                 step_tokens: int = 1, prefix_caching: bool = False):
        super().__init__(num_blocks, groups.block_size, watermark, num_swap_blocks)
        self.groups = groups
        self.step_tokens = step_tokens
        # a linear group's blocks span block_size tokens where prefix caching keeps its states (kv_groups.py)
        self.align = any(k.kind == "linear" for k in groups.kinds) and groups.linear_block_tokens <= groups.block_size
        # (mode, window, groups) by kind: the mode is the kind, a linear one's "state" or "state_align"
        self.kinds = [(("state_align" if self.align else "state") if k.kind == "linear" else k.kind, k.window,
                       k.groups) for k in groups.kinds]
        self.kind_names = [k.kind for k in groups.kinds]
        self.n_growing = sum(n for mode, _, n in self.kinds if mode != "state")  # blocks a boundary takes
        self.n_full = sum(n for mode, _, n in self.kinds if mode == "full")
        self.grow_kind = next(k for k, (mode, _, _) in enumerate(self.kinds) if not mode.startswith("state"))
        self.moving = [(k, mode, window) for k, (mode, window, _) in enumerate(self.kinds) if mode in MOVING]
        self.growing = [(k, n) for k, (mode, _, n) in enumerate(self.kinds) if mode != "state"]
        # over the requests holding blocks: entries freed out of each kind's tables, and state entries held (the
        # tokens their blocks hold, filled_tokens, without a pass over them)
        self.dropped_sum = [0] * len(self.kinds)
        self.state_live = [0] * len(self.kinds)
        # where each kind's groups start in the flat group numbering (prefix caching registers per group)
        self.first_group = [sum(n for _, _, n in self.kinds[:k]) for k in range(len(self.kinds))]
        self.prefix_caching = prefix_caching
        self.window_frees = 0  # times blocks left a window (a request waiting for blocks could start after one)
        self.kind_of = [0] * num_blocks  # the kind whose group holds each block in use
        self.used = [0] * len(self.kinds)  # blocks in use by kind, and the most at once
        self.peak = [0] * len(self.kinds)
        if prefix_caching:
            self.ref = self._ref = [0] * num_blocks  # _ref: the name the free queue counts under
            self.cached: dict[tuple[int, int], int] = {}  # (group, block hash) -> block
            self.hash_of: dict[int, tuple[int, int]] = {}
            self.free_blocks = FreeBlockQueue(self, list(range(num_blocks)))

    # -- what one request needs -------------------------------------------------------------------------------------
    def skipped(self, mode: str, window: int, computed: int) -> int:
        """Leading blocks of a kind's table no longer needed once `computed` tokens are computed (vLLM's
        get_num_skipped_tokens: a window's, the chunks before the current one, all states but the last)."""
        if mode == "sliding_window":
            return max(0, computed - window + 1) // self.block_size
        if mode == "chunked_local":
            return computed // window * window // self.block_size
        if mode == "state_align":
            return max(0, computed - 1) // self.block_size
        return 0

    def table_len(self, mode: str, num_tokens: int) -> int:
        """Entries a kind's table has for `num_tokens` tokens (a linear group without prefix caching: one, its
        state)."""
        if mode == "state":
            return 1 if num_tokens else 0
        return -(-num_tokens // self.block_size)

    def blocks_for(self, num_tokens: int) -> int:
        """The most blocks a sequence of `num_tokens` holds at once (vLLM's max_memory_usage of each group)."""
        return self.groups.peak_blocks(num_tokens, self.step_tokens)

    def _tables(self, r: Request) -> tuple[list, list]:
        if not r.group_tables:
            r.group_tables = [[] for _ in self.kinds]
            r.group_dropped = [0] * len(self.kinds)
        return r.group_tables, r.group_dropped

    def new_blocks(self, r: Request, computed: int, num_tokens: int) -> int:
        """Blocks `allocate` takes to give r `num_tokens` slots with `computed` tokens computed: each kind's new
        entries, past those the window skips."""
        tables = r.group_tables
        need = 0
        for k, (mode, window, n) in enumerate(self.kinds):
            have = len(tables[k]) if tables else 0
            want = self.table_len(mode, num_tokens)
            if want > have:  # a linear group takes one block: its state (the blocks before it, None)
                need += n if mode.startswith("state") else n * (want - max(have, self.skipped(mode, window, computed)))
        return need

    def extra_blocks(self, r: Request, num_tokens: int) -> int:
        """Blocks r still needs for `num_tokens` of its tokens, after freeing what fell out of its windows (vLLM's
        allocate_slots frees them first)."""
        self.drop(r, r.num_computed)
        return self.new_blocks(r, r.num_computed, num_tokens)

    def can_allocate(self, r: Request, num_tokens: int, watermark: bool = False) -> bool:
        need = self.extra_blocks(r, num_tokens)  # first: it frees what left r's windows
        return len(self.free_blocks) - need >= (self.watermark_blocks if watermark else 0)

    def allocate(self, r: Request, num_tokens: int) -> None:
        """Free what r's windows skip, then give each kind's table the entries `num_tokens` need (the caller checked
        can_allocate)."""
        if not self.grow(r, r.num_computed, num_tokens):
            raise RuntimeError(f"request {r.id}: needs {self.new_blocks(r, r.num_computed, num_tokens)} blocks, "
                               f"{len(self.free_blocks)} free")

    def grow(self, r: Request, computed: int, num_tokens: int) -> bool:
        """allocate at `computed` tokens (a lazily counted decode row's), or False, having only freed, where the free
        blocks are too few."""
        self.drop(r, computed)
        need = self.new_blocks(r, computed, num_tokens)
        if need > len(self.free_blocks):
            return False
        if not need:
            return True
        tables, dropped = self._tables(r)
        fresh = self._take(need)
        at = 0
        for k, (mode, window, n) in enumerate(self.kinds):
            table, want = tables[k], self.table_len(mode, num_tokens)
            if want <= len(table):
                continue
            start = want - 1 if mode.startswith("state") else max(len(table), self.skipped(mode, window, computed))
            if start > len(table):  # entries a table begins past (a swap-in, a hand-off), or states not kept
                if not table or not mode.startswith("state"):
                    self.dropped_sum[k] += start - dropped[k]
                    dropped[k] = start
                table.extend([None] * (start - len(table)))
            if mode.startswith("state"):
                self.state_live[k] += want - start
            mine = fresh[at:at + n * (want - start)]
            table.extend(zip(*[iter(mine)] * n))  # bundles of n: one block of each of the kind's groups
            self._hold(k, mine)
            at += len(mine)
        return True

    def _hold(self, k: int, blocks) -> None:
        """Blocks taken into use by kind k's groups."""
        kind_of = self.kind_of
        for b in blocks:
            kind_of[b] = k
        self.used[k] += len(blocks)

    def note_peak(self) -> None:
        super().note_peak()
        for k, n in enumerate(self.used):
            if n > self.peak[k]:
                self.peak[k] = n

    @property
    def peak_by_kind(self) -> dict[str, int]:
        return dict(zip(self.kind_names, self.peak))

    def _take(self, n: int) -> list[int]:
        if self.prefix_caching:
            return self.free_blocks.take(n)
        free = self.free_blocks
        out = free[-n:][::-1]
        del free[-n:]
        return out

    def drop(self, r: Request, computed: int) -> None:
        """vLLM's remove_skipped_blocks: free the blocks of r's windowed kinds that no query attends any more."""
        tables, dropped = r.group_tables, r.group_dropped
        if not tables:
            return
        for k, (mode, window, _) in enumerate(self.kinds):
            if mode not in MOVING:
                continue
            table = tables[k]
            upto = min(self.skipped(mode, window, computed), len(table))
            if upto > dropped[k]:
                self._free_entries(r, k, upto)

    def align_chunk(self, r: Request, computed: int, n: int) -> int:
        """With prefix caching of linear-attention states (vLLM's mamba "align" mode), a prefill chunk ends at a
        block boundary, where its state is kept (Scheduler._mamba_block_aligned_split): a chunk short of the last
        boundary is cut to whole blocks (possibly none: not this step), one across it stops there, the tail after it
        runs whole."""
        if not self.align or computed >= max(r.prompt_len, r.num_tokens - 1):
            return n
        last = r.num_tokens - r.num_tokens % self.block_size
        if computed + n < last:
            return n // self.block_size * self.block_size
        return last - computed if computed < last < computed + n else n

    def _free_entries(self, r: Request, k: int, upto: int) -> None:
        """Free kind k's entries of r's from the first not yet freed to `upto` (vLLM's null blocks from there)."""
        table, d = r.group_tables[k], r.group_dropped[k]
        bundles = [e for e in table[d:upto] if e is not None]
        table[d:upto] = [None] * (upto - d)
        r.group_dropped[k] = upto
        self.dropped_sum[k] += upto - d
        if self.kinds[k][0].startswith("state"):
            self.state_live[k] -= len(bundles)
        if bundles:
            self._release_kind(k, [b for bundle in reversed(bundles) for b in bundle])
            self.window_frees += 1

    # -- a decoding row, step by step (HybridDecodeSet) ----------------------------------------------------------------
    def decode_step(self, r: Request, computed: int) -> int:
        """A decoding row's calendar event, computing token `computed`: free what left its windows, take a block for
        each growing group at a block boundary. Returns the next count of computed tokens at which its blocks change,
        or -1 (having freed) when the pool is short."""
        tables, dropped, bs = r.group_tables, r.group_dropped, self.block_size
        nxt = 1 << 62
        for k, mode, window in self.moving:
            if mode == "sliding_window":
                skip = max(0, computed - window + 1) // bs
                nxt = min(nxt, (skip + 1) * bs + window - 1)
            elif mode == "chunked_local":
                skip = computed // window * window // bs
                nxt = min(nxt, (computed // window + 1) * window)
            else:
                skip = max(0, computed - 1) // bs
                nxt = min(nxt, (skip + 1) * bs + 1)
            upto = min(skip, len(tables[k]))
            if upto > dropped[k]:
                self._free_entries(r, k, upto)
        filled = len(tables[self.grow_kind]) * bs
        if filled > computed:
            return min(nxt, filled)
        if self.n_growing > len(self.free_blocks):
            return -1
        fresh, at = self._take(self.n_growing), 0
        for k, n in self.growing:
            tables[k].append(tuple(fresh[at:at + n]))
            self._hold(k, fresh[at:at + n])
            at += n
            if self.kinds[k][0] == "state_align":
                self.state_live[k] += 1
        return min(nxt, filled + bs)

    def make_decode_set(self) -> HybridDecodeSet:
        return HybridDecodeSet(self)

    def next_event(self, r: Request, computed: int) -> int:
        """The next count of computed tokens at which r's blocks change: a new block (every kind's table full) or a
        window's first block skipped."""
        tables = r.group_tables
        filled = len(tables[self.grow_kind]) * self.block_size  # the step computing it needs a new block
        return min(filled, self.next_drop(r, computed))

    def next_drop(self, r: Request, computed: int) -> int:
        """The next count of computed tokens at which a window of r's skips a block (a huge number if none)."""
        nxt, bs = 1 << 62, self.block_size
        for mode, window, _ in self.kinds:
            if mode == "sliding_window":
                nxt = min(nxt, (max(0, computed - window + 1) // bs + 1) * bs + window - 1)
            elif mode == "chunked_local":
                nxt = min(nxt, (computed // window + 1) * window)
            elif mode == "state_align":
                nxt = min(nxt, (max(0, computed - 1) // bs + 1) * bs + 1)
        return nxt

    def changes_now(self, r: Request, computed: int) -> bool:
        """Whether the step computing token `computed` frees or needs blocks of r's."""
        tables, dropped = r.group_tables, r.group_dropped
        for k, (mode, window, _) in enumerate(self.kinds):
            if mode == "state":
                continue
            if len(tables[k]) * self.block_size <= computed:
                return True
            if mode in MOVING and min(self.skipped(mode, window, computed), len(tables[k])) > dropped[k]:
                return True
        return False

    def live(self, r: Request, k: int) -> int:
        """Entries (bundles) kind k's table of r's holds now."""
        return sum(e is not None for e in r.group_tables[k][r.group_dropped[k]:])

    def most_live(self, mode: str, window: int) -> int:
        """The most entries a decoding row's table of a moving kind holds: a window's blocks and the next; a state
        and, for a step past a boundary, the one before it."""
        return 2 if mode == "state_align" else cdiv(max(window - 1, 1), self.block_size) + 1

    # -- giving blocks back ------------------------------------------------------------------------------------------
    def blocks_of(self, r: Request) -> list[int]:
        """Every block r holds, each kind's table in order."""
        return [b for table in r.group_tables for bundle in table if bundle is not None for b in bundle]

    def free(self, r: Request) -> None:
        # the last blocks first, as vLLM frees a request's blocks
        for k, table in enumerate(r.group_tables):
            self._release_kind(k, [b for bundle in reversed(table) if bundle is not None for b in bundle])
        self._forget(r)
        r.block_table = []
        r.num_registered = 0

    def detach(self, r: Request) -> list[int]:
        """A handed-off request's blocks, kept for sending while r holds none."""
        blocks = self.blocks_of(r)
        self._forget(r)
        return blocks

    def _forget(self, r: Request) -> None:
        """r holds no tables any more."""
        for k, (mode, _, _) in enumerate(self.kinds):
            if r.group_tables:
                self.dropped_sum[k] -= r.group_dropped[k]
                if mode.startswith("state"):
                    self.state_live[k] -= self.live(r, k)
        r.group_tables, r.group_dropped = (), ()

    def _release_kind(self, k: int, blocks: list[int]) -> None:
        """Give back blocks of kind k's groups (to the free queue where no other request holds them)."""
        if self.prefix_caching:
            self.release(blocks)
            return
        self.used[k] -= len(blocks)
        self.free_blocks.extend(blocks)

    def release(self, block_table: list[int]) -> None:
        if self.prefix_caching:
            ref, freed = self.ref, []
            for block in block_table:
                left = ref[block] = ref[block] - 1
                if left:
                    self.shared_refs -= 1
                else:
                    freed.append(block)
            block_table = freed
        used, kind_of = self.used, self.kind_of
        for block in block_table:
            used[kind_of[block]] -= 1
        self.free_blocks.extend(block_table)

    def trim(self, r: Request, num_tokens: int) -> None:
        """Return the entries past those `num_tokens` tokens need (speculative slots of rejected drafts)."""
        for k, (mode, _, _) in enumerate(self.kinds):
            table, keep = r.group_tables[k], self.table_len(mode, num_tokens)
            if not mode.startswith("state") and len(table) > keep:
                self._release_kind(k, [b for bundle in reversed(table[keep:]) if bundle is not None for b in bundle])
                del table[keep:]
                self.dropped_sum[k] -= r.group_dropped[k] - min(r.group_dropped[k], keep)
                r.group_dropped[k] = min(r.group_dropped[k], keep)

    def append_block(self, r: Request) -> None:
        self.grow(r, r.num_computed, r.num_computed + 1)

    # -- swap (host blocks: the blocks r holds, copied out and back) --------------------------------------------------
    def can_swap_out(self, r: Request) -> bool:
        return len(self.blocks_of(r)) <= len(self.free_host_blocks)

    def swap_out(self, r: Request) -> list[tuple[int, int]]:
        blocks = self.blocks_of(r)
        n = len(blocks)
        host = self.free_host_blocks[-n:][::-1] if n else []
        del self.free_host_blocks[len(self.free_host_blocks) - n:]
        r.host_block_table = host
        self.free(r)
        return list(zip(blocks, host))

    def swap_in(self, r: Request, num_tokens: int) -> list[tuple[int, int]]:
        self.allocate(r, num_tokens)
        pairs = list(zip(r.host_block_table, self.blocks_of(r)))
        self.free_host_blocks.extend(reversed(r.host_block_table))
        r.host_block_table = ()
        return pairs

    # -- prefix caching per group ---------------------------------------------------------------------------------------
    def admit_blocks(self, computed: int, num_tokens: int, held: int) -> int:
        """Blocks a waiting request with `held` blocks of cached prefix in each attention kind (and `computed` tokens)
        takes for `num_tokens` slots."""
        need = 0
        for mode, window, n in self.kinds:
            if mode.startswith("state"):  # a state block, or with prefix caching one past the hit's
                need += n * (self.table_len(mode, num_tokens) > (held if mode == "state_align" else 0))
            else:
                need += n * max(0, self.table_len(mode, num_tokens) - max(held, self.skipped(mode, window, computed)))
        return need

    def cached_bundle(self, k: int, h: int) -> tuple[int, ...] | None:
        """The blocks of kind k's groups cached under block hash `h`, or None unless every group has one."""
        first, n = self.first_group[k], self.kinds[k][2]
        out = []
        for g in range(first, first + n):
            block = self.cached.get((g, h))
            if block is None:
                return None
            out.append(block)
        return tuple(out)

    def kind_hit(self, k: int, hashes: tuple, most: int) -> int:
        """Blocks of prefix kind k finds cached within the first `most` (vLLM's find_longest_cache_hit of its
        manager): a full group the longest run from the start; a sliding window a run of the window's blocks ending
        at the hit (scanning from the right), or the run from the start; a chunked group the current chunk's run."""
        mode, window, _ = self.kinds[k]
        if mode == "state_align":  # the last state kept at a block boundary
            return next((i + 1 for i in range(most - 1, -1, -1) if self.cached_bundle(k, hashes[i]) is not None), 0)
        if mode == "sliding_window":
            contiguous, run = cdiv(window - 1, self.block_size), 0
            for i in range(most - 1, -1, -1):
                if self.cached_bundle(k, hashes[i]) is None:
                    run = 0
                    continue
                run += 1
                if run >= contiguous:
                    return i + run
            return run
        start = most * self.block_size // window * window // self.block_size if mode == "chunked_local" else 0
        j = start
        while j < most and self.cached_bundle(k, hashes[j]) is not None:
            j += 1
        return j

    def cached_prefix(self, r: Request) -> tuple[int, int]:
        """(blocks of r's prompt found cached in every kind, how many of the blocks taking them touches are free);
        at least the prompt's last token is left to compute. The hit is the length all kinds agree on, each kind's
        searched within the others' (HybridKVCacheCoordinator)."""
        hashes = r.block_hashes
        hit = min(len(hashes), (r.num_tokens - 1) // self.block_size)
        while hit:
            agreed = min(self.kind_hit(k, hashes, hit) for k in range(len(self.kinds)))
            if agreed == hit:
                break
            hit = agreed
        free = sum(self.ref[b] == 0 for bundle in self._hit_bundles(hashes, hit) for b in bundle)
        return hit, free

    def _hit_bundles(self, hashes: tuple, hit: int):
        """(kind, entry, bundle) of the cached blocks a hit of `hit` blocks takes: every kind's from the first its
        window still attends."""
        for k, (mode, window, _) in enumerate(self.kinds):
            for j in range(self.skipped(mode, window, hit * self.block_size), hit):
                yield self.cached_bundle(k, hashes[j])

    def take_prefix(self, r: Request, hits: int) -> None:
        """Give a request with no blocks the cached blocks of its first `hits` prompt blocks that its windows still
        attend (the rest are None entries)."""
        self.queried_tokens += r.num_tokens
        self.hit_tokens += hits * self.block_size
        tables, dropped = self._tables(r)
        computed = hits * self.block_size
        ref = self.ref
        for k, (mode, window, _) in enumerate(self.kinds):
            skip = self.skipped(mode, window, computed)
            tables[k].extend([None] * skip)
            dropped[k] = skip
            self.dropped_sum[k] += skip
            if mode.startswith("state"):
                self.state_live[k] += hits - skip
            for j in range(skip, hits):
                bundle = self.cached_bundle(k, r.block_hashes[j])
                for b in bundle:
                    if ref[b] == 0:
                        self.free_blocks.revive(b)
                        self._hold(k, (b,))
                    else:
                        self.shared_refs += 1
                    ref[b] += 1
                tables[k].append(bundle)
        r.num_computed = computed

    def register(self, r: Request, num_computed: int | None = None) -> None:
        """Make the full blocks r has computed (or its first `num_computed` tokens) findable, each group's under its
        own key (a prefix computed twice at once keeps the block registered first)."""
        computed = r.num_computed if num_computed is None else num_computed
        upto = min(len(r.block_hashes), computed // self.block_size)
        cached, hash_of = self.cached, self.hash_of
        for k in range(len(self.kinds)):
            table, first = r.group_tables[k] if r.group_tables else (), self.first_group[k]
            for j in range(r.num_registered, min(upto, len(table))):
                bundle = table[j]
                if bundle is None:
                    continue
                for i, block in enumerate(bundle):
                    key = (first + i, r.block_hashes[j])
                    if key not in cached and block not in hash_of:
                        cached[key] = block
                        hash_of[block] = key
        r.num_registered = max(r.num_registered, upto)

    def filled_tokens(self, computed: int) -> int:
        """Token slots holding K/V in the blocks of the requests holding blocks, `computed` their computed tokens in
        all: each attention kind's groups hold them but those freed out of windows, a linear group's state block
        counts full; a block shared by several requests counted once."""
        bs, total = self.block_size, 0
        for k, (mode, _, n) in enumerate(self.kinds):
            total += n * (bs * self.state_live[k] if mode.startswith("state") else computed - bs * self.dropped_sum[k])
        return total - self.shared_refs * bs if self.prefix_caching else total
