"""Sharding by person: every pair of a person lands in one shard and slice of the sharded engine, the ids are
distinct, and a person's ids do not depend on who else is in the data (so a deletion stays exact)."""
from __future__ import annotations

from scrubnet.experiments.tofu import person_ids
from scrubnet.mlforget.sharded import assignment


def test_person_ids_place_a_person_in_one_shard_and_slice():
    ids = person_ids(range(12), 20, shards=3, slices=2, seed=5)
    flat = [i for p in ids for i in ids[p]]
    assert len(flat) == len(set(flat)) == 240
    for p, rows in ids.items():
        sh, sl = assignment(rows, 3, 2, 5)
        want = assignment([p], 3, 2, 5)
        assert set(sh.tolist()) == {int(want[0][0])} and set(sl.tolist()) == {int(want[1][0])}
    assert len({int(assignment([p], 3, 2, 5)[0][0]) for p in range(12)}) > 1     # people spread over shards
    assert person_ids([4, 9], 20, 3, 2, 5) == {4: ids[4], 9: ids[9]}             # a function of the person alone
