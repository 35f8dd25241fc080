"""The pool's sampling record as `room` reads it (rlfleet/services/rollout/backpressure.py): the other workers'
live records count, the reader's own and expired ones do not, and a field that does not parse counts nothing."""

from __future__ import annotations

from rlfleet.services.rollout.backpressure import others_sampling, record_value


def test_only_the_other_workers_live_records_count():
    record = {
        b"a": record_value(4, 110.0).encode(),
        b"b": record_value(2.5, 100.5).encode(),
        b"me": record_value(8, 200.0).encode(),  # the reader's own batch is not queued for its next one
        b"dead": record_value(8, 99.0).encode(),  # its deadline passed: a worker that died mid-batch
        b"junk": b"not a record",
    }
    assert others_sampling(record, "me", now=100.0) == 6.5
    assert others_sampling(record, "me", now=105.0) == 4.0
    assert others_sampling(record, "a", now=100.0) == 10.5
    assert others_sampling({}, "me", now=0.0) == 0.0
