"""The executor's engine loop: the simulator's scheduler picks every step, the real model runs it.

One `step()` = propose drafts → schedule (shared policy object) → run (executor.core.model_runner: swapped blocks
copied, one packed forward over the mixed batch of prompt chunks and decodes, logits only for rows that sample) →
postprocess (sample or verify, stop at EOS, tell the scheduler). Every step is recorded with its batch shape and
wall-clock time.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from executor.core.malloc_tuning import keep_freed_memory
from executor.core.model_runner import ModelRunner, StepInput
from executor.model.cache_engine import KVCache
from executor.model.llama import LlamaModel
from executor.model.sampling import RequestSampling, SamplingParams, greedy, sample
from executor.speculative.verify import verify, verify_tree
from sim.policy.request import Request
from sim.policy.scheduler import ScheduledBatch, Scheduler

# A test and comparison hook (DEVELOPERS.md): off, every step runs eagerly on a GPU too (use_graphs=None then means
# off). A run says it with executor.cuda_graphs, which reaches the engine as use_graphs.
CUDA_GRAPHS = True


@dataclass
class StepRecord:
    """One engine step as the trace stores it (the batch shape is what calibration fits)."""

    step: int
    start_s: float
    end_s: float
    new_tokens: list[int]
    context_lens: list[int]
    num_prefill: int
    num_decode: int
    num_padding: int
    num_sampled: int  # logit rows computed: one per row that produced a token, all of a verify row's
    kv_blocks_used: int
    preempted: list[int]
    swapped_blocks: int
    num_drafted: int = 0  # speculative decoding: drafts verified this step, and how many were accepted
    num_accepted: int = 0
    draft_s: float = 0.0  # of the step's time, spent proposing drafts (0: the drafter did not run)
    draft_fed_tokens: int = 0  # tokens the drafter's own model caught up on (Drafter.fed_tokens)
    forward_s: float | None = None  # of the step's time, in the model runner (the forward; on a GPU until queued)
    # pipeline parallelism: the batch in flight that ran the step, each stage's (start, end) on the step's clock, and
    # the driver's time on the step besides stage 0's layers (scheduling, input preparation, the LM head, sampling)
    virtual_engine: int | None = None
    stages: list[tuple[float, float]] | None = None
    driver_s: float | None = None
    # a mixture-of-experts model: tokens each expert computed this step, summed over the MoE layers (this process's
    # layers: a pipeline's first stage)
    expert_tokens: list[int] | None = None

    def to_json(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if v is not None}  # fields a layout does not use: absent


@dataclass
class PendingStep:
    """A step scheduled and prepared but not yet run (Engine.begin_step): what Engine.finish_step needs."""

    batch: ScheduledBatch
    step: StepInput
    start: float
    draft_s: float
    fed: int


@dataclass
class Engine:
    """One replica on real hardware: the scheduler picks each step, `runner` (executor.core.model_runner) runs it."""

    model: LlamaModel
    scheduler: Scheduler
    kv_cache: KVCache
    sampling: SamplingParams = SamplingParams()
    eos_token_id: int | None = None
    host_cache: KVCache | None = None  # swap space, on the host
    drafter: object | None = None  # speculative decoding: proposes drafts (executor.speculative)
    t0: float = field(default_factory=time.perf_counter)
    tokens: dict[Request, list[int]] = field(default_factory=dict)
    records: list[StepRecord] = field(default_factory=list)
    # (time, running, KV blocks used, KV tokens stored, waiting) after each step: the scheduler's kv_sample, as the
    # simulator records it
    samples: list[tuple[float, int, int, int, int]] = field(default_factory=list)
    drafts: dict[Request, list[int]] = field(default_factory=dict)
    draft_probs: dict[Request, torch.Tensor | None] = field(default_factory=dict)  # q of a sampling draft model
    # plain decode, lone prompt and chain-verify steps through executor.model.cuda_graph: None = on a GPU (captured
    # graphs); True elsewhere runs the same static-shape forward eagerly (what the tests check it against)
    use_graphs: bool | None = None
    # makes the runner, called as ModelRunner is (executor.distributed: a sharded or pipelined runner); None: ModelRunner
    runner_factory: object | None = None
    # requests with sampling of their own (an online server's): the rest sample as `sampling` says
    request_sampling: dict[Request, RequestSampling] = field(default_factory=dict)

    def __post_init__(self):
        keep_freed_memory()  # each step's activations reuse mapped heap pages instead of faulting in fresh ones
        self.device = self.kv_cache.device
        graphs = bool(self.use_graphs or (self.use_graphs is None and CUDA_GRAPHS and self.device.type == "cuda"))
        chains = getattr(self.drafter, "tree_parents", None) is None  # candidate trees verify eagerly
        self.runner = (self.runner_factory or ModelRunner)(self.model, self.kv_cache, self.scheduler.cfg,
                                                           self.host_cache, use_graphs=graphs,
                                                           verify_graphs=self.drafter is not None and chains)
        if getattr(self.drafter, "reads_all_hidden", False):  # EAGLE: the target's hidden state at every position
            self.runner.all_hidden = True
        self.generator = None
        if self.sampling.temperature > 0:
            self.generator = torch.Generator(device=self.device).manual_seed(self.sampling.seed)

    @property
    def graphs(self):
        """The runner's captured graph sets (executor.model.cuda_graph.StepGraphs), or None: every step runs eagerly."""
        return self.runner.graphs

    def now(self) -> float:
        return time.perf_counter() - self.t0

    def add(self, req: Request, prompt_ids: list[int], sampling: RequestSampling | None = None) -> bool:
        """Queue a request with its prompt token ids (and its own sampling, if any); False if the scheduler rejected
        it."""
        if len(prompt_ids) != req.prompt_len:
            raise ValueError(f"request {req.id}: {len(prompt_ids)} prompt ids for prompt_len {req.prompt_len}")
        accepted = self.scheduler.add(req)
        if accepted:
            self.tokens[req] = list(prompt_ids)
            if sampling is not None:
                self.request_sampling[req] = sampling
        return accepted

    def abort(self, req: Request, reason: str | None) -> None:
        """End a queued or running request between steps, its KV freed: finished where it is (`reason` None: its
        client matched a stop string) or rejected with `reason` (its client went away)."""
        self.scheduler.abort(req, reason)
        self._forget(req)
        self.drafts.pop(req, None)
        self.draft_probs.pop(req, None)
        self.request_sampling.pop(req, None)
        if reason is None:
            req.finish_s = req.token_times[-1] if req.token_times else self.now()

    def output_ids(self, req: Request) -> list[int]:
        return self.tokens[req][req.prompt_len:]

    def _propose(self) -> bool:
        """Drafts for every decoding request, before scheduling (which reserves their KV slots and may
        cut them to the step's budget); whether the drafter ran."""
        sched = self.scheduler
        if not sched.drafting:
            return False  # the scheduler would cut every draft: do not spend time making them
        k = sched.cfg.num_speculative_tokens
        members = list(sched.decoding.members)
        proposals = self.drafter.propose_batch([(r, self.tokens[r], min(k, r.remaining_tokens - 1)) for r in members])
        for r, (d, q) in zip(members, proposals):
            self.drafts[r], self.draft_probs[r] = d, q
            r.num_draft = len(d)
        return True

    def _emit(self, logits: torch.Tensor, spans: list[tuple[Request, int, int]]
              ) -> tuple[dict[Request, list[int]], dict[Request, list[int]]]:
        """Tokens per sampling row: `spans` (request, first logit row, rows); one row samples, several
        verify the request's drafts. Also, for candidate-tree rows, the accepted nodes."""
        out: dict[Request, list[int]] = {}
        paths: dict[Request, list[int]] = {}
        single = [(r, start) for r, start, n in spans if n == 1]
        if single and self.request_sampling:
            out.update((r, [tok]) for (r, _), tok in zip(single, self._sample_own(logits, single)))
        elif single:
            at = [start for _, start in single]  # all rows, in order, in a step of plain decodes: no gather
            picked = sample(logits[:len(at)] if at == list(range(len(at))) else logits[at], self.sampling,
                            self.generator).tolist()
            out.update((r, [tok]) for (r, _), tok in zip(single, picked))
        parents = getattr(self.drafter, "tree_parents", None)
        for r, start, n in spans:
            if n > 1 and parents is not None:
                out[r], paths[r] = verify_tree(logits[start:start + n], self.drafts[r][:n - 1], parents[:n - 1],
                                               self.sampling, self.generator)
            elif n > 1:
                q = self.draft_probs.get(r)
                out[r] = verify(logits[start:start + n], self.drafts[r][:n - 1], self.sampling, self.generator,
                                None if q is None else q[:n - 1])
        return out, paths

    def _sample_own(self, logits: torch.Tensor, single: list[tuple[Request, int]]) -> list[int]:
        """One token per row where some requests sample their own way: the greedy rows in one argmax, EOS masked
        for a row short of its min_tokens, the others each from their own generator."""
        own, eos = self.request_sampling, self.eos_token_id
        picked = greedy(logits[[start for _, start in single]]).tolist()
        for k, (r, start) in enumerate(single):
            s = own.get(r)
            params, generator = (s.params, s.generator) if s is not None else (self.sampling, self.generator)
            held = s is not None and eos is not None and r.num_generated < s.min_tokens
            if params.temperature > 0 or (held and picked[k] == eos):
                row = logits[start:start + 1]
                if held:
                    row = row.clone()
                    row[0, eos] = float("-inf")
                picked[k] = int(sample(row, params, generator)[0])
        return picked

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def step(self) -> StepRecord | None:
        """Run one engine step; None if the scheduler had nothing to run."""
        pending = self.begin_step()
        if pending is None:
            return None
        t = time.perf_counter()
        hidden, logits = self.runner.run(pending.step)
        return self.finish_step(pending, hidden, logits, time.perf_counter() - t)

    def begin_step(self) -> PendingStep | None:
        """The first half of a step: expire, propose drafts, schedule, prepare the inputs (None: nothing to run).
        A pipelined engine runs the forward elsewhere and calls `finish_step` when the last stage answers."""
        start = self.now()
        for r in self.scheduler.expire(start):  # waited past max_queue_delay_s: rejected, never run
            self.tokens.pop(r, None)
        ran = self.drafter is not None and self._propose()
        # 0 where the drafter did not run, so a record tells a drafter that ran and found nothing (prompt
        # lookup with no n-gram match still searched) from one that was not asked
        draft_s = self.now() - start if ran else 0.0
        fed = self.drafter.fed_tokens if ran else 0
        batch = self.scheduler.schedule()
        if not batch:
            return None
        step = self.runner.prepare(batch, self.tokens, self.drafts, getattr(self.drafter, "tree_parents", None))
        return PendingStep(batch, step, start, draft_s, fed)

    def finish_step(self, pending: PendingStep, hidden: torch.Tensor, logits: torch.Tensor | None,
                    forward_s: float | None = None) -> StepRecord:
        """The second half of a step, given its forward's output (and how long the forward took): the step's
        tokens sampled (or its drafts verified) and appended up to EOS, the scheduler told, the step recorded."""
        batch, step, start, draft_s, fed = pending.batch, pending.step, pending.start, pending.draft_s, pending.fed
        spans = step.spans()
        emitted, paths = self._emit(logits, spans) if spans else ({}, {})
        for r, path in paths.items():  # the root's position: the scheduler has not advanced r yet
            self.runner.compact_tree(r.block_table, r.num_computed, path)
        end = self.now()
        stopped, accepted = self._append(emitted, end)
        drafted, num_accepted = sum(r.num_draft for r in accepted), sum(accepted.values())
        if hasattr(self.drafter, "observe"):  # Medusa: the hidden state behind each request's newest token
            for r, first, _ in spans:
                if r not in stopped:  # the row that produced it: a tree's last accepted node, else the last kept
                    k = (paths[r] or [0])[-1] if r in paths else len(emitted[r]) - 1
                    self.drafter.observe(r, hidden[first + k], len(self.tokens[r]))
        if step.hidden_all is not None:
            self._observe_positions(step, emitted, paths, stopped)
        sched = self.scheduler
        _, finished = sched.complete_step(batch, stopped, accepted)
        for r in finished:
            r.finish_s = end
            self._forget(r)
            self.drafts.pop(r, None)
            self.draft_probs.pop(r, None)
            self.request_sampling.pop(r, None)
        kv = sched.kv
        record = StepRecord(
            step=len(self.records), start_s=start, end_s=end, new_tokens=step.query_lens,
            context_lens=step.context_lens, num_prefill=len(batch.prefill), num_decode=len(batch.decode),
            num_padding=len(batch.padding), num_sampled=sum(step.counts), kv_blocks_used=kv.num_used,
            preempted=[r.id for r in batch.preempted], swapped_blocks=len(batch.swap_out) + len(batch.swap_in),
            num_drafted=drafted, num_accepted=num_accepted, draft_s=draft_s, draft_fed_tokens=fed, forward_s=forward_s,
            expert_tokens=self.model.take_expert_counts())
        self.records.append(record)
        self.samples.append(tuple(sched.kv_sample(end)))
        return record

    def _observe_positions(self, step: StepInput, emitted: dict[Request, list[int]], paths: dict[Request, list[int]],
                           stopped: set[Request]) -> None:
        """EAGLE: the target's hidden state at each position this step added to a request's sequence (a prompt
        chunk's every position, a decode row's own and its accepted drafts', a tree's accepted path), handed to the
        drafter with the first one's position."""
        index, spans, first = [], [], 0
        for i, (r, n, ctx) in enumerate(step.rows):
            if i >= step.num_decode:
                kept = range(n)
            elif r in stopped:
                kept = ()
            else:
                kept = [0, *paths[r]] if r in paths else range(len(emitted[r]))
            if kept:
                index.extend(first + k for k in kept)
                spans.append((r, ctx - n, len(kept)))
            first += n
        rows = step.hidden_all[torch.tensor(index, dtype=torch.long, device=step.hidden_all.device)]
        start = 0
        for r, position, m in spans:
            self.drafter.observe_positions(r, position, rows[start:start + m])
            start += m

    def _forget(self, req: Request) -> None:
        """The drafter's state for a request that ended (an EAGLE head keeps it while the request waits)."""
        release = getattr(self.drafter, "release", None)
        if release is not None:
            release(req)

    def _append(self, emitted: dict[Request, list[int]], end: float) -> tuple[set[Request], dict[Request, int]]:
        """Each request's new tokens appended, cut after EOS (unless ignored) and timed at `end`; the requests that
        stopped at EOS, and per request that verified drafts how many it accepted."""
        stopped, accepted = set(), {}
        own = self.request_sampling
        for r, toks in emitted.items():
            ignore_eos = own[r].params.ignore_eos if r in own else self.sampling.ignore_eos
            if not ignore_eos and self.eos_token_id in toks:
                toks = toks[:toks.index(self.eos_token_id) + 1]
                stopped.add(r)
            self.tokens[r].extend(toks)
            r.token_times.extend([end] * len(toks))
            if r.first_token_s is None:
                r.first_token_s = end
            if r.num_draft:
                accepted[r] = len(toks) - 1
        return stopped, accepted
