"""The flag words: what rides at the end of a call's buckets besides the tensors.

Every call's first bucket ends with ``FIRST`` words, and its last bucket,
when it is another one, with ``LAST`` words; a bucket's last two words are
always ``FAILED`` and ``RETRY``. Each word sums (in a boolean bucket,
maxes) over the ranks, and only "> 0" is read, except the weight, a
number. In a reduce-scatter every rank's chunk carries the words, so that
every rank receives their sums; in an all-gather each rank sends its own,
and the receiver adds them up.

The first bucket's words:

* ``OFF``: a rank runs another layout than this one (it mirrors this
  layout's first collective, see ``_agree``);
* ``ON``: a rank runs this layout on the fast path (the check rides here);
* ``WEIGHT``: a rank's weight in a weighted mean (summed: the divisor);
* ``MORE``: a rank's bit for ``fr.distributed.join`` (it has a next item);
* one word per layout the group knows (``KNOWN`` of them, from
  ``KNOWN_AT``): 0 where a rank runs that one, else 1;
* ``FAILED``: a rank's call failed (its error is then named to every rank);
* ``RETRY``: a rank must run the call again another way (every rank then does).
"""

from __future__ import annotations

__all__ = [
    "FAILED",
    "FIRST",
    "KNOWN",
    "KNOWN_AT",
    "LAST",
    "MORE",
    "OFF",
    "ON",
    "RETRY",
    "WEIGHT",
    "clean",
    "extra",
]

# How many layouts each group remembers as run by every rank (``_agree``).
KNOWN = 8
FIRST = 4 + KNOWN + 2
LAST = 2
OFF, ON, WEIGHT, MORE = range(-FIRST, -FIRST + 4)
KNOWN_AT = -FIRST + 4
FAILED, RETRY = -2, -1


def extra(b: int, last: int) -> int:
    """How many flag words end bucket ``b`` of ``last + 1``."""
    if b == 0:
        return FIRST
    return LAST if b == last else 0


def clean(words: int) -> list[float]:
    """The words of a call on its own layout, fast path, nothing failed: ``ON`` set, zeros else.

    >>> clean(FIRST)[ON], clean(LAST)
    (1.0, [0.0, 0.0])
    """
    out = [0.0] * words
    if words == FIRST:
        out[ON] = 1.0
    return out
