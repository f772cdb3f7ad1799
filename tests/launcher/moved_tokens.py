"""The tokens of requests that moved between DP groups against one process's,
for migration_e2e.sh and tests/multihost/netns_migration.sh.

Each request's served tokens must equal the reference from its first move
up to `exact` (its whole length when the blocks moved, a few tokens past the
move when they were computed again). One request may differ before its
first move: a decode step's rows can round differently with the batch it
shares (which requests share the step, which experts get how many rows),
and a draw near a boundary flips; that is not the move's doing (seen once in
CI, a seeded draw at token 652 of 701).
"""
import json
import re


def check(work, local_path, exact_after_move=None):
    """Checks requests 0..n-1 ($work/served{i}.json, $work/move{i}.out)
    against the n lines of `local_path`. exact_after_move: tokens past the
    first move that must still be exact (None: all of them). Returns the one
    request that differed before its move as (index, token, first move), or
    None."""
    local = [json.loads(l) for l in open(local_path)]
    before_move = []
    for i, l in enumerate(local):
        s = json.load(open(f"{work}/served{i}.json"))
        assert len(s["tokens"]) == len(l["tokens"]), (i, len(s["tokens"]), len(l["tokens"]))
        assert s["finish_reason"] == l["finish_reason"], (i, s["finish_reason"], l["finish_reason"])
        first_move = int(re.search(r"after (\d+) tokens", open(f"{work}/move{i}.out").read()).group(1))
        exact = len(l["tokens"]) if exact_after_move is None else first_move + exact_after_move
        differ = [k for k, (a, b) in enumerate(zip(s["tokens"], l["tokens"])) if a != b]
        if differ and differ[0] < first_move:
            before_move.append((i, differ[0], first_move))
            continue
        assert not differ or differ[0] >= exact, (i, "first difference at", differ[0], "moved after", first_move)
    assert len(before_move) <= 1, ("requests that differ before their first move", before_move)
    return before_move[0] if before_move else None
