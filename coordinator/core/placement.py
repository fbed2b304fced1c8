"""Topology-aware gang placement (docs/placement.md).

Pure: no I/O, no clock, no asyncio/grpc. The leader loop calls :func:`place`
once per pending gang per cycle with one immutable view of the inventory and
gets back either a :class:`Placement` (who goes where, with a one-line reason)
or an :class:`Unplaceable` (why not, as per-domain shortfalls). Infeasibility
is data, never an exception.

The algorithm, in order of what matters most:

1. **Capacity.** A node's *member capacity* for a request is
   ``min(free matching GPUs // gpus_per_member, free usable NICs // nics_per_member)``.
   A member never straddles nodes, so this count is exact; a domain's capacity
   is the sum over its nodes. NVLink islands, NIC affinity and rails are
   preferences, never part of feasibility.
2. **Span.** Levels are tried tightest first (NVLink domain, node, leaf,
   spine, AZ, region); the first level at which one domain's capacity holds
   the whole gang wins. ``required`` caps that search; a gang crosses AZs
   only when it may (``allow_cross_az`` or ``required: region``) and no single
   AZ holds it.
3. **Best fit.** Among the domains of that level that fit, take the one with
   the fewest member slots free, then the fewest free GPUs, then the fewest
   nodes needed, then the one in the fuller leaf/spine/AZ, then the smallest
   name: large domains stay whole for the gangs that need them. (One node:
   one that gives each member its own NVLink island first; NVLink level:
   a single node before a multi-node clique.)
4. **Spread inside the chosen domain.** Recursively over its children
   (AZs, spines, leaves, NVLink cliques, nodes): while no child can take the
   rest, take the child with most capacity (fewest children in total); the
   last child is again the best fit for the remainder.
5. **Inside a node.** All of a node's members on one NVLink island if one has
   room, else each member on its own best-fit island, else on the fewest
   islands; GPUs ordered by the PCIe distance to their closest free NIC,
   then by rail alignment, then by index; NICs by (closest, total) PCIe
   distance to the member's GPUs, then rail alignment, then name. On rail-optimised fabrics (``Nic.rail >= 0``) the member
   with local index *i* on every node gets the rails the first node's member
   *i* got, so rank peers talk over one rail switch.
6. **Ranks.** Nodes ordered by (az, spine, leaf, nvlink_domain, node); a
   node's members get consecutive ranks, so rank neighbours are network
   neighbours.

Every choice ends in a comparison of unique names, so the answer does not
depend on the order of the input (the tests shuffle it).

Speed: one linear pass over the nodes per call plus work proportional to the
chosen domain. Static per-node facts (domain names, GPU models, islands, the
GPU↔NIC distance table) come from a :class:`FabricIndex`; callers that place
many gangs per cycle build it once (``FabricIndex.build``) and refresh it when
topologies change (``index.refreshed``); without one, ``place`` builds a
throw-away index each call.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Mapping, Sequence, Union

from phalanx.model import Level, PcieDistance
from phalanx.spec import GangSpec
from phalanx.topology import NodeTopology

# Shortfalls are for humans (``explain``) and for the NO vote of a prepare: a
# few best candidates per level say enough, and keep the record small.
SHORTFALLS_PER_LEVEL = 5

_SYS = int(PcieDistance.SYS)
_NO_NICS: frozenset[str] = frozenset()


# --- the request and the inventory ------------------------------------------


@dataclass(frozen=True)
class NodeView:
    """One node as the leader sees it this cycle: topology plus what is free."""

    topology: NodeTopology
    free_gpus: frozenset[int]
    free_nics: frozenset[str]
    ready: bool = True

    @property
    def name(self) -> str:
        return self.topology.node

    @property
    def az(self) -> str:
        return self.topology.az


@dataclass(frozen=True)
class PlacementRequest:
    """What placement needs to know about a gang; see :meth:`from_spec`."""

    gang: str
    members: int
    gpus_per_member: int
    rdma_nics_per_member: int = 0
    gpu_model: str = ""
    required: Level | None = None
    preferred: Level | None = None
    allow_cross_az: bool = False
    azs: frozenset[str] | None = None  # restrict to these AZs (None = all given nodes)

    def __post_init__(self) -> None:
        # The spec validator already refuses these; a request built by hand
        # that gets them wrong is a bug in the caller, not a shortfall.
        if self.members < 1:
            raise ValueError(f"members must be at least 1, got {self.members}")
        if self.gpus_per_member < 1:
            raise ValueError(f"gpus_per_member must be at least 1, got {self.gpus_per_member}")
        if self.rdma_nics_per_member < 0:
            raise ValueError(f"rdma_nics_per_member must not be negative, got {self.rdma_nics_per_member}")
        if self.required is not None and self.preferred is not None and self.preferred > self.required:
            raise ValueError(
                f"preferred level {self.preferred.label} is wider than required level {self.required.label}"
            )

    @property
    def may_span_azs(self) -> bool:
        return self.allow_cross_az or self.required == Level.REGION

    @property
    def gpus_needed(self) -> int:
        return self.members * self.gpus_per_member

    @property
    def limit(self) -> Level:
        """The widest span this request accepts."""
        if self.required is not None:
            return self.required
        return Level.REGION if self.may_span_azs else Level.AZ

    def describe(self) -> str:
        text = f"{self.members} × {self.gpus_per_member} GPU"
        if self.rdma_nics_per_member:
            text += f" + {self.rdma_nics_per_member} NIC"
        if self.gpu_model:
            text += f" ({self.gpu_model})"
        return text

    @classmethod
    def from_spec(cls, gang: str, spec: GangSpec, azs: frozenset[str] | None = None) -> "PlacementRequest":
        return cls(
            gang=gang,
            members=spec.members,
            gpus_per_member=spec.resources.gpus,
            rdma_nics_per_member=spec.resources.rdma_nics,
            gpu_model=spec.resources.gpu_model,
            required=spec.topology.required,
            preferred=spec.topology.preferred,
            allow_cross_az=spec.topology.may_span_azs,
            azs=azs,
        )


# --- the answers ---------------------------------------------------------------


@dataclass(frozen=True)
class MemberSlot:
    rank: int
    az: str
    node: str
    gpus: tuple[int, ...]
    nics: tuple[str, ...]


@dataclass(frozen=True)
class Placement:
    members: tuple[MemberSlot, ...]  # ordered by rank, ranks 0..n-1
    span: Level  # lowest level whose one domain holds every member
    domain: str  # that domain's name (NodeTopology.domain(span))
    reason: str  # one line: why this choice (logged once, shown by `explain`)
    preferred_met: bool = True  # False when the request's preferred level could not be met

    def by_az(self) -> dict[str, dict[str, tuple[tuple[int, ...], tuple[str, ...]]]]:
        """The plan as the reservation protocol wants it: az -> node -> (gpus, nics)."""
        acc: dict[str, dict[str, tuple[list[int], list[str]]]] = {}
        for slot in self.members:
            gpus, nics = acc.setdefault(slot.az, {}).setdefault(slot.node, ([], []))
            gpus.extend(slot.gpus)
            nics.extend(slot.nics)
        return {
            az: {node: (tuple(sorted(g)), tuple(sorted(n))) for node, (g, n) in sorted(nodes.items())}
            for az, nodes in sorted(acc.items())
        }

    def azs(self) -> frozenset[str]:
        return frozenset(slot.az for slot in self.members)

    def nodes(self) -> tuple[str, ...]:
        """Distinct node names in rank order."""
        seen: dict[str, None] = {}
        for slot in self.members:
            seen.setdefault(slot.node, None)
        return tuple(seen)


@dataclass(frozen=True)
class Shortfall:
    """How close one domain comes to hosting the gang."""

    level: Level
    domain: str
    gpus_free: int  # free GPUs of the requested model on ready nodes
    gpus_total: int  # GPUs of the requested model on all nodes in scope, ready or not
    gpus_needed: int
    members_fit: int  # members this one domain could host (capped at members_needed)
    members_needed: int
    reason: str

    def describe(self) -> str:
        text = (
            f"{self.level.label} {self.domain}: {self.gpus_free} of {self.gpus_total} GPUs free, "
            f"{self.members_fit} of {self.members_needed} members fit"
        )
        return f"{text} ({self.reason})" if self.reason else text


@dataclass(frozen=True)
class Unplaceable:
    reason: str  # one line summary
    shortfalls: tuple[Shortfall, ...]  # the limiting level first, best candidates first, SHORTFALLS_PER_LEVEL each


PlacementResult = Union[Placement, Unplaceable]


# --- static facts about nodes (the index) -----------------------------------------


class _NodeFacts:
    """What placement needs from a NodeTopology, precomputed once.

    Domain names are built exactly as NodeTopology.domain() builds them. The
    GPU↔NIC distance table is built lazily: only nodes that receive members
    need it, and the topology's own ``distance()`` is a linear scan.
    """

    __slots__ = (
        "topology", "key", "region", "az", "spine", "leaf", "clique", "node_dom", "rank_key", "gpu_ids",
        "_usable_nics", "_islands", "_island_of", "_models", "_by_model", "_dist", "_rail",
    )

    def __init__(self, topo: NodeTopology) -> None:
        # Only what the capacity scan over every node needs is computed here;
        # the rest waits until a node is a candidate (most never are).
        az = topo.az
        self.topology = topo
        self.key = (az, topo.node)
        self.region = topo.region or "region"
        self.az = az
        self.spine = f"{az}/{topo.spine or '-'}"
        self.leaf = f"{self.spine}/{topo.leaf or '-'}"
        self.clique = f"{az}/nvl:{topo.nvlink_domain}" if topo.nvlink_domain else ""
        self.node_dom = f"{az}/{topo.node}"
        self.rank_key = (az, topo.spine, topo.leaf, topo.nvlink_domain, topo.node)
        self.gpu_ids = frozenset([gpu.index for gpu in topo.gpus])
        self._usable_nics: frozenset[str] | None = None
        self._islands: tuple[tuple[int, frozenset[int]], ...] | None = None
        self._island_of: dict[int, int] = {}
        self._models: tuple[tuple[str, frozenset[int]], ...] | None = None
        self._by_model: dict[str, frozenset[int]] = {"": self.gpu_ids}
        self._dist: dict[tuple[int, str], int] | None = None
        self._rail: dict[str, int] | None = None

    @property
    def usable_nics(self) -> frozenset[str]:
        if self._usable_nics is None:
            self._usable_nics = frozenset([n.name for n in self.topology.nics if n.usable])
        return self._usable_nics

    @property
    def islands(self) -> tuple[tuple[int, frozenset[int]], ...]:
        """(island id, GPU indices) pairs, by island id."""
        if self._islands is None:
            groups: dict[int, set[int]] = {}
            for gpu in self.topology.gpus:
                groups.setdefault(gpu.nvlink_island, set()).add(gpu.index)
                self._island_of[gpu.index] = gpu.nvlink_island
            self._islands = tuple((i, frozenset(ids)) for i, ids in sorted(groups.items()))
        return self._islands

    def island_of(self, gpu: int) -> int:
        if self._islands is None:
            self.islands  # noqa: B018 - fills _island_of
        return self._island_of[gpu]

    def eligible(self, model: str) -> frozenset[int]:
        """GPUs whose model contains ``model`` (case-insensitive); all if empty."""
        found = self._by_model.get(model)
        if found is None:
            if self._models is None:
                groups: dict[str, set[int]] = {}
                for gpu in self.topology.gpus:
                    groups.setdefault(gpu.model.lower(), set()).add(gpu.index)
                self._models = tuple((m, frozenset(ids)) for m, ids in sorted(groups.items()))
            needle = model.lower()
            found = frozenset().union(*(ids for m, ids in self._models if needle in m))
            self._by_model[model] = found  # memo: a pure function of the topology
        return found

    def distance(self, gpu: int, nic: str) -> int:
        if self._dist is None:
            self._dist = {(l.gpu, l.nic): int(l.distance) for l in self.topology.links}
        return self._dist.get((gpu, nic), _SYS)

    def rail(self, nic: str) -> int:
        if self._rail is None:
            self._rail = {n.name: n.rail for n in self.topology.nics}
        return self._rail.get(nic, -1)


class FabricIndex:
    """Static facts about the fleet's nodes, reusable across calls and cycles.

    Building facts for 847 nodes costs several milliseconds, the bulk of a
    placement; a leader that keeps one index and refreshes it when a node
    record changes pays that once. Entries are matched to NodeViews by the
    *identity* of their NodeTopology (an equality check would cost as much as
    a rebuild), so keep topology objects stable between cycles; a view whose
    topology is not in the index is simply computed on the fly.
    """

    __slots__ = ("_facts", "by_id")

    def __init__(self, facts: Mapping[tuple[str, str], _NodeFacts] | None = None) -> None:
        self._facts: dict[tuple[str, str], _NodeFacts] = dict(facts or {})
        # Keyed by id() for the hot loop; a hit is only trusted after an
        # identity check, so a recycled id can never return stale facts.
        self.by_id: dict[int, _NodeFacts] = {id(f.topology): f for f in self._facts.values()}

    @classmethod
    def build(cls, topologies: Iterable[NodeTopology]) -> "FabricIndex":
        return cls({(t.az, t.node): _NodeFacts(t) for t in topologies})

    def refreshed(self, topologies: Iterable[NodeTopology]) -> "FabricIndex":
        """A new index for ``topologies`` that reuses every unchanged entry."""
        out: dict[tuple[str, str], _NodeFacts] = {}
        for t in topologies:
            old = self._facts.get((t.az, t.node))
            out[(t.az, t.node)] = old if old is not None and old.topology is t else _NodeFacts(t)
        return FabricIndex(out)

    def joined(self, other: "FabricIndex") -> "FabricIndex":
        """One index with the entries of both, no entry recomputed (keys are
        (AZ, node): indexes of different AZs do not collide; ``other``'s
        entry wins if they do)."""
        return FabricIndex({**self._facts, **{f.key: f for f in other.by_id.values()}})

    def __len__(self) -> int:
        return len(self._facts)

    def facts(self, topo: NodeTopology) -> _NodeFacts:
        found = self.by_id.get(id(topo))
        if found is not None and found.topology is topo:
            return found
        return _NodeFacts(topo)


# --- per-call working state -----------------------------------------------------------


class _Entry:
    """One ready node's free capacity for this request."""

    __slots__ = ("facts", "free", "nics", "cap", "gpu_cap", "nfree", "name", "parent")

    def __init__(self, facts: _NodeFacts, free: frozenset[int], nics: frozenset[str], cap: int, gpu_cap: int,
                 parent: "_Domain") -> None:
        self.facts = facts
        self.free = free
        self.nics = nics
        self.cap = cap
        self.gpu_cap = gpu_cap
        self.nfree = len(free)
        self.name = facts.node_dom
        self.parent: _Domain | None = parent  # its leaf


