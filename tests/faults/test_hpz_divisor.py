"""Issue 48, defect 9: DeepSpeed's ``zero_hpz_partition_size`` smaller than a node's data-parallel ranks.

DeepSpeed accepts any divisor of the node's ranks (secondary groups of that
many ranks inside the node). hybrid shards the secondary copy over the node's
whole data-parallel group only, so such a size is still refused, but the
refusal now says why and what to set instead: the node's size, which keeps
the backward gather on the node. On the issue's main the refusal gave no
reason (this test failed there); the runtime and the planner share the words.
"""

from __future__ import annotations

import json

from hybrid.config import load_config
from hybrid.plan.two_level import hpz_placement_problem
from hybrid.zero.secondary_partition import hpz_size_problem


def test_a_divisor_of_the_nodes_ranks_is_refused_saying_why_and_what_to_set():
    why = hpz_size_problem(2, 4)
    assert "\n" not in why
    assert why.startswith("zero.hpz_partition_size = 2 but each node holds 4 data-parallel ranks")
    assert "DeepSpeed also takes a divisor" in why and "whole data-parallel group" in why
    assert "set it to 4" in why and "or 1 to turn hpZ off" in why
    # The planner refuses the same placement in the runtime's words: TP1 x DP8 on two nodes of four ranks.
    assert hpz_placement_problem(2, 1, 8, 4) == why
    assert hpz_placement_problem(4, 1, 8, 4) is None  # the node's size runs
    assert "DeepSpeed" not in hpz_size_problem(3, 4)  # not a divisor: DeepSpeed refuses it too


def test_the_deepspeed_key_reaches_the_check_unchanged(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_batch_size": 8, "zero_optimization": {"stage": 3,
                                                                             "zero_hpz_partition_size": 2}}))
    assert load_config(str(path)).zero.hpz_partition_size == 2
