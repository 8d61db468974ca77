"""Which CPUs, and how many intra-op threads, each process of a local cluster gets.

From the usable CPUs (lowest first, passed by the caller): prefill and decode pools split in
proportion to their workers (at least one each, a remainder to decode); each worker a consecutive
slice of its pool; a colocated worker both pools; the gateway shares the prefill pool. One
intra-op thread per CPU, the gateway one; `--cpus-*` and `--threads-*` override."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from nori.settings import Role

# The roles with CPUs and threads of their own; a batch runner sits beside the gateway.
PINNED_ROLES: tuple[Role, ...] = ("prefill", "decode", "colocated", "gateway")


def parse_cpu_list(text: str, flag: str = "--cpus") -> frozenset[int]:
    """A CPU list in taskset/cpuset syntax: "0-3,6", "0-7:2" (every second CPU)."""
    cpus: set[int] = set()
    for part in text.replace(" ", "").split(","):
        try:
            cpus.update(_parse_range(part))
        except ValueError as error:
            raise ValueError(f"{flag} {text!r}: {error}") from None
    return frozenset(cpus)


def _parse_range(part: str) -> range:
    if not part:
        raise ValueError("expected CPU numbers or ranges like 0-3,6")
    span, _, step_text = part.partition(":")
    first_text, dash, last_text = span.partition("-")
    try:
        first = int(first_text)
        last = int(last_text) if dash else first
        step = int(step_text) if step_text else 1
    except ValueError:
        raise ValueError(f"{part!r} is not a CPU number or range like 0-3") from None
    if first < 0 or last < first or step < 1:
        raise ValueError(f"{part!r} is not a range of CPU numbers (low-high, low <= high)")
    return range(first, last + 1, step)


def format_cpu_list(cpus: Iterable[int]) -> str:
    """The shortest taskset-style list: {0, 1, 2, 3, 6} -> "0-3,6"."""
    ordered = sorted(set(cpus))
    parts = []
    start = 0
    for index in range(1, len(ordered) + 1):
        if index == len(ordered) or ordered[index] != ordered[index - 1] + 1:
            low, high = ordered[start], ordered[index - 1]
            parts.append(str(low) if low == high else f"{low}-{high}")
            start = index
    return ",".join(parts)


@dataclass(frozen=True)
class Placement:
    name: str  # prefill-0, decode-1, colocated-0, gateway
    role: Role
    cpus: frozenset[int]
    threads: int

    @property
    def cpu_list(self) -> str:
        return format_cpu_list(self.cpus)

    def serve_args(self) -> tuple[str, ...]:
        return ("--cpus", self.cpu_list, "--threads", str(self.threads))

    def env(self) -> dict[str, str]:
        """OpenMP and MKL read these once, when they start."""
        return {"OMP_NUM_THREADS": str(self.threads), "MKL_NUM_THREADS": str(self.threads)}

    def describe(self) -> str:
        threads = "thread" if self.threads == 1 else "threads"
        return f"{self.name:<12} CPUs {self.cpu_list:<10} {self.threads} {threads}"


@dataclass(frozen=True)
class CpuPlan:
    usable: frozenset[int]
    placements: tuple[Placement, ...]

    def placement(self, name: str, role: Role, ordinal: int = 0) -> Placement:
        """The named process's placement; an unforeseen worker takes the `ordinal`-th slice of
        its role, and a role the plan has none of runs on all the plan's CPUs."""
        for placement in self.placements:
            if placement.name == name:
                return placement
        same_role = [p for p in self.placements if p.role == role]
        if same_role:
            model = same_role[ordinal % len(same_role)]
            return Placement(name, role, model.cpus, model.threads)
        return Placement(name, role, self.usable, len(self.usable))

    def describe(self) -> list[str]:
        return [placement.describe() for placement in self.placements]

    def to_dict(self) -> list[dict[str, object]]:
        return [
            {"name": p.name, "role": p.role, "cpus": p.cpu_list, "threads": p.threads}
            for p in self.placements
        ]


