"""The Redis users of a private server, one per role, and what each may touch.

Each role logs in as a user of its own that may write only the keys that role writes, so that a
gateway, say, cannot forge a worker's registry entry: `role_acl_rules` derives the rules from the
key families of nori.state, `acl_file_text` writes them as redis-server's aclfile, and
`RedisUsers` holds the generated passwords (nori.launch.redis_server starts the server with them).
"""

from __future__ import annotations

import secrets
from collections.abc import Mapping
from dataclasses import dataclass

from nori.settings import DEFAULT_NAMESPACE, Role
from nori.state.keys import Keys

# ACL users exist from Redis 6.0 (older servers get one password for everybody), channel rules
# (`&*`, resetchannels) from 6.2, read-only key patterns (`%R~`) from 7.0; before, a key pattern
# grants read and write.
ACL_SINCE = (6, 0)
CHANNEL_RULES_SINCE = (6, 2)
READ_ONLY_PATTERNS_SINCE = (7, 0)
# What every role's user may run: reads, writes and MULTI/EXEC on its keys, and the connection
# commands (AUTH, HELLO, PING, CLIENT SETNAME...); nothing @dangerous (FLUSHALL, CONFIG, KEYS,
# DEBUG, SHUTDOWN, ACL, MONITOR, ...), no pub/sub channels.
ROLE_COMMANDS = ("resetchannels", "-@all", "+@read", "+@write", "+@transaction", "+@connection",
                 "-@dangerous")  # fmt: skip
# The users, by the role that logs in as each: a colocated worker is a decode worker.
ROLE_USERS: Mapping[Role, str] = {
    "gateway": "nori-gateway",
    "prefill": "nori-prefill",
    "decode": "nori-decode",
    "colocated": "nori-decode",
    "batch": "nori-batch",
}


def role_acl_rules(namespace: str, version: tuple[int, int]) -> dict[str, tuple[str, ...]]:
    """Each role user's ACL rules (after `on >PASSWORD`), from what each role reads and writes:
    - gateway: reads the worker registry (SCAN, HGETALL) and the block directory (SMEMBERS),
      writes request states (`nori.state.requests`);
    - prefill: writes its registry entry and the block directory (`nori.state.block_directory`);
    - decode (and colocated): writes its registry entry and request states;
    - batch (the runners): writes the batches' work queues and counts (`nori.batch.jobs`).

    From Redis 7.0 the gateway's registry and directory patterns are read-only (`%R~`). Before
    7.0 a key pattern grants both, so the gateway stays confined to its namespace's key families
    and ROLE_COMMANDS, and forged worker entries fail their signatures (`nori.state.registry`).
    A worker never gets the other worker role's families.
    """
    keys = Keys(namespace)
    worker, request, block, batch = (
        keys.worker("*"),
        keys.request("*"),
        f"{namespace}:block:*",
        keys.batch_pattern(),
    )
    read = "%R~" if version >= READ_ONLY_PATTERNS_SINCE else "~"
    return {
        "nori-gateway": (
            "resetkeys",
            f"~{request}",
            f"{read}{worker}",
            f"{read}{block}",
            f"{read}{batch}",
        ),
        "nori-prefill": ("resetkeys", f"~{worker}", f"~{block}"),
        "nori-decode": ("resetkeys", f"~{worker}", f"~{request}"),
        "nori-batch": ("resetkeys", f"~{batch}"),
    }


def acl_file_text(
    admin_password: str,
    user_passwords: Mapping[str, str],
    rules: Mapping[str, tuple[str, ...]],
    version: tuple[int, int] = READ_ONLY_PATTERNS_SINCE,
) -> str:
    """An aclfile: the default user (everything, with `admin_password`), then each role user,
    in the rules redis-server `version` knows."""
    for password in (admin_password, *user_passwords.values()):
        if not password or any(c.isspace() for c in password):
            raise ValueError("a Redis password must be non-empty and hold no whitespace")
    channels = version >= CHANNEL_RULES_SINCE
    lines = [f"user default on >{admin_password} ~* {'&* ' if channels else ''}+@all"]
    for user, password in user_passwords.items():
        commands = [c for c in ROLE_COMMANDS if channels or c != "resetchannels"]
        lines.append(" ".join(["user", user, "on", f">{password}", *rules[user], *commands]))
    return "\n".join(lines) + "\n"


@dataclass(frozen=True)
class RedisUsers:
    """The role users of a private server: each user's password (ACL rules from the namespace)."""

    namespace: str
    passwords: Mapping[str, str]

    @classmethod
    def generate(cls, namespace: str = DEFAULT_NAMESPACE) -> RedisUsers:
        names = sorted(set(ROLE_USERS.values()))
        return cls(namespace, {name: secrets.token_urlsafe(24) for name in names})
