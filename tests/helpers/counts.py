"""What `ctx.comm` counted between two `stats.snapshot()`s: per "op/axis", the calls and bytes added."""

from __future__ import annotations

Snapshot = dict[str, dict[str, int]]


def counted_since(before: Snapshot, after: Snapshot) -> Snapshot:
    """The operations whose counts changed, each with its fields' increase (calls, payload and wire bytes)."""
    return {k: {f: v[f] - before.get(k, {}).get(f, 0) for f in v} for k, v in after.items() if v != before.get(k)}
