"""The Redis users of a private server, one per role, and what each may touch: each role may
write only its own keys, so a gateway cannot forge a worker's registry entry."""

from __future__ import annotations

import secrets
from collections.abc import Mapping
from dataclasses import dataclass

from nori.settings import DEFAULT_NAMESPACE, Role
from nori.state.keys import Keys

# ACL users from Redis 6.0 (before: one password), channel rules from 6.2, `%R~` from 7.0.
ACL_SINCE = (6, 0)
CHANNEL_RULES_SINCE = (6, 2)
READ_ONLY_PATTERNS_SINCE = (7, 0)
# Every role user may run reads, writes and MULTI/EXEC on its keys and the connection commands;
# nothing @dangerous, no pub/sub channels.
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
    gateway: reads registry and block directory, writes request states; prefill: its registry
    entry and the block directory; decode (and colocated): its entry and request states; batch:
    the work queues and counts. Before Redis 7.0 a key pattern also grants writes."""
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
    """An aclfile: the default user (everything, `admin_password`), then each role user."""
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
