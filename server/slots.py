"""Live sessions ("slots") and the choice of which one serves a request.

Each slot holds one `Session`: the cache of one conversation. A request goes to the slot whose tokens
share the longest prefix with its prompt, so the session only trims what differs and computes the rest.
A share shorter than `MIN_SHARE` tokens (a common system prompt, or just BOS) is not worth evicting an
other conversation for when an empty slot exists; it still counts when the prompt extends everything the
slot holds, since then nothing is lost. The policy is pure: it reads slots and returns a decision.
"""

from dataclasses import dataclass

MIN_SHARE = 256


@dataclass
class Slot:
    index: int
    session: object  # ds4_mlx.Session
    busy: bool = False
    last_used: float = 0.0

    @property
    def tokens(self) -> list[int]:
        return self.session.tokens


@dataclass
class Placement:
    slot: Slot
    live: int  # tokens the slot held before the request
    common: int  # tokens shared with the prompt
    miss: str | None  # why the live tokens could not all be kept; None for a hit


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def _worth_keeping(share: int, live: int) -> bool:
    return share >= MIN_SHARE or 0 < share == live


def place(slots: list[Slot], prompt: list[int]) -> Placement | None:
    """The slot for `prompt`, or None when it should wait for a busy slot to come free."""
    shares = {s.index: common_prefix(s.tokens, prompt) for s in slots}
    # Longest useful share first; among equals an idle slot, then the most recently used.
    useful = sorted((s for s in slots if _worth_keeping(shares[s.index], len(s.tokens))),
                    key=lambda s: (shares[s.index], not s.busy, s.last_used), reverse=True)
    if useful:
        best = useful[0]
        if best.busy:
            return None  # its own conversation is running: wait rather than start cold elsewhere
        return Placement(best, len(best.tokens), shares[best.index], _partial_miss(best, shares[best.index], prompt))
    idle = [s for s in slots if not s.busy]
    if not idle:
        return None
    # No share worth keeping: an empty slot, else the least recently used one is replaced.
    victim = min(idle, key=lambda s: (len(s.tokens) > 0, s.last_used))
    live, share = len(victim.tokens), shares[victim.index]
    miss = "empty-slot" if live == 0 else f"other-conversation(share={share}<{MIN_SHARE})"
    return Placement(victim, live, share, miss)


def _partial_miss(slot: Slot, share: int, prompt: list[int]) -> str | None:
    live = len(slot.tokens)
    if share == live or share == len(prompt):
        return None  # the prompt extends the slot, or is covered by it (a resend after an abort)
    return f"diverged(at={share}, live-token={slot.tokens[share]}, prompt-token={prompt[share]})"