@dataclass(frozen=True)
class CpuRequest:
    """What `nori up` asks for: the layout, and the user's overrides (None: the default)."""

    num_prefill: int = 1
    num_decode: int = 1
    colocated: bool = False
    # CPU lists in taskset syntax.
    cpus_prefill: str | None = None
    cpus_decode: str | None = None
    cpus_gateway: str | None = None
    # Intra-op threads of each worker of a role, and of the gateway.
    threads_prefill: int | None = None
    threads_decode: int | None = None
    threads_colocated: int | None = None
    threads_gateway: int | None = None

    def __post_init__(self) -> None:
        if not self.colocated and (self.num_prefill < 1 or self.num_decode < 1):
            raise ValueError("--prefill and --decode must be at least 1")
        for role in PINNED_ROLES:
            threads = getattr(self, f"threads_{role}")
            if threads is not None and threads < 1:
                raise ValueError(f"--threads-{role} must be at least 1, got {threads}")


def plan_cpus(usable: Iterable[int], request: CpuRequest) -> CpuPlan:
    cpus = frozenset(usable)
    if not cpus:
        raise ValueError("no usable CPUs")
    prefill_pool, decode_pool = _pools(cpus, request)
    placements: list[Placement] = []
    if request.colocated:
        union = prefill_pool | decode_pool
        placements.append(
            Placement("colocated-0", "colocated", union, request.threads_colocated or len(union))
        )
        gateway_default = union
    else:
        pools: tuple[tuple[Role, frozenset[int], int, int | None], ...] = (
            ("prefill", prefill_pool, request.num_prefill, request.threads_prefill),
            ("decode", decode_pool, request.num_decode, request.threads_decode),
        )
        for role, pool, count, threads in pools:
            for index, share in enumerate(spread(sorted(pool), count)):
                placements.append(Placement(f"{role}-{index}", role, share, threads or len(share)))
        gateway_default = prefill_pool
    gateway_cpus = (
        parse_usable_cpus(request.cpus_gateway, "--cpus-gateway", cpus) or gateway_default
    )
    placements.append(Placement("gateway", "gateway", gateway_cpus, request.threads_gateway or 1))
    return CpuPlan(cpus, tuple(placements))


def _pools(cpus: frozenset[int], request: CpuRequest) -> tuple[frozenset[int], frozenset[int]]:
    """The prefill and the decode pool: the overrides, the rest of the CPUs, or the split."""
    prefill = parse_usable_cpus(request.cpus_prefill, "--cpus-prefill", cpus)
    decode = parse_usable_cpus(request.cpus_decode, "--cpus-decode", cpus)
    if prefill is not None and decode is not None:
        return prefill, decode
    if prefill is not None:
        return prefill, (cpus - prefill) or cpus
    if decode is not None:
        return (cpus - decode) or cpus, decode
    return split(sorted(cpus), request.num_prefill, request.num_decode)


def parse_usable_cpus(text: str | None, flag: str, usable: frozenset[int]) -> frozenset[int] | None:
    """A CPU list that must name at least one CPU, all of them usable; None for None."""
    if text is None:
        return None
    cpus = parse_cpu_list(text, flag)
    if not cpus:
        raise ValueError(f"{flag} {text!r}: no CPU given")
    missing = cpus - usable
    if missing:
        raise ValueError(
            f"{flag} {text!r}: CPU {format_cpu_list(missing)} is not available to this process "
            f"(available: {format_cpu_list(usable)})"
        )
    return cpus


def split(
    cpus: list[int], num_prefill: int, num_decode: int
) -> tuple[frozenset[int], frozenset[int]]:
    """Disjoint prefill and decode pools, in proportion to the workers, at least one CPU each;
    both the one CPU when there is only one."""
    total = len(cpus)
    if total == 1:
        return frozenset(cpus), frozenset(cpus)
    # Rounded down: a remainder goes to decode, whose steps are the latency-critical ones.
    num_prefill_cpus = total * num_prefill // (num_prefill + num_decode)
    if total >= num_prefill + num_decode:
        low, high = num_prefill, total - num_decode
    else:
        low, high = 1, total - 1
    num_prefill_cpus = min(max(num_prefill_cpus, low), high)
    return frozenset(cpus[:num_prefill_cpus]), frozenset(cpus[num_prefill_cpus:])


def spread(pool: list[int], count: int) -> list[frozenset[int]]:
    """`count` workers over a pool: consecutive slices as even as possible, or one CPU each,
    dealt in turn, when CPUs are fewer than workers."""
    if len(pool) < count:
        return [frozenset({pool[index % len(pool)]}) for index in range(count)]
    base, extra = divmod(len(pool), count)
    shares = []
    start = 0
    for index in range(count):
        size = base + (1 if index < extra else 0)
        shares.append(frozenset(pool[start : start + size]))
        start += size
    return shares
