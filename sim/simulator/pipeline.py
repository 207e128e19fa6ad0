"""Pipeline parallelism: a replica's layers in `p` stages on their own devices, each stage computing one batch at a
time. A step of a virtual engine (vLLM's name for the batches a pipelined replica keeps in
flight) passes through the stages in order, holding each for its share of the step's time and then sending its
activations to the next stage over the link. With as many virtual engines as stages the stages stay busy (the
steady state); a lone batch pays every stage and every send while the other stages idle: the bubble. Stages serve steps first come first served and a step's sends keep its place (one
stream between two stages), so steps keep their stage-0 order through every stage: a step's whole passage is known
when it enters, and costs one event instead of two per stage."""
from __future__ import annotations

from dataclasses import dataclass, field

import simpy

from sim.cost.pricer import StepPricer, equal_stages
from sim.cost.step import Stages, priced_run


@dataclass
class Pipeline:
    """The stages of one pipelined replica, shared by its virtual engines. Its engines' steps come priced by stage
    (sim/cost/pricer.py: StepPricer.stages); `traverse` splits a step given whole evenly, sending over the link the
    two send fields describe."""

    env: simpy.Environment
    num_stages: int
    send_s_per_token: float = 0.0  # traverse: activations of one token over the link between stages
    send_latency_s: float = 0.0
    free_at: list = field(init=False)  # per stage: when it finishes the steps that entered before
    busy_s: list = field(init=False)  # per stage: time it computed
    engines: list = field(default_factory=list)  # its virtual engines (sim.simulator.replica.Replica)

    def __post_init__(self):
        self.free_at = [0.0] * self.num_stages
        self.busy_s = [0.0] * self.num_stages

    def alone(self, engine) -> bool:
        """No step in flight and no other virtual engine with work: `engine`'s steps pass without waiting."""
        for e in self.engines:  # another engine with work: the likelier no, asked first
            if e is not engine and e.scheduler.has_work():
                return False
        return max(self.free_at) <= self.env.now

    def decode_run(self, pricer: StepPricer, num_seqs: int, sum_context: int, clock: float, k_max: int,
                   until: float, step_end) -> tuple[int, float]:
        """StepCostModel.decode_run through the stages, for an engine that has them to itself (`alone`)."""
        return priced_run(self.passage, pricer.decode_stages, num_seqs, sum_context, clock, k_max, until, step_end)

    def passage(self, start: float, stages: Stages) -> float:
        """A step of these stages (each stage's time, the send between stages, the return to stage 0) entering stage
        0 at `start`: when it leaves the last stage."""
        stage_times, send_s, back_s = stages
        t = start
        free_at, busy_s, last = self.free_at, self.busy_s, self.num_stages - 1
        for i, stage_s in enumerate(stage_times):
            free = free_at[i]
            t = (free if free > t else t) + stage_s  # max(t, free), without the call
            free_at[i] = t
            busy_s[i] += stage_s
            if i < last:
                t += send_s
        return t + back_s

    def traverse(self, step_s: float, tokens: int):
        """SimPy process body: one step of `step_s` over `tokens` tokens through every stage, split evenly."""
        stages = equal_stages(step_s, tokens, self.num_stages, self.send_s_per_token, self.send_latency_s)
        yield self.env.timeout(self.passage(self.env.now, stages) - self.env.now)
