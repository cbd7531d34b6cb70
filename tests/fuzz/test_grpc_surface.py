"""The kubelet-facing gRPC surface of the real agent process under hostile input.

One ``gpu-dra-agent run --simulate dgx-h100`` process (the integration harness) takes, on
its real unix DRA socket, what no kubelet sends: random bytes and mutated valid requests
as the message body (a raw grpcio channel with identity serializers: hypothesis's bytes
are exactly what goes on the wire), messages at and beyond the 4 MiB receive limit, a
prefix announcing 4 GiB, compressed or truncated messages (raw HTTP/2 through grpclib),
10 000 claims in one request, strings of megabytes and invalid UTF-8, for the v1 and
v1beta1 services and both methods. Every call must end with OK or a precise status
(INVALID_ARGUMENT, RESOURCE_EXHAUSTED, UNIMPLEMENTED), never UNKNOWN or INTERNAL (an
exception inside the plugin) and never a hang. The last test checks what the barrage left:
the process is up, prepares a normal claim correctly, its peak RSS (``VmHWM``) stayed under
``RSS_LIMIT_MB``, and nothing in the work directory outside the plugin, CDI and registry
directories changed. Then hypothesis interleaves prepares and unprepares of claims that
all name one exclusive device: at most one of them ever holds it.
"""

# ruff: noqa: F811 (the integration harness's fixtures are imported, then requested)
from __future__ import annotations

import os
import struct
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import anyio
import grpc  # type: ignore[import-untyped]
import pytest
from grpclib.client import Channel
from grpclib.const import Cardinality
from hypothesis import example, given
from hypothesis import strategies as st

from agent.health.stream import SERVICES as HEALTH_SERVICES
from agent.kubelet import api
from agent.kubelet.dra_service import MAX_CLAIMS_PER_REQUEST
from agent.kubelet.registration import SERVICE as REGISTRATION_SERVICE
from agent.kubelet.rpc import MAX_RECEIVE_MESSAGE_BYTES
from agent.node.checkpoint import ClaimState
from agent.sim.claims import PodReference
from agent.sim.kubelet import ClaimRef
from tests.fuzz import fuzz_settings
from tests.integration.conftest import (  # noqa: F401 (fixtures)
    DRIVER,
    NAMESPACE,
    AgentHarness,
    _claims_deleted_after_each_test,
    allocated_devices,
    anyio_backend,
    fresh_harness,
    gpu_request,
    harness,
    workdir,
)

pytestmark = pytest.mark.anyio

#: Peak resident memory (VmHWM) of the agent over the whole module: about 97 MB after
#: start (simulated dgx-h100), about 170 MB after the 10 000-claim request (several KB per
#: claim while it is prepared; MAX_CLAIMS_PER_REQUEST bounds that), the rest of the barrage
#: adds nothing: no call buffers a message over the 4 MiB limit, twenty 16 MiB ones included.
RSS_LIMIT_MB = 200
#: No call may take longer (the kubelet's own deadline is 45 s).
CALL_TIMEOUT_S = 30.0
#: An answer about one hostile claim stays small whatever the claim's strings were.
MAX_ERROR_BYTES = 4096

SERVICES = {
    "v1": "k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin",
    "v1beta1": "k8s.io.kubelet.pkg.apis.dra.v1beta1.DRAPlugin",
}
METHODS = ("NodePrepareResources", "NodeUnprepareResources")
PATHS = [f"/{service}/{method}" for service in SERVICES.values() for method in METHODS]
REGISTRATION_PATHS = [
    f"/{REGISTRATION_SERVICE}/{method}" for method in ("GetInfo", "NotifyRegistrationStatus")
]
HEALTH_PATHS = [f"/{service}/NodeWatchResources" for service in HEALTH_SERVICES]
PRECISE = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED}
UID = "6ba7b814-9dad-11d1-80b4-00c04fd430c8"


# -- wire helpers (hand-made protobuf, so that any byte can be put anywhere) ------------------


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def _field(number: int, payload: bytes) -> bytes:
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def claim_bytes(namespace: bytes, uid: bytes, name: bytes) -> bytes:
    """One ``Claim`` (namespace=1, uid=2, name=3) inside a request's ``claims`` (field 1)."""
    return _field(1, _field(1, namespace) + _field(2, uid) + _field(3, name))


def request_bytes(*claims: tuple[bytes, bytes, bytes]) -> bytes:
    return b"".join(claim_bytes(*c) for c in claims)


