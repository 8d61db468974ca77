"""Signed registry entries: with a cluster secret a worker signs every field it writes, and a
reader routes only to entries that verify, under their own id's key, not expired."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Literal

from nori.cluster_auth import ClusterAuth

# The HMAC purpose of registry entries, and the hash field their signature is stored in.
ENTRY_PURPOSE = "worker-entry"
SIGNATURE_FIELD = "signature"
# How far the gateway's clock may run ahead of a worker's (it lengthens a replay's window too).
CLOCK_SKEW_S = 2.0

RefusalReason = Literal["unsigned", "forged", "expired"]


def entry_message(mapping: Mapping[str, str]) -> bytes:
    """What a signature covers: every field but the signature (known or not), as canonical JSON."""
    covered = {name: value for name, value in mapping.items() if name != SIGNATURE_FIELD}
    return json.dumps(covered, sort_keys=True, separators=(",", ":")).encode()


def sign_entry(auth: ClusterAuth, mapping: Mapping[str, str]) -> dict[str, str]:
    """`mapping` with its signature field added (unchanged in an open cluster)."""
    if not auth.enabled:
        return dict(mapping)
    return {**mapping, SIGNATURE_FIELD: auth.sign(ENTRY_PURPOSE, entry_message(mapping))}


def check_entry(
    auth: ClusterAuth, worker_id: str, mapping: Mapping[str, str], now: float
) -> RefusalReason | None:
    """Why the entry under `worker_id`'s key must not be routed to (unsigned, bad signature,
    another id's entry, expired); None: it may, always in an open cluster."""
    if not auth.enabled:
        return None
    signature = mapping.get(SIGNATURE_FIELD)
    if not signature:
        return "unsigned"
    if not signature.isascii() or not auth.verify(ENTRY_PURPOSE, entry_message(mapping), signature):
        return "forged"
    if mapping.get("worker_id") != worker_id:
        return "forged"
    try:
        expires_at = float(mapping.get("expires_at", ""))
    except ValueError:
        return "forged"
    if expires_at + CLOCK_SKEW_S < now:
        return "expired"
    return None