class _Domain:
    """Aggregate capacity of one domain (leaf, spine, AZ, region or NVLink clique)."""

    __slots__ = ("level", "name", "cap", "gpu_cap", "nfree", "total", "nodes", "not_ready", "children", "entries",
                 "parent")

    def __init__(self, level: Level, name: str) -> None:
        self.level = level
        self.name = name
        self.cap = 0
        self.gpu_cap = 0
        self.nfree = 0
        self.total = 0
        self.nodes = 0
        self.not_ready = 0
        self.children: list[_Domain] = []
        self.entries: list[_Entry] = []  # leaves and cliques: the nodes with capacity
        self.parent: _Domain | None = None

    def absorb(self, child: "_Domain") -> None:
        child.parent = self
        self.cap += child.cap
        self.gpu_cap += child.gpu_cap
        self.nfree += child.nfree
        self.total += child.total
        self.nodes += child.nodes
        self.not_ready += child.not_ready
        self.children.append(child)


_Unit = Union[_Entry, _Domain]


def _fit_key(u: _Unit) -> tuple[int, int, str]:
    # Best fit: the unit with the least room that still fits, so the roomy
    # ones stay whole for bigger gangs.
    return (u.cap, u.nfree, u.name)


def _big_key(u: _Unit) -> tuple[int, int, str]:
    # While nothing fits the rest, take the roomiest unit: fewest units in all.
    return (-u.cap, u.nfree, u.name)


