"""Units of vLLM-style encoder disaggregation: the safetensors writer and reader, the shared-folder
connector's counters, `ec_transfer_params`, and `--ec-transfer-config` checking. The worker
processes are tests/engine/test_ec_connector.py."""

from __future__ import annotations

import json
import os
from types import SimpleNamespace

import numpy as np
import pytest

from pdgate.engine import EngineConfig, EngineConfigError
from pdgate.engine.ec_connector import ECExampleConnector, transfer_params
from pdgate.engine.safetensors_file import SafetensorsError, dumps, loads_f32, read_f32, write_atomic

SHAPE = (16, 64)


def rows(seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(SHAPE).astype(np.float32)


def test_the_file_layout_is_safetensors():
    data = dumps({"ec_cache": rows()}, {"format": "pt"})
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + n])
    assert (8 + n) % 8 == 0  # the data starts aligned
    assert header["ec_cache"] == {"dtype": "F32", "shape": [16, 64], "data_offsets": [0, 16 * 64 * 4]}
    assert header["__metadata__"] == {"format": "pt"}
    assert len(data) == 8 + n + 16 * 64 * 4
    assert np.array_equal(loads_f32(data, "ec_cache", SHAPE), rows())


def test_the_safetensors_package_agrees_both_ways(tmp_path):
    st = pytest.importorskip("safetensors.numpy", reason="safetensors is in the test extra")
    ours = tmp_path / "ours.safetensors"
    write_atomic(str(ours), {"ec_cache": rows(1), "other": rows(2)[:3]})
    back = st.load_file(str(ours))
    assert np.array_equal(back["ec_cache"], rows(1)) and np.array_equal(back["other"], rows(2)[:3])
    theirs = tmp_path / "theirs.safetensors"
    st.save_file({"ec_cache": rows(3)}, str(theirs))
    assert np.array_equal(read_f32(str(theirs), "ec_cache", SHAPE), rows(3))


def test_write_atomic_replaces_and_leaves_no_temporary_file(tmp_path):
    path = str(tmp_path / "f.safetensors")
    write_atomic(path, {"ec_cache": rows(1)})
    write_atomic(path, {"ec_cache": rows(2)})
    assert np.array_equal(read_f32(path, "ec_cache", SHAPE), rows(2))
    assert os.listdir(tmp_path) == ["f.safetensors"]


def test_a_failed_write_leaves_nothing(tmp_path, monkeypatch):
    path = str(tmp_path / "f.safetensors")

    def broken(*a, **k):
        raise OSError("disk full")
    monkeypatch.setattr(os, "replace", broken)
    with pytest.raises(OSError):
        write_atomic(path, {"ec_cache": rows()})
    assert os.listdir(tmp_path) == []


GOOD = dumps({"ec_cache": rows()})
BAD = {
    "empty": b"",
    "short header": GOOD[:6],
    "header past the end": (10**6).to_bytes(8, "little") + b"{}",
    "header not JSON": (4).to_bytes(8, "little") + b"nope",
    "truncated data": GOOD[:-4],
    "trailing bytes": GOOD + b"\0\0\0\0",
    "wrong name": dumps({"cache": rows()}),
    "wrong shape": dumps({"ec_cache": rows()[:8]}),
    "transposed": dumps({"ec_cache": rows().T.copy()}),
    "nan": dumps({"ec_cache": np.full(SHAPE, np.nan, np.float32)}),
    "inf": dumps({"ec_cache": np.full(SHAPE, np.inf, np.float32)}),
}


def _with_header(header: dict, body: bytes) -> bytes:
    blob = json.dumps(header).encode()
    return len(blob).to_bytes(8, "little") + blob + body


BAD.update({
    "F16": _with_header({"ec_cache": {"dtype": "F16", "shape": [16, 64], "data_offsets": [0, 2048]}}, b"\0" * 2048),
    "offsets short": _with_header({"ec_cache": {"dtype": "F32", "shape": [16, 64], "data_offsets": [0, 64]}},
                                  b"\0" * 4096),
    "offsets not ints": _with_header({"ec_cache": {"dtype": "F32", "shape": [16, 64], "data_offsets": "0-4096"}},
                                     b"\0" * 4096),
    "header a list": _with_header([1, 2], b""),  # type: ignore[arg-type]
})


@pytest.mark.parametrize("name", list(BAD))
def test_a_bad_file_is_refused(name):
    with pytest.raises(SafetensorsError):
        loads_f32(BAD[name], "ec_cache", SHAPE)


def _connector(tmp_path, role: str = "ec_both") -> ECExampleConnector:
    cfg = {"ec_role": role, "ec_connector_extra_config": {"shared_storage_path": str(tmp_path)}}
    return ECExampleConnector(cfg, SHAPE)


