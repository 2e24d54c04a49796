"""The protocol both sides speak: kinds with their fields, checked on send and on receipt;
the one knob validator and text parser."""

from __future__ import annotations

import pickle
import time

import pytest

from hvdnb.notebook.cluster.channel import ClientChannel
from hvdnb.protocol import kinds
from hvdnb.protocol.kinds import outgoing
from hvdnb.protocol.knobs import KnobTextError, make_spec, parse, validate
from hvdnb.protocol.remote import RUN_CELL, RemoteCall
from hvdnb.protocol.wire import encode
from hvdnb.rank.channel import EngineChannel

KEY = b"k" * 32


def _wait(cond, timeout=5.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.01)
    return False


def test_every_kind_is_defined_once_with_a_sender():
    # the module's own constants (tests and plugins may register more in this process)
    own = [v for n in kinds.__all__ if isinstance(v := getattr(kinds, n), kinds.Kind)]
    names = [k.name for k in own]
    assert len(names) == len(set(names)) == 24
    assert {k.sender for k in own} == {"rank", "notebook", "both"}
    for k in own:
        assert kinds.lookup(k.name) is k
        assert not set(k.required) & set(k.optional), k


def test_unknown_kind_and_missing_field_are_clear_errors():
    with pytest.raises(kinds.ProtocolError, match=r"unknown message kind 'knob_req'.*knobs_req"):
        kinds.check({"kind": "knob_req", "id": "k1", "values": {}})
    with pytest.raises(kinds.ProtocolError, match=r"'knobs_req' message without 'values'"):
        kinds.check({"kind": "knobs_req", "id": "k1"})
    assert kinds.check({"kind": "knobs_req", "id": "k1", "values": {"lr": 0.1}}) is kinds.KNOBS_REQ
    # the sender's side: the same check before anything is queued
    with pytest.raises(kinds.ProtocolError, match="without 'line'"):
        outgoing(kinds.PDB_CMD, {})
    with pytest.raises(TypeError, match=r"hvdnb\.protocol\.kinds constants"):
        outgoing("pdb_cmd", {"line": "c"})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="already defined"):
        kinds.register(kinds.Kind("metrics", "rank"))


def test_a_channel_refuses_bare_strings_and_drops_malformed_messages():
    """Signed messages of an unknown kind or without a required field are counted and never
    reach a handler; a well-formed one after them still does."""
    import zmq

    ch = ClientChannel(key=KEY)
    got: list[dict] = []
    ch.on(kinds.KNOBS_SPEC, got.append)
    with pytest.raises(TypeError):
        ch.on("knobs_spec", got.append)  # type: ignore[arg-type]
    with pytest.raises(kinds.ProtocolError):
        ch.send(0, kinds.KNOBS_REQ, id="k1")  # no values: refused before it is queued
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.connect(ch.endpoint)
    try:
        sock.send_multipart(encode(KEY, {"kind": "knobs_spek", "rank": 0, "spec": {}}))
        sock.send_multipart(encode(KEY, {"kind": "knobs_spec", "rank": 0}))
        sock.send_multipart(encode(KEY, {"kind": "knobs_spec", "rank": 0, "spec": {"a": 1}}))
        assert _wait(lambda: got)
        assert ch.invalid == 2 and [m["spec"] for m in got] == [{"a": 1}]
    finally:
        sock.close(0)
        ch.close()


def test_engine_channel_adds_its_rank_and_checks_fields():
    ch = ClientChannel(key=KEY)
    got: list[dict] = []
    ch.on(kinds.RANK_INFO, got.append)
    eng = EngineChannel(ch.endpoint, KEY, rank=5)
    try:
        with pytest.raises(kinds.ProtocolError, match="without 'local_rank'"):
            eng.send(kinds.RANK_INFO, host="h", pid=1)
        eng.send(kinds.RANK_INFO, host="h", pid=1, local_rank=0)
        assert _wait(lambda: got)
        assert got[0]["rank"] == 5 and got[0]["kind"] == "rank_info"
    finally:
        eng.close()
        ch.close()


def test_knob_text_parser_serves_magic_and_panel_alike():
    assert parse("lr=0.05, warmup_steps=50") == {"lr": 0.05, "warmup_steps": 50}
    assert parse(["lr=1e-3", "batch_size=64"]) == {"lr": 0.001, "batch_size": 64}
    assert parse("batch_size = 128") == {"batch_size": 128}
    assert type(parse("x=-3")["x"]) is int and type(parse("x=3.0")["x"]) is float
    for bad, words in (
        ("lr", "write name=value"),
        ("lr=fast", "'fast' is not a number"),
        ("1lr=3", "write name=value"),
        ("", "no values given"),
    ):
        with pytest.raises(KnobTextError, match=words):
            parse(bad)


def test_one_validator_with_words_a_person_can_act_on():
    spec = make_spec({"batch_size": 64, "lr": 0.1})
    assert validate(spec, {"batch_size": 128, "lr": 0.2}) is None
    assert validate(spec, {"batch_size": 64.0}) is None  # a whole float is a whole number
    assert "whole number" in validate(spec, {"batch_size": 1.5})
    assert "out of range" in validate(spec, {"batch_size": 0})
    assert "unknown knob 'lrr'" in validate(spec, {"lrr": 0.1})
    assert "finite" in validate(spec, {"lr": float("nan")})
    assert "bool" in validate(spec, {"lr": True})


def test_remote_calls_pickle_as_a_name_and_resolve_where_called():
    data = pickle.dumps(RUN_CELL)
    assert b"hvdnb.rank.engine:run_cell" in data and len(data) < 120
    call = pickle.loads(data)
    assert call.target == RUN_CELL.target
    assert RemoteCall("json:dumps")([1, 2]) == "[1, 2]"
    with pytest.raises(ValueError, match="module:function"):
        RemoteCall("json.dumps")