class _Inventory:
    """The request's view of the fleet: capacity per node and per domain."""

    def __init__(self, request: PlacementRequest, nodes: Sequence[NodeView], index: FabricIndex) -> None:
        g = request.gpus_per_member
        r = request.rdma_nics_per_member
        model = request.gpu_model
        azs = request.azs
        leaves: dict[str, _Domain] = {}
        leaf_parent: dict[str, tuple[str, str, str]] = {}
        seen: set[str] = set()
        self.entries: list[_Entry] = []
        self.cliques: dict[str, _Domain] = {}
        self.not_ready = 0
        self.wrong_model = 0
        # Nodes without room for one member matter only to the shortfall of a
        # gang that must sit on one node; keep them just for that case.
        self.full: list[_Entry] = []
        keep_full = request.limit <= Level.NODE
        # This loop runs over every node on every call: locals and the
        # identity-keyed index lookup keep it near a microsecond per node.
        by_id = index.by_id
        add_entry = self.entries.append
        for view in nodes:
            topo = view.topology
            if azs is not None and topo.az not in azs:
                continue
            f = by_id.get(id(topo))
            if f is None or f.topology is not topo:
                f = _NodeFacts(topo)
            before = len(seen)
            seen.add(f.node_dom)
            if len(seen) == before:
                raise ValueError(f"node {topo.node!r} appears twice in AZ {topo.az!r}")
            leaf = leaves.get(f.leaf)
            if leaf is None:
                leaf = leaves[f.leaf] = _Domain(Level.LEAF, f.leaf)
                leaf_parent[f.leaf] = (f.spine, f.az, f.region)
            eligible = f.eligible(model) if model else f.gpu_ids
            if not eligible:
                if model:
                    self.wrong_model += 1
                continue
            leaf.total += len(eligible)
            leaf.nodes += 1
            if not view.ready:
                # A node that is not ready may be fenced or dying: never place
                # on it, but count it so the shortfall can say why.
                leaf.not_ready += 1
                self.not_ready += 1
                continue
            # Subset checks allocate nothing; the intersections they usually
            # save would be a few thousand short-lived sets per call, which is
            # what drives the garbage collector (and the p99) in a big fleet.
            free = view.free_gpus
            if not free <= eligible:
                free = free & eligible
            nfree = len(free)
            gpu_cap = nfree // g
            leaf.nfree += nfree
            leaf.gpu_cap += gpu_cap
            if r:
                nics = view.free_nics
                if not nics <= f.usable_nics:
                    nics = nics & f.usable_nics
                cap = min(gpu_cap, len(nics) // r)
            else:
                nics = _NO_NICS
                cap = gpu_cap
            if cap <= 0:
                if keep_full:
                    self.full.append(_Entry(f, free, nics, 0, gpu_cap, leaf))
                continue
            entry = _Entry(f, free, nics, cap, gpu_cap, leaf)
            leaf.cap += cap
            leaf.entries.append(entry)
            add_entry(entry)
            if f.clique:
                clique = self.cliques.get(f.clique)
                if clique is None:
                    clique = self.cliques[f.clique] = _Domain(Level.NVLINK_DOMAIN, f.clique)
                clique.cap += cap
                clique.gpu_cap += gpu_cap
                clique.nfree += nfree
                clique.entries.append(entry)
        # Roll leaves up into spines, AZs and regions: a few hundred leaves,
        # far cheaper than adding every node into four dicts.
        self.leaves = leaves
        self.spines: dict[str, _Domain] = {}
        self.azs: dict[str, _Domain] = {}
        self.regions: dict[str, _Domain] = {}
        spine_parent: dict[str, tuple[str, str]] = {}
        for name in sorted(leaves):
            spine_name, az, region = leaf_parent[name]
            spine = self.spines.get(spine_name)
            if spine is None:
                spine = self.spines[spine_name] = _Domain(Level.SPINE, spine_name)
                spine_parent[spine_name] = (az, region)
            spine.absorb(leaves[name])
        az_parent: dict[str, str] = {}
        for name in sorted(self.spines):
            az, region = spine_parent[name]
            dom = self.azs.get(az)
            if dom is None:
                dom = self.azs[az] = _Domain(Level.AZ, az)
                az_parent[az] = region
            dom.absorb(self.spines[name])
        for name in sorted(self.azs):
            region = az_parent[name]
            dom = self.regions.get(region)
            if dom is None:
                dom = self.regions[region] = _Domain(Level.REGION, region)
            dom.absorb(self.azs[name])
        self.max_node_cap = max((e.cap for e in self.entries), default=0)

    def domains(self, level: Level) -> Iterable[_Domain]:
        if level == Level.LEAF:
            return self.leaves.values()
        if level == Level.SPINE:
            return self.spines.values()
        if level == Level.AZ:
            return self.azs.values()
        if level == Level.REGION:
            return self.regions.values()
        raise ValueError(level)


def _island_cap(entry: _Entry, g: int, r: int) -> int:
    """Members that fit on the node's roomiest NVLink island (all together)."""
    islands = entry.facts.islands
    if len(islands) == 1:
        return entry.cap
    best = max(len(entry.free & ids) for _, ids in islands) // g
    if r:
        best = min(best, len(entry.nics) // r)
    return best


def _island_split(entry: _Entry, g: int, members: int) -> int:
    """How many of ``members`` on this node could not sit on one island each."""
    islands = entry.facts.islands
    if len(islands) == 1:
        return 0
    per_island = sum(len(entry.free & ids) // g for _, ids in islands)
    return max(0, min(members, entry.cap) - per_island)


def _min_nodes(unit: _Unit, members: int) -> int:
    """Fewest nodes of ``unit`` that hold ``members`` (largest nodes first)."""
    if isinstance(unit, _Entry):
        return 1
    caps = sorted((e.cap for e in _entries_of(unit)), reverse=True)
    total = 0
    for n, cap in enumerate(caps, 1):
        total += cap
        if total >= members:
            return n
    return len(caps) + 1


def _entries_of(dom: _Domain) -> list[_Entry]:
    if dom.entries or not dom.children:
        return dom.entries
    out: list[_Entry] = []
    for child in dom.children:
        out.extend(_entries_of(child))
    return out


def _children(unit: _Domain) -> list[_Unit]:
    if unit.level != Level.LEAF:
        return list(unit.children) if unit.children else list(unit.entries)
    # Inside a leaf, nodes of one multi-node NVLink clique travel together so a
    # gang that spills over a leaf still keeps as much traffic on NVLink as it can.
    out: list[_Unit] = []
    groups: dict[str, _Domain] = {}
    for e in unit.entries:
        if not e.facts.clique:
            out.append(e)
            continue
        grp = groups.get(e.facts.clique)
        if grp is None:
            grp = groups[e.facts.clique] = _Domain(Level.NVLINK_DOMAIN, e.facts.clique)
            out.append(grp)
        grp.cap += e.cap
        grp.nfree += e.nfree
        grp.entries.append(e)
    return out


def _spread(unit: _Unit, members: int, out: list[tuple[_Entry, int]]) -> None:
    """Give ``members`` to ``unit``'s nodes: fewest children, best fit last."""
    if isinstance(unit, _Entry):
        out.append((unit, members))
        return
    avail = sorted((c for c in _children(unit) if c.cap > 0), key=_big_key)
    remaining = members
    i = 0
    while remaining > 0:
        if avail[i].cap >= remaining:
            # avail is sorted roomiest first, so the children that fit are a prefix.
            j = i
            while j + 1 < len(avail) and avail[j + 1].cap >= remaining:
                j += 1
            best = min(avail[i : j + 1], key=_fit_key)
            _spread(best, remaining, out)
            return
        _spread(avail[i], avail[i].cap, out)
        remaining -= avail[i].cap
        i += 1


# --- inside a node --------------------------------------------------------------


def _assign_on_node(
    entry: _Entry, count: int, request: PlacementRequest, rails: dict[int, frozenset[int]]
) -> list[tuple[tuple[int, ...], tuple[str, ...]]]:
    """GPUs and NICs for ``count`` members on one node, local index 0..count-1."""
    f = entry.facts
    g = request.gpus_per_member
    r = request.rdma_nics_per_member
    free_by_island: dict[int, list[int]] = {}
    for gpu in sorted(entry.free):
        free_by_island.setdefault(f.island_of(gpu), []).append(gpu)
    nics = set(entry.nics)
    # All of the node's members on one island when one has room: they are the
    # same gang and talk to each other over NVLink that way.
    whole = [i for i, ids in free_by_island.items() if len(ids) >= count * g]
    only = min(whole, key=lambda i: (len(free_by_island[i]), i)) if whole and count > 1 else None
    out: list[tuple[tuple[int, ...], tuple[str, ...]]] = []
    for local in range(count):
        target = rails.get(local)
        gpus = _pick_gpus(f, free_by_island, g, only, nics if r else set(), target)
        chosen_nics = _pick_nics(f, gpus, nics, r, target) if r else ()
        for gpu in gpus:
            free_by_island[f.island_of(gpu)].remove(gpu)
        nics.difference_update(chosen_nics)
        if chosen_nics and target is None:
            got = frozenset(f.rail(n) for n in chosen_nics)
            if -1 not in got:
                rails[local] = got
        out.append((tuple(sorted(gpus)), tuple(sorted(chosen_nics))))
    return out


def _gpu_key(f: _NodeFacts, gpu: int, nics: set[str], target: frozenset[int] | None) -> tuple[int, int, int]:
    if not nics:
        return (0, 0, gpu)
    # The GPU's closest free NIC decides: a GPU whose own NIC is taken would
    # push its traffic across the PCIe root or the socket link.
    if target is None:
        return (min(f.distance(gpu, n) for n in nics), 0, gpu)
    dist, miss = min((f.distance(gpu, n), 0 if f.rail(n) in target else 1) for n in nics)
    return (dist, miss, gpu)


def _pick_gpus(
    f: _NodeFacts,
    free_by_island: dict[int, list[int]],
    g: int,
    only: int | None,
    nics: set[str],
    target: frozenset[int] | None,
) -> list[int]:
    if only is not None:
        islands = [only]
    else:
        fitting = [i for i, ids in free_by_island.items() if len(ids) >= g]
        if fitting:
            islands = [min(fitting, key=lambda i: (len(free_by_island[i]), i))]
        else:
            # No island has room: use as few islands as possible, roomiest first.
            islands = sorted((i for i, ids in free_by_island.items() if ids), key=lambda i: (-len(free_by_island[i]), i))
    picked: list[int] = []
    for island in islands:
        need = g - len(picked)
        if need <= 0:
            break
        ranked = sorted(free_by_island[island], key=lambda gpu: _gpu_key(f, gpu, nics, target))
        picked.extend(ranked[:need])
    return picked


def _pick_nics(f: _NodeFacts, gpus: list[int], nics: set[str], r: int, target: frozenset[int] | None) -> tuple[str, ...]:
    def key(nic: str) -> tuple[int, int, int, str]:
        dists = [f.distance(gpu, nic) for gpu in gpus]
        rail = f.rail(nic)
        miss = 0 if target is None or rail in target else 1
        return (min(dists), sum(dists), miss, nic)

    return tuple(sorted(nics, key=key)[:r])


# --- span -------------------------------------------------------------------------


def span_of(members: Sequence[tuple[NodeTopology, Sequence[int]]]) -> tuple[Level, str]:
    """The lowest level whose one domain holds every member, and its name.

    ``members`` pairs each member's node with its GPUs. One node with all GPUs
    on one NVLink island, or nodes of one multi-node NVLink clique, count as
    the NVLINK_DOMAIN level. Used by the engine on its own answer, by tests,
    and by the benchmark to score other placers the same way.
    """
    if not members:
        raise ValueError("span_of needs at least one member")
    topos: dict[tuple[str, str], NodeTopology] = {}
    gpus_by_node: dict[tuple[str, str], set[int]] = {}
    for topo, gpus in members:
        key = (topo.az, topo.node)
        topos[key] = topo
        gpus_by_node.setdefault(key, set()).update(gpus)
    nodes = list(topos.values())
    first = nodes[0]
    if len(nodes) == 1:
        if first.nvlink_domain:
            return Level.NVLINK_DOMAIN, first.domain(Level.NVLINK_DOMAIN)
        island = {g.index: g.nvlink_island for g in first.gpus}
        used = {island.get(gpu, -1) for gpu in gpus_by_node[(first.az, first.node)]}
        if len(used) <= 1:
            return Level.NVLINK_DOMAIN, first.domain(Level.NVLINK_DOMAIN)
        return Level.NODE, first.domain(Level.NODE)
    if all(t.nvlink_domain for t in nodes) and len({t.domain(Level.NVLINK_DOMAIN) for t in nodes}) == 1:
        return Level.NVLINK_DOMAIN, first.domain(Level.NVLINK_DOMAIN)
    for level in (Level.LEAF, Level.SPINE, Level.AZ, Level.REGION):
        names = {t.domain(level) for t in nodes}
        if len(names) == 1:
            return level, first.domain(level)
    # Only reachable by a placer that crossed regions; the engine never does.
    return Level.REGION, "+".join(sorted({t.domain(Level.REGION) for t in nodes}))


def violations(request: PlacementRequest, placement: Placement, nodes: Sequence[NodeView]) -> list[str]:
    """Every way ``placement`` breaks the capacity and topology rules for
    ``request`` on ``nodes``; empty when it is sound (invariants
    are code). Used by the property tests after every answer; a driver may
    run it before preparing a plan it got from elsewhere."""
    out: list[str] = []
    views = {(v.az, v.name): v for v in nodes}
    if [s.rank for s in placement.members] != list(range(request.members)):
        out.append(f"ranks are {[s.rank for s in placement.members]}, expected 0..{request.members - 1}")
    used: set[tuple[str, str, object]] = set()
    where: list[tuple[str, str]] = []
    members: list[tuple[NodeTopology, tuple[int, ...]]] = []
    for s in placement.members:
        v = views.get((s.az, s.node))
        if v is None:
            out.append(f"rank {s.rank}: node {s.az}/{s.node} is not in the inventory")
            continue
        where.append((s.az, s.node))
        members.append((v.topology, s.gpus))
        if not v.ready:
            out.append(f"rank {s.rank}: node {s.az}/{s.node} is not ready")
        if request.azs is not None and s.az not in request.azs:
            out.append(f"rank {s.rank}: AZ {s.az} is outside {sorted(request.azs)}")
        needle = request.gpu_model.lower()
        models = {g.index: g.model.lower() for g in v.topology.gpus}
        usable = {n.name for n in v.topology.nics if n.usable}
        if len(s.gpus) != request.gpus_per_member or len(s.nics) != request.rdma_nics_per_member:
            out.append(f"rank {s.rank}: {len(s.gpus)} GPUs and {len(s.nics)} NICs, expected "
                       f"{request.gpus_per_member} and {request.rdma_nics_per_member}")
        for gpu in s.gpus:
            if gpu not in v.free_gpus or gpu not in models or needle not in models[gpu]:
                out.append(f"rank {s.rank}: GPU {gpu} on {s.node} is not a free {request.gpu_model or 'GPU'}")
        for nic in s.nics:
            if nic not in v.free_nics or nic not in usable:
                out.append(f"rank {s.rank}: NIC {nic} on {s.node} is not free and usable")
        for dev in (*(("gpu", g) for g in s.gpus), *(("nic", n) for n in s.nics)):
            if (s.az, s.node, dev) in used:
                out.append(f"rank {s.rank}: {dev[0]} {dev[1]} on {s.node} is given twice")
            used.add((s.az, s.node, dev))
    runs = [w for i, w in enumerate(where) if i == 0 or where[i - 1] != w]
    if len(runs) != len(set(runs)):
        out.append("the ranks of a node are not consecutive")
    if members and len(members) == len(placement.members):
        span, domain = span_of(members)
        if (span, domain) != (placement.span, placement.domain):
            out.append(f"span says {placement.span.label} {placement.domain}, members are in {span.label} {domain}")
        if span > request.limit:
            out.append(f"span {span.label} is wider than the limit {request.limit.label}")
    if len(placement.azs()) > 1 and not request.may_span_azs:
        out.append(f"crosses AZs {sorted(placement.azs())} but may not")
    return out


# --- the engine ---------------------------------------------------------------------


_ORDER = (Level.NVLINK_DOMAIN, Level.NODE, Level.LEAF, Level.SPINE, Level.AZ, Level.REGION)


def place(request: PlacementRequest, nodes: Sequence[NodeView], index: FabricIndex | None = None) -> PlacementResult:
    """Place ``request`` on ``nodes``; see the module docstring for the rules.

    ``index`` is an optional :class:`FabricIndex` the caller keeps across
    calls; it only makes the call faster, never changes the answer.
    """
    inv = _Inventory(request, nodes, index if index is not None else FabricIndex())
    m = request.members
    g = request.gpus_per_member
    r = request.rdma_nics_per_member
    for level in _ORDER:
        if level > request.limit:
            break
        chosen, considered = _choose_domain(inv, level, m, g, r)
        if chosen is not None:
            return _build(request, inv, level, chosen, considered)
    return _unplaceable(request, inv)


def _context(u: _Unit) -> tuple[int, ...]:
    """(cap, free GPUs) of each enclosing domain, innermost first.

    Breaks best-fit ties towards the fuller leaf, then the fuller spine: an
    8-GPU member has the same fit on every empty node, and the one to take is
    the one in the most-used leaf, so empty leaves stay empty.
    """
    out: list[int] = []
    p = u.parent
    while p is not None:
        out += (p.cap, p.nfree)
        p = p.parent
    return tuple(out)


def _best(cands: Sequence[_Unit], m: int, inv: _Inventory) -> _Unit:
    """Best fit with the documented tie-breaks: (member slots, free GPUs),
    then fewest nodes, then the fuller enclosing domains, then the name."""
    first = min((c.cap, c.nfree) for c in cands)
    tied = [c for c in cands if (c.cap, c.nfree) == first]
    if len(tied) == 1:
        return tied[0]
    # Fewest nodes only differs when a node can take several members.
    several = inv.max_node_cap > 1
    return min(tied, key=lambda c: (_min_nodes(c, m) if several else 0, _context(c), c.name))


def _choose_domain(inv: _Inventory, level: Level, m: int, g: int, r: int) -> tuple[_Unit | None, int]:
    """The best-fit domain of ``level`` that holds all ``m`` members, if any."""
    cands: list[_Unit]
    if level == Level.NVLINK_DOMAIN:
        if m <= inv.max_node_cap:
            # One node: with a clique every GPU is on the NVLink fabric;
            # without one, the whole gang must fit on one island.
            cands = [e for e in inv.entries if e.cap >= m and (e.facts.clique or _island_cap(e, g, r) >= m)]
            if cands:
                return _best(cands, m, inv), len(cands)
        cands = [c for c in inv.cliques.values() if c.cap >= m]
    elif level == Level.NODE:
        if m > inv.max_node_cap:
            return None, 0
        nodes = [e for e in inv.entries if e.cap >= m]
        if nodes and any(len(e.facts.islands) > 1 for e in nodes):
            # A node where every member gets its own island beats one that
            # would split a member over PCIe, before best fit.
            split = {id(e): _island_split(e, g, m) for e in nodes}
            least = min(split.values())
            nodes = [e for e in nodes if split[id(e)] == least]
        cands = list(nodes)
    else:
        cands = [d for d in inv.domains(level) if d.cap >= m]
    if not cands:
        return None, 0
    return _best(cands, m, inv), len(cands)


def _build(request: PlacementRequest, inv: _Inventory, level: Level, chosen: _Unit, considered: int) -> Placement:
    picks: list[tuple[_Entry, int]] = []
    _spread(chosen, request.members, picks)
    picks.sort(key=lambda p: p[0].facts.rank_key)
    rails: dict[int, frozenset[int]] = {}
    slots: list[MemberSlot] = []
    spans: list[tuple[NodeTopology, tuple[int, ...]]] = []
    for entry, count in picks:
        topo = entry.facts.topology
        for gpus, nics in _assign_on_node(entry, count, request, rails):
            slots.append(MemberSlot(rank=len(slots), az=topo.az, node=topo.node, gpus=gpus, nics=nics))
            spans.append((topo, gpus))
    span, domain = span_of(spans)
    preferred_met = request.preferred is None or span <= request.preferred
    n_nodes = len(picks)
    what = f"{request.describe()} on {n_nodes} node{'s' if n_nodes != 1 else ''}"
    if level == Level.REGION:
        azs = sorted({s.az for s in slots})
        best_az = max(inv.azs.values(), key=lambda d: (d.cap, d.name))
        reason = (
            f"{what} across {len(azs)} AZs ({', '.join(azs)}): no single AZ fits "
            f"(roomiest, {best_az.name}, fits {best_az.cap} of {request.members} members)"
        )
    else:
        noun = {Level.NVLINK_DOMAIN: "NVLink domain"}.get(level, level.label)
        among = (
            f"the only {noun} that fits" if considered == 1
            else f"best fit among {considered} {'leaves' if level == Level.LEAF else noun + 's'} that fit"
        )
        reason = f"{what} in {span.label} {domain}: tightest span; {among} ({chosen.nfree} GPUs free there)"
    if request.preferred is not None:
        reason += "; preferred " + request.preferred.label + (" met" if preferred_met else " not possible now")
    return Placement(members=tuple(slots), span=span, domain=domain, reason=reason, preferred_met=preferred_met)


# --- shortfalls -------------------------------------------------------------------------


def _shortfall(request: PlacementRequest, level: Level, name: str, nfree: int, total: int, cap: int, gpu_cap: int,
               not_ready: int) -> Shortfall:
    m = request.members
    need = request.gpus_needed
    if cap >= m:
        reason = "fits here, but not inside one narrower domain" if level > request.limit else ""
    elif nfree < need:
        reason = f"{need - nfree} GPU{'s' if need - nfree != 1 else ''} short"
    elif gpu_cap < m:
        reason = f"free GPUs fragmented over nodes: a member needs {request.gpus_per_member} on one node"
    else:
        reason = f"RDMA NICs short: {request.rdma_nics_per_member} free NICs per member on too few nodes"
    if not_ready:
        reason += ("; " if reason else "") + f"{not_ready} node{'s' if not_ready != 1 else ''} not ready"
    return Shortfall(
        level=level, domain=name, gpus_free=nfree, gpus_total=total, gpus_needed=need,
        members_fit=min(cap, m), members_needed=m, reason=reason,
    )


def _level_shortfalls(request: PlacementRequest, inv: _Inventory, level: Level) -> list[Shortfall]:
    g = request.gpus_per_member
    r = request.rdma_nics_per_member
    m = request.members
    rows: list[Shortfall] = []
    if level in (Level.NVLINK_DOMAIN, Level.NODE):
        for e in (*inv.entries, *inv.full):
            if level == Level.NVLINK_DOMAIN and e.facts.clique:
                continue  # counted with its clique below
            cap = _island_cap(e, g, r) if level == Level.NVLINK_DOMAIN else e.cap
            rows.append(_shortfall(request, level, e.name, e.nfree, len(e.facts.eligible(request.gpu_model)),
                                   cap, e.gpu_cap, 0))
        if level == Level.NVLINK_DOMAIN:
            for c in inv.cliques.values():
                total = sum(len(e.facts.eligible(request.gpu_model)) for e in c.entries)
                rows.append(_shortfall(request, level, c.name, c.nfree, total, c.cap, c.gpu_cap, 0))
    else:
        for d in inv.domains(level):
            rows.append(_shortfall(request, level, d.name, d.nfree, d.total, d.cap, d.gpu_cap, d.not_ready))
    rows.sort(key=lambda s: (-s.members_fit, -s.gpus_free, s.domain))
    return rows[:SHORTFALLS_PER_LEVEL]


def _unplaceable(request: PlacementRequest, inv: _Inventory) -> Unplaceable:
    limit = request.limit
    top = Level.REGION if request.may_span_azs else Level.AZ
    shortfalls: list[Shortfall] = []
    for level in _ORDER:
        if limit <= level <= top:
            shortfalls.extend(_level_shortfalls(request, inv, level))
    if limit == Level.REGION:
        # A gang that may span AZs: what each AZ would add is what a user
        # acts on (which AZ is full, which has nodes down), so list them too.
        shortfalls.extend(_level_shortfalls(request, inv, Level.AZ))
    notes: list[str] = []
    if inv.not_ready:
        notes.append(f"{inv.not_ready} node{'s' if inv.not_ready != 1 else ''} not ready")
    if inv.wrong_model:
        notes.append(f"{inv.wrong_model} node{'s' if inv.wrong_model != 1 else ''} without GPU model {request.gpu_model!r}")
    scope = "" if request.azs is None else f" in AZs {', '.join(sorted(request.azs))}"
    if not inv.entries:
        reason = f"no ready node{scope} has room for even one member of {request.describe()}"
    elif limit == Level.REGION:
        reason = f"no region{scope} can host {request.describe()}"
    else:
        reason = f"no single {limit.label}{scope} can host {request.describe()}"
        if limit == Level.AZ and not request.may_span_azs and sum(d.cap for d in inv.azs.values()) >= request.members:
            notes.append("all AZs together would fit, but allow_cross_az is false")
    if shortfalls:
        reason += f"; closest: {shortfalls[0].describe()}"
    if notes:
        reason += "; " + "; ".join(notes)
    return Unplaceable(reason=reason, shortfalls=tuple(shortfalls))


# --- never fits -------------------------------------------------------------------------


def drained(nodes: Iterable[NodeView]) -> list[NodeView]:
    """The same nodes with every device free: what they offer once the gangs
    running there have ended (readiness kept as given)."""
    return [
        NodeView(topology=v.topology, free_gpus=frozenset(v.topology.gpu_indices),
                 free_nics=frozenset(n.name for n in v.topology.nics if n.usable), ready=v.ready)
        for v in nodes
    ]


def never_fits(request: PlacementRequest, registered: Iterable[NodeTopology], index: FabricIndex | None = None) -> str:
    """Why ``request`` cannot be placed even if every node in ``registered``
    were ready and empty, or "" when it could be.

    ``registered`` is every node the caller knows of (ready or not); nodes
    outside ``request.azs`` are ignored, as :func:`place` ignores them. The
    verdict is :func:`place` on that empty inventory, so it covers exactly
    the rules placement applies (member count, GPUs and NICs per member, GPU
    model, required level); the text names the first limit the gang breaks.

    With no node registered in scope at all there is nothing to judge
    against (the AZ's agents have not come yet): "" (the gang waits).
    """
    topos = [t for t in registered if request.azs is None or t.az in request.azs]
    if not topos:
        return ""
    views = [NodeView(topology=t, free_gpus=frozenset(t.gpu_indices),
                      free_nics=frozenset(n.name for n in t.nics if n.usable)) for t in topos]
    result = place(request, views, index)
    if isinstance(result, Placement):
        return ""
    scope = "in any AZ" if request.azs is None else f"in AZ{'s' if len(request.azs) > 1 else ''} {', '.join(sorted(request.azs))}"
    needle = request.gpu_model.lower()

    def eligible(t: NodeTopology) -> int:
        return sum(1 for gpu in t.gpus if needle in gpu.model.lower())

    model = f" {request.gpu_model}" if request.gpu_model else ""
    most_on_node = max(eligible(t) for t in topos)
    if request.gpu_model and most_on_node == 0:
        models = sorted({gpu.model for t in topos for gpu in t.gpus if gpu.model})
        return (f"never fits: no node {scope} has a GPU of model {request.gpu_model!r}"
                + (f" (models registered: {', '.join(models)})" if models else ""))
    g, r = request.gpus_per_member, request.rdma_nics_per_member
    if g > most_on_node:
        return f"never fits: a member needs {g}{model} GPUs on one node, the largest node {scope} has {most_on_node}"
    if r:
        roomy = [t for t in topos if eligible(t) >= g]
        most_nics = max(sum(1 for n in t.nics if n.usable) for t in roomy)
        if r > most_nics:
            return (f"never fits: a member needs {r} RDMA NICs on one node, the most any node {scope} "
                    f"with {g}{model} GPUs has is {most_nics}")
    level = request.limit
    totals: dict[str, int] = {}
    for t in topos:
        dom = t.domain(level)
        totals[dom] = totals.get(dom, 0) + eligible(t)
    best = min(totals.items(), key=lambda kv: (-kv[1], kv[0]))  # the largest; ties by name
    need = request.gpus_needed
    if need > best[1]:
        return f"never fits: needs {need}{model} GPUs, the most it may span holds {best[1]} ({level.label} {best[0]})"
    return f"never fits: even with every registered node {scope} ready and empty, {result.reason}"