def test_the_connector_saves_loads_and_counts(tmp_path):
    ec = _connector(tmp_path)
    h = "ab" * 32
    assert ec.load(h) is None and ec.counts["missing"] == 1
    assert ec.save(h, rows(5)) and ec.exists(h)
    assert ec.filename(h) == os.path.join(str(tmp_path), h, "encoder_cache.safetensors")
    assert np.array_equal(ec.load(h), rows(5)) and ec.counts["loaded"] == 1
    with open(ec.filename(h), "wb") as f:
        f.write(b"junk")
    assert ec.load(h) is None and ec.counts["invalid"] == 1
    os.remove(ec.filename(h))
    os.makedirs(ec.filename(h))  # a folder where the file should be: unreadable, not a crash
    assert ec.load(h) is None and ec.counts["invalid"] == 2
    assert ec.counts["saved"] == 1 and ec.counts["save_failed"] == 0


def test_a_connector_that_cannot_write_counts_it(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    ec = _connector(blocker)
    assert not ec.save("cd" * 32, rows()) and ec.counts["save_failed"] == 1


@pytest.mark.parametrize("role, producer, consumer, encode_only", [
    ("ec_producer", True, False, True), ("ec_consumer", False, True, False), ("ec_both", True, True, False)])
def test_roles(tmp_path, role, producer, consumer, encode_only):
    ec = _connector(tmp_path, role)
    assert (ec.producer, ec.consumer, ec.encode_only) == (producer, consumer, encode_only)


def test_transfer_params_group_by_hash():
    imgs = [SimpleNamespace(index=i, content_hash=h) for i, h in enumerate(["a", "b", "a"])]
    assert transfer_params(imgs) == {"a": {"item_indices": [0, 2], "metadata": {}},
                                     "b": {"item_indices": [1], "metadata": {}}}
    assert transfer_params([]) is None


def _ec(**kw) -> dict:
    return dict({"ec_connector": "ECExampleConnector", "ec_role": "ec_consumer"}, **kw)


def test_the_config_is_resolved_with_vllm_s_default_path():
    c = EngineConfig(model="tiny-mm", ec_transfer_config=json.dumps(_ec())).resolved()
    assert c.ec_transfer_config["ec_connector_extra_config"] == {"shared_storage_path": "/tmp"}
    assert c.api_flavor == "vllm" and c.disaggregation_mode == "null"
    assert c.resolved() == c
    kv = {"kv_connector": "NixlConnector", "kv_role": "kv_producer"}
    p = EngineConfig(model="tiny-mm", kv_transfer_config=kv, ec_transfer_config=_ec()).resolved()
    assert p.disaggregation_mode == "prefill"  # a consumer can be a NIXL prefill


@pytest.mark.parametrize("changes, why", [
    ({"ec_transfer_config": "{not json"}, "not JSON"),
    ({"ec_transfer_config": "[1]"}, "JSON object"),
    ({"ec_transfer_config": _ec(ec_connector="ECMooncakeConnector")}, "ECMooncakeConnector.*ECExampleConnector"),
    ({"ec_transfer_config": {"ec_role": "ec_consumer"}}, "None.*ECExampleConnector"),
    ({"ec_transfer_config": _ec(ec_role="kv_consumer")}, "ec_role 'kv_consumer'"),
    ({"ec_transfer_config": _ec(ec_role=None)}, "ec_role None"),
    ({"ec_transfer_config": _ec(shared_storage_path="/x")}, "unknown field.*shared_storage_path"),
    ({"ec_transfer_config": _ec(ec_connector_extra_config=[])}, "ec_connector_extra_config"),
    ({"ec_transfer_config": _ec(ec_connector_extra_config={"shared_storage_path": ""})}, "shared_storage_path"),
    ({"ec_transfer_config": _ec(ec_connector_module_path="my.mod")}, "module"),
    ({"ec_transfer_config": _ec(), "encoder_only": True}, "--encoder-only"),
    ({"ec_transfer_config": _ec(ec_role="ec_producer"), "disaggregation_mode": "prefill"}, "encoder-only instance"),
    ({"ec_transfer_config": _ec(ec_role="ec_producer"),
      "kv_transfer_config": {"kv_connector": "NixlConnector", "kv_role": "kv_consumer"}}, "encoder-only instance"),
])
def test_a_bad_ec_transfer_config_is_refused(changes, why):
    with pytest.raises(EngineConfigError, match=why):
        EngineConfig(model="tiny-mm", **changes).resolved()


def test_a_model_without_a_tower_is_refused():
    from pdgate.engine import Engine

    with pytest.raises(EngineConfigError, match="multimodal model"):
        Engine(EngineConfig(model="tiny", ec_transfer_config=_ec()))
