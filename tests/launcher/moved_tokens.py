"""The tokens of requests that moved between DP groups against one process's,
for migration_e2e.sh and tests/multihost/netns_migration.sh.

Each request's served tokens must equal the reference up to `exact` (its
whole length when the blocks moved, a few tokens past the first move when
they were computed again). One request may differ anywhere: a decode
step's rows can round differently with the batch it shares (which requests
share the step, which experts get how many rows), and a sampled draw near a
boundary flips. That is not the move's doing: CI saw seeded request 1 of
migration_e2e flip at token 652 both before its first move (at 701) and
after it (at 650). A move that went wrong would change the requests it
moved, and 8 requests make 12 moves.
"""
import json
import re


def check(work, local_path, exact_after_move=None):
    """Checks requests 0..n-1 ($work/served{i}.json, $work/move{i}.out)
    against the n lines of `local_path`. exact_after_move: tokens past the
    first move that must still be exact (None: all of them). Returns the one
    request that differed as (index, token, first move), or None."""
    local = [json.loads(l) for l in open(local_path)]
    differed = []
    for i, l in enumerate(local):
        s = json.load(open(f"{work}/served{i}.json"))
        assert len(s["tokens"]) == len(l["tokens"]), (i, len(s["tokens"]), len(l["tokens"]))
        assert s["finish_reason"] == l["finish_reason"], (i, s["finish_reason"], l["finish_reason"])
        first_move = int(re.search(r"after (\d+) tokens", open(f"{work}/move{i}.out").read()).group(1))
        exact = len(l["tokens"]) if exact_after_move is None else first_move + exact_after_move
        differ = [k for k, (a, b) in enumerate(zip(s["tokens"], l["tokens"])) if a != b]
        if differ and differ[0] < exact:
            differed.append((i, differ[0], first_move))
    assert len(differed) <= 1, ("requests that differ from one process's (index, token, first move)", differed)
    return differed[0] if differed else None
