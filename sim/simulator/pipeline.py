"""Pipeline parallelism: a replica's layers in `p` stages on their own devices, each stage a SimPy resource that
one batch holds at a time. A step of a virtual engine (vLLM's name for the batches a pipelined replica keeps in
flight) passes through the stages in order, holding each for its share of the step's time and then sending its
activations to the next stage over the link. With as many virtual engines as stages the stages stay busy (the
steady state); a lone batch pays every stage and every send while the other stages idle: the bubble."""
from __future__ import annotations

from dataclasses import dataclass, field

import simpy


@dataclass
class Pipeline:
    """The stages of one pipelined replica, shared by its virtual engines."""

    env: simpy.Environment
    num_stages: int
    send_s_per_token: float  # activations of one token over the link between stages
    send_latency_s: float
    stages: list = field(init=False)
    busy_s: list = field(init=False)  # per stage: time it computed

    def __post_init__(self):
        self.stages = [simpy.Resource(self.env, capacity=1) for _ in range(self.num_stages)]
        self.busy_s = [0.0] * self.num_stages

    def traverse(self, step_s: float, tokens: int):
        """SimPy process body: one step of `step_s` (the whole model's time) through every stage."""
        stage_s = step_s / self.num_stages
        send_s = tokens * self.send_s_per_token + self.send_latency_s
        for i, stage in enumerate(self.stages):
            with stage.request() as turn:
                yield turn
                yield self.env.timeout(stage_s)
                self.busy_s[i] += stage_s
            if i < self.num_stages - 1:
                yield self.env.timeout(send_s)