def exact_body(size: int) -> bytes:
    """A request of exactly ``size`` bytes: one claim whose name fills it, and an unknown
    field 15 (which decoders skip) to land on the byte."""
    pad = _field(15, b"p" * 100)

    def body(k: int) -> bytes:
        return claim_bytes(b"default", UID.encode(), b"n" * k) + pad

    overhead = len(body(size // 2)) - size // 2  # constant: the varints have 4 bytes there
    return body(size - overhead)


_names = st.sampled_from([b"default", b"kube-system", b"", b"a" * 64, b"\xff\xfe", b"ns/.."])
_uids = st.one_of(
    st.sampled_from([UID.encode(), b"", b"../../etc", b"\xc3\x28", b"x" * 129]),
    st.uuids().map(lambda u: str(u).encode()),
)
valid_requests = st.lists(st.tuples(_names, _uids, _names), max_size=4).map(
    lambda claims: request_bytes(*claims)
)


@st.composite
def mutated_requests(draw: st.DrawFn) -> bytes:
    """A well-formed request with byte mutations: bit flips, truncation, inserted or
    duplicated bytes, a length prefix made larger than what follows."""
    data = bytearray(draw(valid_requests) or claim_bytes(b"default", UID.encode(), b"c"))
    for _ in range(draw(st.integers(min_value=1, max_value=6))):
        at = draw(st.integers(min_value=0, max_value=max(len(data) - 1, 0)))
        action = draw(st.sampled_from(["flip", "truncate", "insert", "duplicate", "lie"]))
        if action == "flip" and data:
            data[at] ^= 1 << draw(st.integers(min_value=0, max_value=7))
        elif action == "truncate":
            del data[at:]
        elif action == "insert":
            data[at:at] = draw(st.binary(min_size=1, max_size=8))
        elif action == "duplicate":
            data[at:at] = data[at : at + draw(st.integers(min_value=1, max_value=16))]
        elif action == "lie" and data:
            data[at] = draw(st.sampled_from([0x7F, 0xFF, 0x0A, 0x12, 0x1A, 0x0B, 0x0C]))
    return bytes(data)


hostile_bodies = st.one_of(st.binary(max_size=256), valid_requests, mutated_requests())


# -- the raw client ---------------------------------------------------------------------------


class RawClient:
    """grpcio on the DRA socket, bytes in and bytes out (no protobuf on our side)."""

    def __init__(self, socket: Path) -> None:
        self.channel = grpc.insecure_channel(
            f"unix:{socket}", options=[("grpc.max_receive_message_length", 64 * 1024 * 1024)]
        )
        self._calls: dict[str, Callable[..., Any]] = {}

    def call(self, path: str, body: bytes) -> tuple[grpc.StatusCode, bytes | str]:
        """The status and the response bytes (OK) or the status details."""
        if path not in self._calls:
            self._calls[path] = self.channel.unary_unary(path)  # identity serializers
        try:
            return grpc.StatusCode.OK, self._calls[path](body, timeout=CALL_TIMEOUT_S)
        except grpc.RpcError as err:
            return err.code(), err.details() or ""

    async def acall(self, path: str, body: bytes) -> tuple[grpc.StatusCode, bytes | str]:
        return await anyio.to_thread.run_sync(self.call, path, body)

    def close(self) -> None:
        self.channel.close()


@pytest.fixture(scope="module")
def client(harness: AgentHarness) -> Iterator[RawClient]:
    raw = RawClient(harness.dra_socket)
    yield raw
    raw.close()


def _tree(root: Path, skip: set[Path]) -> dict[str, tuple[int, int, int]]:
    """path -> (mode, size, mtime_ns) of everything under ``root`` except ``skip``."""
    found: dict[str, tuple[int, int, int]] = {}
    for directory, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if Path(directory, d) not in skip]
        for name in [*dirs, *files]:
            path = Path(directory, name)
            if path in skip or name.startswith("agent-"):
                continue
            st_ = path.lstat()
            found[str(path.relative_to(root))] = (st_.st_mode, st_.st_size, st_.st_mtime_ns)
    return found


@pytest.fixture(scope="module")
def before(harness: AgentHarness) -> dict[str, tuple[int, int, int]]:
    """The work directory outside the agent's own directories, before any hostile call."""
    return _tree(harness.workdir, _own_directories(harness))


def _own_directories(harness: AgentHarness) -> set[Path]:
    return {harness.plugins_dir, harness.cdi_root, harness.registrar_dir}


def _check_answer(path: str, code: grpc.StatusCode, answer: bytes | str) -> None:
    assert code in PRECISE, (path, code, answer)
    if code is not grpc.StatusCode.OK:
        assert isinstance(answer, str) and answer, (path, code)
        assert len(answer) < MAX_ERROR_BYTES, (path, len(answer))
        return
    assert isinstance(answer, bytes)
    version = "v1" if ".v1." in path else "v1beta1"
    module = api.dra_v1 if version == "v1" else api.dra_v1beta1
    kind = "Prepare" if "Prepare" in path and "Unprepare" not in path else "Unprepare"
    response = getattr(module, f"Node{kind}ResourcesResponse").parse(answer)
    for result in response.claims.values():
        assert len(result.error.encode()) < MAX_ERROR_BYTES, (path, len(result.error))


# -- the barrage ------------------------------------------------------------------------------


@fuzz_settings(ci_examples=40)
@given(path=st.sampled_from(PATHS), body=hostile_bodies)
@example(path=PATHS[0], body=request_bytes((b"default", UID.encode(), b"\xff\xfe\xfd")))
@example(path=PATHS[1], body=request_bytes((b"\xed\xa0\x80", UID.encode(), b"c")))
@example(path=PATHS[2], body=b"\x0a\xff\xff\xff\xff\x0f")  # a length of 4 GiB inside
@example(path=PATHS[3], body=b"\x0b" * 64)  # start-group tags
@example(path=PATHS[0], body=b"\x0a\x00" * 1000)  # a thousand empty claims
async def test_random_and_mutated_bodies(
    harness: AgentHarness,
    client: RawClient,
    before: dict[str, tuple[int, int, int]],
    path: str,
    body: bytes,
) -> None:
    """Any body gets OK with an entry per claim or INVALID_ARGUMENT, in bounded time."""
    started = time.monotonic()
    code, answer = await client.acall(path, body)
    assert time.monotonic() - started < CALL_TIMEOUT_S
    _check_answer(path, code, answer)


@pytest.mark.parametrize("version", sorted(SERVICES))
async def test_very_long_strings(
    harness: AgentHarness, client: RawClient, before: dict[str, Any], version: str
) -> None:
    """Megabyte strings in each field: one precise, short error per claim (the kubelet's
    grpc-go client refuses answers over 4 MiB, so echoing the input would fail the batch)."""
    long = b"a" * (1024 * 1024)
    claims = [
        (long, UID.encode(), b"c"),
        (b"default", b"b" * (1024 * 1024), b"c"),
        (b"default", b"6ba7b815-9dad-11d1-80b4-00c04fd430c8", long),
    ]
    for method in METHODS:
        path = f"/{SERVICES[version]}/{method}"
        code, answer = await client.acall(path, request_bytes(*claims))
        _check_answer(path, code, answer)
        assert code is grpc.StatusCode.OK
        # the answer is keyed by the UIDs as sent (a megabyte one included), errors are short
        assert isinstance(answer, bytes) and len(answer) < 1024 * 1024 + 3 * MAX_ERROR_BYTES


# serial: the call timeout is a wall-clock bound, and 10 000 claim GETs are CPU on the event
# loop (aiohttp's, some 0.3 ms each on a 2-core VM): beside five busy workers they can take it
@pytest.mark.slow
@pytest.mark.serial
async def test_ten_thousand_claims_in_one_request(
    harness: AgentHarness, client: RawClient, before: dict[str, Any]
) -> None:
    """10 000 claims, most of them valid identities the API server does not know, plus
    invalid ones: every claim gets its own answer, within the call timeout."""
    claims = [
        (b"default", f"6ba7b814-9dad-11d1-{i:04x}-00c04fd430c8".encode(), f"c-{i}".encode())
        if i % 4
        else (b"Not_A_Namespace", f"u{i}".encode(), b"c")
        for i in range(MAX_CLAIMS_PER_REQUEST)
    ]
    for method in METHODS:
        path = f"/{SERVICES['v1']}/{method}"
        started = time.monotonic()
        code, answer = await client.acall(path, request_bytes(*claims))
        elapsed = time.monotonic() - started
        assert code is grpc.StatusCode.OK, answer
        assert isinstance(answer, bytes)
        module = api.dra_v1
        response_type = (
            module.NodePrepareResourcesResponse
            if method == METHODS[0]
            else module.NodeUnprepareResourcesResponse
        )
        response = response_type.parse(answer)
        assert len(response.claims) == MAX_CLAIMS_PER_REQUEST, (method, len(response.claims))
        errors = [r.error for r in response.claims.values()]
        if method == METHODS[0]:
            assert all(errors), "a claim the API server does not have was prepared"
        assert elapsed < CALL_TIMEOUT_S


async def test_more_claims_than_the_limit(
    harness: AgentHarness, client: RawClient, before: dict[str, Any]
) -> None:
    """One claim more than MAX_CLAIMS_PER_REQUEST: RESOURCE_EXHAUSTED, nothing prepared."""
    claims = [(b"a", f"u{i}".encode(), b"c") for i in range(MAX_CLAIMS_PER_REQUEST + 1)]
    for path in PATHS:
        code, answer = await client.acall(path, request_bytes(*claims))
        assert code is grpc.StatusCode.RESOURCE_EXHAUSTED, (path, code)
        assert str(MAX_CLAIMS_PER_REQUEST) in str(answer)


@pytest.mark.parametrize("size", [MAX_RECEIVE_MESSAGE_BYTES, MAX_RECEIVE_MESSAGE_BYTES + 1])
async def test_message_size_limit(
    harness: AgentHarness, client: RawClient, before: dict[str, Any], size: int
) -> None:
    """A message of exactly the limit is read (one claim with a huge name: a precise error),
    one byte more is RESOURCE_EXHAUSTED before its body is buffered, on every path."""
    body = exact_body(size)
    assert len(body) == size
    for path in PATHS:
        code, answer = await client.acall(path, body)
        if size > MAX_RECEIVE_MESSAGE_BYTES:
            assert code is grpc.StatusCode.RESOURCE_EXHAUSTED, (path, code, answer)
            assert str(MAX_RECEIVE_MESSAGE_BYTES) in str(answer)
        else:
            _check_answer(path, code, answer)


async def test_sixteen_mebibytes_many_times(
    harness: AgentHarness, client: RawClient, before: dict[str, Any]
) -> None:
    """Twenty 16 MiB requests at once: refused each, memory not growing with them."""
    body = _field(1, _field(3, b"x" * (16 * 1024 * 1024)))
    results: list[grpc.StatusCode] = []

    async def one(path: str) -> None:
        results.append((await client.acall(path, body))[0])

    async with anyio.create_task_group() as group:
        for index in range(20):
            group.start_soon(one, PATHS[index % len(PATHS)])
    assert results == [grpc.StatusCode.RESOURCE_EXHAUSTED] * 20


async def _raw_grpclib_call(socket: Path, path: str, frame: bytes) -> tuple[int | None, str]:
    """Send ``frame`` (our own 5-byte prefix and body, however false) as a call's data."""
    async with Channel(path=str(socket)) as channel:
        request = channel.request(path, Cardinality.UNARY_UNARY, bytes, bytes, timeout=10)
        async with request as stream:
            await stream.send_request()
            await stream._stream.send_data(frame, end_stream=True)
            stream._end_done = True  # sent below grpclib's own framing, so tell it
            try:
                await stream.recv_initial_metadata()
                await stream.recv_trailing_metadata()
            except Exception as err:  # grpclib raises GRPCError on a non-OK status
                status = getattr(err, "status", None)
                return (None if status is None else status.value), getattr(err, "message", "")
    return 0, ""


@pytest.mark.parametrize(
    ("frame", "status"),
    [
        (struct.pack(">?I", False, 0xFFFFFFFF) + b"x" * 100, grpc.StatusCode.RESOURCE_EXHAUSTED),
        (struct.pack(">?I", True, 10) + b"0123456789", grpc.StatusCode.UNIMPLEMENTED),
        (struct.pack(">?I", False, 100) + b"short", grpc.StatusCode.INVALID_ARGUMENT),
        (b"\x00\x00", grpc.StatusCode.INVALID_ARGUMENT),
        (b"", grpc.StatusCode.INVALID_ARGUMENT),
    ],
    ids=["announces-4GiB", "compressed", "truncated", "partial-prefix", "no-message"],
)
async def test_false_frames(
    harness: AgentHarness, before: dict[str, Any], frame: bytes, status: grpc.StatusCode
) -> None:
    """Frames no gRPC library sends: each gets its precise status, on every path (the
    health stream's and the registration socket's included: they read requests the same way)."""
    calls = [(harness.dra_socket, path) for path in [*PATHS, *HEALTH_PATHS]]
    calls += [(harness.registration_socket, path) for path in REGISTRATION_PATHS]
    for socket, path in calls:
        code, message = await _raw_grpclib_call(socket, path, frame)
        assert code == status.value[0], (path, code, message)
        assert message and "Internal" not in message
    assert harness.kubelet.registrations(DRIVER), "a false frame changed the registration"


# -- what the barrage left --------------------------------------------------------------------


def _kib(status: str, field: str) -> int:
    for line in status.splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise AssertionError(f"no {field} in /proc status")


async def test_after_the_barrage(
    harness: AgentHarness, client: RawClient, before: dict[str, tuple[int, int, int]]
) -> None:
    """Still up, still correct, memory bounded, nothing written outside its directories."""
    agent = harness.agent
    assert agent is not None
    assert agent.returncode is None, agent.log()
    ref, claim = await harness.allocate(gpu_request(), name="after-barrage")
    [device] = allocated_devices(claim)
    answer = (await harness.prepare(ref))[ref.uid]
    assert answer.error == "" and [d.device_name for d in answer.devices] == [device]
    harness.assert_consistent()
    assert (await harness.unprepare(ref))[ref.uid].error == ""
    status = await anyio.Path(f"/proc/{agent.process.pid}/status").read_text()
    peak_mb = _kib(status, "VmHWM") / 1024
    assert peak_mb < RSS_LIMIT_MB, f"peak RSS {peak_mb:.0f} MB"
    after = _tree(harness.workdir, _own_directories(harness))
    assert after == before
    log = agent.log()
    assert "Traceback" not in log, log[-4000:]


# -- one exclusive device, any interleaving ---------------------------------------------------

steps = st.lists(
    st.one_of(
        st.tuples(st.just("prepare"), st.lists(st.integers(0, 2), min_size=1, max_size=3)),
        st.tuples(st.just("batch"), st.lists(st.integers(0, 2), min_size=2, max_size=3)),
        st.tuples(st.just("unprepare"), st.integers(0, 2).map(lambda i: [i])),
    ),
    min_size=1,
    max_size=6,
)


@pytest.fixture(scope="module")
async def contenders(harness: AgentHarness) -> tuple[str, list[ClaimRef]]:
    """Three claims allocated the same exclusive GPU (the allocator picks it for the first;
    the other two name it by hand, as a broken scheduler or a stale copy would)."""
    first, claim = await harness.allocate(gpu_request(), name="contender-0")
    [device] = allocated_devices(claim)
    others = [
        await harness.claim(
            [device], name=f"contender-{i}", reserved_for=[PodReference(f"pod-{i}")]
        )
        for i in (1, 2)
    ]
    harness._created.clear()  # kept for the module; the examples unprepare them
    return device, [first, *others]


async def _prepare_into(harness: AgentHarness, claim: ClaimRef, answers: dict[str, Any]) -> None:
    answers.update(await harness.prepare(claim))


@fuzz_settings(ci_examples=15)
@given(schedule=steps)
async def test_one_exclusive_device_is_never_given_twice(
    harness: AgentHarness, contenders: tuple[str, list[ClaimRef]], schedule: list[Any]
) -> None:
    """Concurrent single prepares, one request with several contenders, unprepares in any
    order: after every step at most one contender holds the device, in the answers and in
    the checkpoint; a holder's repeated prepare succeeds; an unprepare frees it."""
    device, claims = contenders
    holder: int | None = None
    try:
        for kind, indexes in schedule:
            if kind == "unprepare":
                [i] = indexes
                assert (await harness.unprepare(claims[i]))[claims[i].uid].error == ""
                if holder == i:
                    holder = None
                continue
            answers: dict[str, Any] = {}
            if kind == "batch":
                answers.update(await harness.prepare(*[claims[i] for i in indexes]))
            else:
                async with anyio.create_task_group() as group:
                    for i in indexes:
                        group.start_soon(_prepare_into, harness, claims[i], answers)
            won = {i for i in set(indexes) if answers[claims[i].uid].error == ""}
            assert len(won | ({holder} if holder is not None else set())) <= 1, (holder, won)
            for i in set(indexes) - won:
                assert device in answers[claims[i].uid].error
            holder = next(iter(won), holder)
            if holder is not None:
                assert not (set(indexes) - won) or holder not in set(indexes) - won
            held = [
                uid
                for uid, state in harness.checkpoint_claims().items()
                if state == ClaimState.PREPARE_COMPLETED and uid in {c.uid for c in claims}
            ]
            assert held == ([] if holder is None else [claims[holder].uid])
    finally:
        await harness.unprepare(*claims)
