"""Votes over answers under equivalence: a member's plurality vote over its own K answers, and the consensus of
several members' votes (the pseudo-labels of the reward modes and the maj@K of evaluation)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from .equivalence import group_equivalent


def plurality_vote(
    answers: Sequence[str | None], threshold: float = 0.0, choices: Sequence[str] | None = None
) -> str | None:
    """The most frequent answer under equivalence, or None (abstain).

    Ties go to the answer seen first (as in TTRL's majority vote). `threshold` is the self-consistency τ:
    the winner's count over ALL responses (unparseable ones included, since they are not a vote of
    confidence) must reach τ, else the member abstains.
    """
    classes = group_equivalent(answers, choices)
    counts = Counter(c for c in classes if c is not None)
    if not counts:
        return None
    winner, count = counts.most_common(1)[0]  # most_common keeps first-seen order among ties
    if count / len(answers) < threshold:
        return None
    return answers[classes.index(winner)]


def consensus(votes: Sequence[str | None], choices: Sequence[str] | None = None) -> str | None:
    """Plurality over other members' votes, abstentions ignored; a tie between classes abstains."""
    classes = group_equivalent(votes, choices)
    counts = Counter(c for c in classes if c is not None).most_common()
    if not counts or (len(counts) > 1 and counts[0][1] == counts[1][1]):
        return None
    return votes[classes.index(counts[0][0])]
