"""Loop prevention rules of the mirror (shared/DESIGN.md, "Record headers"), no cluster."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from crossdc.clients.offsets import OffsetMap, runs_of
from mirror.rules import plan

pytestmark = pytest.mark.unit

REGIONS = ["east", "west", "north"]


def stamped(origin: str, path: str, mode: str = "nearest") -> list[tuple[str, bytes]]:
    return [("user", b"u"), ("dr-id", b"id-1"), ("dr-origin", origin.encode()),
            ("dr-ts", b"1700000000000"), ("dr-mode", mode.encode()),
            ("dr-path", path.encode())]


def test_headerless_records_are_stamped_as_originating_in_the_source() -> None:
    out = plan([("user", b"u")], source="east", target="west", timestamp_ms=42,
               id_hint="east:t:0:7")
    assert out is not None
    h = dict(out)
    assert h["user"] == b"u"
    assert h["dr-id"] == b"east:t:0:7"
    assert h["dr-origin"] == b"east"
    assert h["dr-ts"] == b"42"
    assert h["dr-path"] == b"east,west"


def test_sync_records_are_never_mirrored() -> None:
    assert plan(stamped("east", "east,west", "sync"), source="east", target="west",
                timestamp_ms=1) is None


def test_a_region_already_in_the_path_is_never_written_again() -> None:
    assert plan(stamped("east", "east,west"), source="west", target="east",
                timestamp_ms=1, forward=True) is None


def test_only_own_records_unless_forward() -> None:
    rec = stamped("east", "east,west")
    assert plan(rec, source="west", target="north", timestamp_ms=1) is None
    out = plan(rec, source="west", target="north", timestamp_ms=1, forward=True)
    assert out is not None
    assert dict(out)["dr-path"] == b"east,west,north"
    # user headers and the id survive, dr-path appears once
    assert [k for k, _ in out].count("dr-path") == 1
    assert dict(out)["dr-id"] == b"id-1"


def test_proxy_written_record_extends_its_path() -> None:
    out = plan(stamped("east", "east"), source="east", target="west", timestamp_ms=1)
    assert out is not None
    assert dict(out)["dr-path"] == b"east,west"


@given(st.lists(st.tuples(st.sampled_from(REGIONS), st.sampled_from(REGIONS)),
                min_size=1, max_size=12))
def test_no_flow_sequence_writes_a_region_twice(hops: list[tuple[str, str]]) -> None:
    """Whatever mesh of flows a record travels, it enters each region at most once.
    (Each flow carries a region's copy once; re-delivery by one flow is not a loop.)
    `forward=True` is for chains only: in a mesh, A → C and A → B → C would both deliver.
    """
    regions_with_copy = {"east"}
    copies: dict[str, list[tuple[str, bytes]]] = {"east": [("user", b"x")]}
    for src, dst in dict.fromkeys(hops):
        if src == dst or src not in copies:
            continue
        out = plan(copies[src], source=src, target=dst, timestamp_ms=1,
                   id_hint="east:t:0:0")
        if out is None:
            continue
        assert dst not in regions_with_copy, (hops, src, dst)
        regions_with_copy.add(dst)
        copies[dst] = out


def test_full_mesh_without_forward_delivers_once_everywhere() -> None:
    copies = {"east": stamped("east", "east")}
    for src, dst in itertools.permutations(REGIONS, 2):
        if src in copies:
            out = plan(copies[src], source=src, target=dst, timestamp_ms=1)
            if out is not None:
                assert dst not in copies
                copies[dst] = out
    assert set(copies) == set(REGIONS)


def test_offset_map_translation_is_exact_between_pairs() -> None:
    # source offsets 10..14 went to target 100..103 (12 was a skipped sync record)
    m = OffsetMap.from_pairs({("t", 0): [(10, 100), (11, 101), (13, 102), (14, 103)]})
    # committed offset = next record to read
    assert m.translate("t", 0, 11) == 101
    assert m.translate("t", 0, 12) == 102  # 12 never copied: resume at 13's copy
    assert m.translate("t", 0, 13) == 102
    assert m.translate("t", 0, 15) == 104  # all caught up: one past the last copy
    assert m.translate("t", 1, 0) is None  # never mirrored


def test_forward_carries_a_chain_once() -> None:
    """A → B → C with B → C forwarding: C gets east's record once, never back to A or B."""
    at_b = plan([("user", b"x")], source="east", target="west", timestamp_ms=1)
    assert at_b is not None
    at_c = plan(at_b, source="west", target="north", timestamp_ms=1, forward=True)
    assert at_c is not None
    assert dict(at_c)["dr-path"] == b"east,west,north"
    for back in ("east", "west"):
        assert plan(at_c, source="north", target=back, timestamp_ms=1, forward=True) is None


def test_runs_encode_the_pairs_densely_and_translate_like_them() -> None:
    pairs = [(0, 5), (1, 6), (2, 7), (4, 8), (5, 10), (6, 11), (9, 12)]
    assert runs_of(pairs) == [(0, 5, 3), (4, 8, 1), (5, 10, 2), (9, 12, 1)]
    m = OffsetMap.from_pairs({("t", 0): pairs})
    for committed in range(12):
        # the brute-force rule: the first copy at or after the committed offset
        later = [d for s, d in pairs if s >= committed]
        expected = later[0] if later else pairs[-1][1] + 1
        assert m.translate("t", 0, committed) == expected, committed
    assert m.last_source("t", 0) == 9


def test_flows_come_from_the_topology_file_or_the_command_line() -> None:
    import typer

    from crossdc.topology import load_topology
    from dr.cli.mirror import _flows

    root = __import__("pathlib").Path(__file__).resolve().parents[2]
    topo = load_topology(root / "policies" / "topology.active-active.yaml")
    declared = _flows(topo, None, None, None, None, False, False, 10.0, False, "w7")
    assert [(f.source, f.target) for f in declared] == [("east", "west"), ("west", "east")]
    assert {f.worker_id for f in declared} == {"w7"}
    one = _flows(topo, "east", "west", "orders", "g", True, False, 2.0, True, None)
    assert (one[0].exactly_once, one[0].dead_letter, one[0].group) == (True, True, "g")
    with pytest.raises(typer.BadParameter, match="no region 'south'"):
        _flows(topo, "south", "west", "orders", None, False, False, 10.0, False, None)
    with pytest.raises(typer.BadParameter, match="go together"):
        _flows(topo, "east", None, None, None, False, False, 10.0, False, None)


def _plan_as_it_was(headers: list[tuple[str, bytes]], *, source: str, target: str,
                    timestamp_ms: int, forward: bool = False,
                    id_hint: str | None = None) -> list[tuple[str, bytes]] | None:
    """plan() before its per-record cost was cut (issue 26), kept as the oracle."""
    dr = {k: v for k, v in headers if k.startswith("dr-")} if headers else None
    if not dr or "dr-id" not in dr:
        return [*headers, ("dr-id", (id_hint or "x").encode()), ("dr-origin", source.encode()),
                ("dr-ts", str(timestamp_ms).encode()), ("dr-mode", b"nearest"),
                ("dr-path", f"{source},{target}".encode())]
    if dr.get("dr-mode") == b"sync":
        return None
    path = [p for p in dr.get("dr-path", b"").decode().split(",") if p]
    if target in path:
        return None
    origin = dr.get("dr-origin", b"").decode()
    if not forward and origin and origin != source:
        return None
    if not path or path[-1] != source:
        path.append(source)
    path.append(target)
    out = [(k, v) for k, v in headers if k != "dr-path"]
    out.append(("dr-path", ",".join(path).encode()))
    return out


_names = st.sampled_from(REGIONS)
_paths = st.lists(st.sampled_from([*REGIONS, ""]), max_size=4).map(lambda p: ",".join(p))
_header = st.one_of(
    st.tuples(st.sampled_from(["user", "dr-id", "dr-ts", "dr-epoch"]), st.binary(max_size=4)),
    st.tuples(st.just("dr-origin"), _names.map(str.encode)),
    st.tuples(st.just("dr-mode"), st.sampled_from([b"nearest", b"ordered", b"sync"])),
    st.tuples(st.just("dr-path"), _paths.map(str.encode)))


@given(headers=st.lists(_header, max_size=7), source=_names, target=_names,
       forward=st.booleans(), ts=st.integers(-1, 2**45))
def test_plan_decides_as_the_reference_does(headers: list[tuple[str, bytes]], source: str,
                                            target: str, forward: bool, ts: int) -> None:
    """The cheaper plan() (headers read by dict() in C, the path split as bytes, the flow's
    constant headers cached) carries, drops and stamps exactly as the plain version did."""
    assert plan(headers, source=source, target=target, timestamp_ms=ts, forward=forward,
                id_hint="x") == _plan_as_it_was(headers, source=source, target=target,
                                                timestamp_ms=ts, forward=forward, id_hint="x")


def test_an_origin_that_is_not_utf8_is_another_region() -> None:
    """A dr-origin of bytes that do not decode is not this flow's source: the record is not
    carried (it used to raise UnicodeDecodeError in the copy loop)."""
    rec = [("dr-id", b"i"), ("dr-origin", b"\xff\xfe"), ("dr-mode", b"nearest"),
           ("dr-path", b"x")]
    assert plan(rec, source="east", target="west", timestamp_ms=1) is None


@given(st.lists(st.tuples(st.one_of(st.none(), st.binary(max_size=8)),
                          st.one_of(st.none(), st.binary(max_size=8))), max_size=30))
def test_source_bytes_counts_keys_and_values(kv: list[tuple[bytes | None, bytes | None]]
                                             ) -> None:
    """The bytes metric's C-loop sum: what a plain sum over the records gives (a missing key
    or value has size -1 and counts 0)."""
    from aiokafka.structs import ConsumerRecord

    from mirror.worker import _source_bytes
    recs = [ConsumerRecord("t", 0, i, 1, 0, k, v, None, -1 if k is None else len(k),
                           -1 if v is None else len(v), ()) for i, (k, v) in enumerate(kv)]
    assert _source_bytes(recs) == sum(max(r.serialized_value_size, 0)
                                      + max(r.serialized_key_size, 0) for r in recs)


@given(st.lists(st.tuples(st.integers(1, 3), st.integers(0, 2)), max_size=40))
def test_runs_added_in_place_are_the_runs_of_the_pairs(steps: list[tuple[int, int]]) -> None:
    """The worker adds each acked chunk (or a record found in the target) to the attempt's
    runs in place; the result is what runs_of gives for the same (src, dst) pairs."""
    from mirror.worker import _add_run
    pairs: list[tuple[int, int]] = []
    runs: list[tuple[int, int, int]] = []
    s = d = 0
    for ds, gap in steps:
        s += ds
        d += 1 + gap
        pairs.append((s, d))
        _add_run(runs, s, d, 1)
    assert runs == runs_of(pairs)
