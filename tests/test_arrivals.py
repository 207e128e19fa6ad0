"""The arrival book (sim.policy.arrivals) on its own, driven by a hand clock as any clock drives it: first turns at
their times, the client's gate, conversations' later turns, a closed loop's users; what it makes due does not depend
on the order a clock learned of one instant's ends."""
from __future__ import annotations

import math
from dataclasses import replace

from sim.config.workload import RequestSpec
from sim.policy.arrivals import ArrivalBook, Send


def spec(i: int, at: float, **kw) -> RequestSpec:
    return RequestSpec(id=i, arrival_s=at, prompt_len=8, output_len=4, **kw)


def test_first_turns_come_at_their_times_in_order():
    book = ArrivalBook([spec(0, 0.0), spec(1, 0.5), spec(2, 0.5), spec(3, 2.0)])
    assert book.known and book.next_s() == 0.0
    assert book.due(0.4) == [Send(0, 0.0)] and book.next_s() == 0.5
    assert book.due(1.0) == [Send(1, 0.5), Send(2, 0.5)]
    assert book.pending() and book.due(1.9) == [] and book.due(5.0) == [Send(3, 2.0)]
    assert not book.pending() and book.next_s() == math.inf


def test_the_gate_holds_requests_until_one_in_flight_ends_a_slot_freeing_before_it_is_taken():
    book = ArrivalBook([spec(i, 0.25 * i) for i in range(4)], max_concurrency=2)
    assert book.due(0.6) == [Send(0, 0.0), Send(1, 0.25)]  # request 2 waits at the client
    book.ended(0, 0.75, True)  # learned late: the slot freed at 0.75, as request 3 came
    assert book.next_s() == 0.75
    assert book.due(0.8) == [Send(2, 0.75, client_wait_s=0.25)]  # waiting since 0.5, sent when the slot freed
    assert book.gate.waiting and book.pending()  # request 3 arrived at 0.75 and waits
    book.ended(1, 1.0, False)  # a rejection frees its slot too
    assert book.due(1.0) == [Send(3, 1.0, client_wait_s=0.25)]


def test_a_later_turn_comes_its_think_time_after_the_turn_before_or_ends_unsent_with_it():
    specs = [spec(0, 0.0, conversation=0), spec(1, 0.0, conversation=0, after=0, think_s=1.0),
             spec(2, 0.0, conversation=0, after=1, think_s=1.0), spec(3, 0.2, conversation=1),
             spec(4, 0.0, conversation=1, after=3, think_s=0.5)]
    book = ArrivalBook(specs)
    assert not book.known and book.due(0.3) == [Send(0, 0.0), Send(3, 0.2)]
    assert book.follows(0) and not book.follows(4)
    book.ended(0, 0.6, True)
    book.ended(3, 0.5, False)  # rejected: its later turn ends with it
    assert book.due(0.7) == [Send(4, 0.5, unsent=True)]
    assert book.next_s() == 1.6 and book.due(2.0) == [Send(1, 1.6)]
    book.ended(1, 2.5, True)
    assert book.due(3.5) == [Send(2, 3.5)] and not book.pending()


def test_a_closed_loop_s_users_take_the_next_unit_as_theirs_ends():
    specs = [replace(spec(i, 0.0), users=2, think_s=0.1 * (i + 1)) for i in range(4)]
    book = ArrivalBook(specs)
    assert book.due(1.0) == [Send(0, 0.1), Send(1, 0.2)]  # two users, each after its think time
    book.ended(1, 1.0, True)
    book.ended(0, 1.2, True)
    assert book.due(2.0) == [Send(2, 1.0 + 0.3), Send(3, 1.2 + 0.4)]  # unit 2 to the first user free


def test_what_is_due_does_not_depend_on_the_order_one_instant_s_ends_were_told():
    def run(order):
        specs = [spec(i, 0.0) for i in range(3)] + [spec(i, 1.0) for i in range(3, 6)]
        book = ArrivalBook(specs, max_concurrency=3)
        first = book.due(0.0)
        for i in order:
            book.ended(i, 1.0, True)
        return first + book.due(1.0)

    assert run([0, 1, 2]) == run([2, 0, 1]) == run([1, 2, 0])
