"""Live sessions ("slots") and the choice of which one serves a request.

Each slot holds one `Session`: the cache of one conversation. Taking a slot keeps the tokens it shares
with the prompt and discards the rest of it, so a slot is worth `share - discarded` tokens to a request.
A request continues the idle slot worth the most, if that is positive: its own conversation, an
extension, or a prompt the slot already holds whole (a resend after an abort, however short). A share
shorter than `MIN_SHARE` tokens (a common system prompt, or just BOS) does not count otherwise.
Else the request starts over in the idle slot that loses least: an empty one, else the least valuable,
least recently used one; and when another slot (idle or busy) shares at least `MIN_SHARE` tokens with
the prompt, the new slot starts from a snapshot of that one (snapshots are free) and computes only the
rest. So a side request that shares a prefix with a long conversation neither evicts it nor starts
cold. The policy is pure: it reads slots and returns a decision.

Tenants: every request carries a namespace (its API key's, salted by its `cache_salt`), and a slot
holding tokens belongs to the namespace that filled it. A request shares nothing with another
namespace's slot (it reuses, forks from and learns the length of only its own namespace's prefixes), and
takes such a slot over only when no slot is empty or of its own namespace: `foreign` says so, and the
worker then empties the slot before the request starts (or starts it from its own namespace's snapshot).
"""

from dataclasses import dataclass

from ds4_mlx.session import common_prefix

MIN_SHARE = 256


@dataclass
class Slot:
    index: int
    session: object  # ds4_mlx.Session
    busy: bool = False
    last_used: float = 0.0
    nbytes: int = 0  # the session's bytes, refreshed by the worker thread (readers must not touch arrays)
    last_outcome: object = None  # the worker's Outcome of the last request served here (plain numbers)
    namespace: str = ""  # of the requests whose tokens the slot holds

    @property
    def tokens(self) -> list[int]:
        return self.session.tokens


@dataclass
class Placement:
    slot: Slot
    live: int  # tokens the slot held before the request
    common: int  # tokens shared with the prompt (by the fork source, for a fork)
    miss: str | None  # why the live tokens could not all be kept; None for a hit
    source: Slot | None = None  # start from a snapshot of this slot's session
    foreign: bool = False  # the slot's tokens are another namespace's: nothing of them may be kept


def _value(slot: Slot, share: int, prompt_len: int) -> int:
    """Tokens saved minus tokens discarded by serving the prompt from this slot."""
    live = len(slot.tokens)
    if share == prompt_len:
        return share  # the slot holds the whole prompt: what follows it is this prompt's old answer
    if share < MIN_SHARE and share != live:
        return -live
    return share - (live - share)


def place(slots: list[Slot], prompt: list[int], namespace: str = "") -> Placement | None:
    """The slot for `prompt` of a request in `namespace`, or None when it should wait for a slot."""
    idle = [s for s in slots if not s.busy]
    if not idle:
        return None
    ours = {s.index: not s.tokens or s.namespace == namespace for s in slots}
    shares = {s.index: common_prefix(s.tokens, prompt) if ours[s.index] else 0 for s in slots}
    values = {s.index: _value(s, shares[s.index], len(prompt)) for s in slots}
    best = max(idle, key=lambda s: (values[s.index], s.last_used))
    if values[best.index] > 0:
        share = shares[best.index]
        return Placement(best, len(best.tokens), share, _partial_miss(best, share, prompt))
    victim = max(idle, key=lambda s: (ours[s.index], values[s.index], -s.last_used))
    live, share, foreign = len(victim.tokens), shares[victim.index], not ours[victim.index]
    source = max((s for s in slots if s is not victim), key=lambda s: shares[s.index], default=None)
    if source is not None and shares[source.index] >= max(MIN_SHARE, share + 1):
        share = shares[source.index]
        return Placement(victim, live, share, f"fork(from={source.index},share={share},live={live})", source,
                         foreign)
    miss = ("empty-slot" if live == 0 else f"other-tenant(live={live})" if foreign
            else f"other-conversation(share={share},live={live})")
    return Placement(victim, live, share, miss, foreign=foreign)


def _partial_miss(slot: Slot, share: int, prompt: list[int]) -> str | None:
    live = len(slot.tokens)
    if share == live or share == len(prompt):
        return None  # the prompt extends the slot, or is covered by it (a resend after an abort)
    return f"diverged(at={share}, live-token={slot.tokens[share]}, prompt-token={prompt[share]})"
