"""The flag words: what rides at the end of a call's buckets besides the tensors.

Every call's first bucket ends with ``FIRST`` words, and its last bucket,
when it is another one, with ``LAST`` words. Each word sums (in a boolean
bucket, maxes) over the ranks. The words end with the *check*: ``ID`` bits
of the layout's fingerprint, each sent as the bit and its complement, then
``FAILED`` and ``RETRY``. A call whose ranks all ran one layout, none failed,
lands them as ``expected`` says, exactly (a bit's sum is 0 or the world size,
its complement's the other); any difference shows in some word, on every
rank alike, so the verdict needs no exchange: it is read where the results
land, by a device-side assertion (``_call``), and only a failed assertion
reads the words on the host to say what went wrong. In a reduce-scatter
every rank's chunk carries the words, so that every rank receives their
sums; in an all-gather each rank sends its own, and the receiver adds them.

The first bucket's words before the check:

* ``WEIGHT``: a rank's weight in a weighted mean (summed: the divisor);
* ``MORE``: a rank's bit for ``fr.distributed.join`` (it has a next item).
"""

from __future__ import annotations

__all__ = ["CHECK", "FAILED", "FIRST", "ID", "LAST", "MORE", "RETRY", "WEIGHT", "expected", "extra", "sent"]

# Bits of the fingerprint each check carries: two different layouts whose buckets happen to
# have the same sizes pass it with probability 2**-ID.
ID = 24
CHECK = 2 * ID + 2  # the bits, their complements, FAILED, RETRY
LAST = CHECK
FIRST = 2 + CHECK
WEIGHT, MORE = -FIRST, -FIRST + 1
FAILED, RETRY = -2, -1


def extra(b: int, last: int) -> int:
    """How many flag words end bucket ``b`` of ``last + 1``."""
    if b == 0:
        return FIRST
    return LAST if b == last else 0


def sent(words: int, fingerprint: int) -> list[float]:
    """The words a rank on the layout of ``fingerprint`` sends when nothing failed.

    >>> w = sent(FIRST, 0b101)
    >>> w[WEIGHT], w[-CHECK : -CHECK + 3], w[-CHECK + ID : -CHECK + ID + 3], w[FAILED]
    (0.0, [1.0, 0.0, 1.0], [0.0, 1.0, 0.0], 0.0)
    """
    bits = [float((fingerprint >> i) & 1) for i in range(ID)]
    return [0.0] * (words - CHECK) + bits + [1.0 - b for b in bits] + [0.0, 0.0]


def expected(words: int, fingerprint: int, world: int, maximum: bool) -> list[float]:
    """The check's words as they land when every rank ran this layout and none failed."""
    scale = 1.0 if maximum else float(world)
    return [w * scale for w in sent(words, fingerprint)[-CHECK:]]
