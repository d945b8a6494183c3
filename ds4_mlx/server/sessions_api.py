"""`GET /v1/sessions`: the live session slots and the figures of recent requests, read-only.

Counts and speeds only, never prompt or answer text (nor token ids, which spell it), and only of the
caller's namespace (its API key, and `?cache_salt=`): the slots of other tenants are listed as busy or
not, nothing more, and their requests not at all. Everything read here is a plain number the worker
thread wrote: no MLX array is touched off that thread.
"""

import time

from ds4_mlx.server.worker import RECENT_REQUESTS


def request_figures(outcome) -> dict:
    """What a request cost: prompt tokens reused from the cache, replayed to rebuild state after a
    trim, and computed anew; the prefill and decode times and speeds (the figures of the log line)."""
    prefill_work = outcome.computed + outcome.replayed
    return {"reused_tokens": outcome.reused, "replayed_tokens": outcome.replayed,
            "computed_tokens": outcome.computed, "completion_tokens": outcome.completion_tokens,
            "prefill_seconds": round(outcome.prefill_s, 6), "decode_seconds": round(outcome.decode_s, 6),
            "prefill_tokens_per_second": _rate(prefill_work, outcome.prefill_s),
            "decode_tokens_per_second": _rate(outcome.completion_tokens, outcome.decode_s)}


def _rate(tokens: int, seconds: float) -> float:
    return round(tokens / seconds, 1) if seconds > 0 else 0.0


def _request(outcome) -> dict:
    # the miss reason without its details: those name token ids; another tenant's tokens are not counted
    miss = outcome.miss.split("(")[0] if outcome.miss else None
    return {"slot": outcome.slot, "finish_reason": outcome.finish_reason, "prompt_tokens": outcome.prompt_tokens,
            "live_tokens": 0 if outcome.foreign else outcome.live, "miss": miss, **request_figures(outcome)}


def sessions_snapshot(worker, info, namespace: str = "") -> dict:
    now = time.monotonic()
    slots = [{"slot": s.index, "busy": s.busy, "tokens": len(s.tokens), "bytes": s.nbytes,
              "idle_seconds": round(now - s.last_used, 1) if s.last_used else None,
              "last_request": _request(s.last_outcome) if s.last_outcome else None}
             if s.namespace == namespace else
             {"slot": s.index, "busy": s.busy, "tokens": None, "bytes": None, "idle_seconds": None,
              "last_request": None}
             for s in worker.slots]
    requests = [{"finished_at": round(at, 3), **_request(outcome)} for at, outcome in list(worker.recent)
                if outcome.namespace == namespace]
    return {"object": "list", "model": info.model_id, "context_length": info.ctx,
            "budget_bytes": worker.budget_bytes, "queued": worker.queued, "slots": slots, "requests": requests}


_FIGURES = {name: {"type": "integer"} for name in ("reused_tokens", "replayed_tokens", "computed_tokens",
                                                    "completion_tokens")} | {
    name: {"type": "number"} for name in ("prefill_seconds", "decode_seconds", "prefill_tokens_per_second",
                                          "decode_tokens_per_second")}
_REQUEST = {"type": "object", "properties": {
    "slot": {"type": "integer"}, "finish_reason": {"type": "string", "enum": ["stop", "length", "abort", "error"]},
    "prompt_tokens": {"type": "integer"}, "live_tokens": {"type": "integer", "description": "held before it"},
    "miss": {"type": ["string", "null"], "description": "why live tokens were dropped: diverged, "
                                                       "empty-slot, other-conversation, other-tenant (its "
                                                       "tokens are not counted), fork; null for a hit"},
    **_FIGURES}}
SESSIONS_SCHEMA = {"type": "object", "properties": {
    "model": {"type": "string"}, "context_length": {"type": "integer"}, "budget_bytes": {"type": "integer"},
    "queued": {"type": "integer"},
    "slots": {"type": "array", "items": {"type": "object", "properties": {
        "slot": {"type": "integer"}, "busy": {"type": "boolean"},
        "tokens": {"type": ["integer", "null"], "description": "null for another tenant's slot"},
        "bytes": {"type": ["integer", "null"]}, "idle_seconds": {"type": ["number", "null"]},
        "last_request": {"oneOf": [_REQUEST, {"type": "null"}]}}}},
    "requests": {"type": "array", "description": f"the last {RECENT_REQUESTS} finished requests, oldest first",
                 "items": {**_REQUEST, "properties": {"finished_at": {"type": "number", "description": "unix time"},
                                                      **_REQUEST["properties"]}}}}}
