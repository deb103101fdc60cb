"""PrefillLoad: arrivals while others prefill mark the load sustained; an arrival to an idle queue ends it."""

from jaxcpp.chunking.load import ROUNDS_AHEAD, PrefillLoad


def test_a_burst_at_an_idle_engine_is_a_batch_not_a_sustained_load():
    load = PrefillLoad()
    assert not load.observe(4)  # four prompts at once, nothing prefilling before
    load.prefill_ended()         # the first one's last chunk
    assert not load.observe(3)  # the rest drain: no arrival
    assert not load.sustained and load.peak == 4
    assert load.waiting_for(2) == 2


def test_an_arrival_while_a_prompt_prefills_makes_the_load_sustained_once():
    load = PrefillLoad()
    load.observe(2)
    assert load.observe(3)            # one came while two were prefilling
    assert not load.observe(3)        # still sustained: no second notice
    load.prefill_ended()
    assert not load.observe(3)        # one ended, one came: sustained all along
    assert load.sustained and load.peak == 3
    assert load.waiting_for(1) == 1 + ROUNDS_AHEAD * 3


def test_an_arrival_to_an_empty_prefill_queue_ends_the_sustained_load():
    load = PrefillLoad()
    load.observe(3)
    load.observe(4)
    load.prefill_ended()
    load.observe(3)
    load.prefill_ended()
    load.prefill_ended()
    load.prefill_ended()
    assert not load.observe(1)  # the queue ran dry before this one came
    assert not load.sustained and load.peak == 1
    assert load.waiting_for(0) == 0
