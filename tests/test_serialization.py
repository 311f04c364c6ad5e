"""Loading saved state without running code (embcache.serialization).

Each hostile file holds an object that, unpickled by an unpickler that runs code, creates a
marker file. The oracle: loading it is refused with one line naming the file, and the marker
does not exist."""

from __future__ import annotations

import dataclasses
import io
import pickle

import pytest
import torch
import torch.distributed.checkpoint as dcp

from embcache import CachedLowPrecisionEmbedding
from embcache.resharding import SavedTables
from embcache.serialization import UnsafeFileError, load, load_dcp, read_metadata

OPTIONS = dict(precision="int8", cache_ratio=0.1, optimizer="rowwise_adagrad", name="t")
PREFIX = "model.tables."


class CreatesFile:
    """Unpickled, creates the file ``marker``: it pickles as the call ``open(marker, "w")``."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


def _table() -> CachedLowPrecisionEmbedding:
    """A small table with rows cached and optimizer state set."""
    table = CachedLowPrecisionEmbedding(300, 8, **OPTIONS)
    table(torch.arange(30).view(10, 3)).sum().backward()
    table.step()
    return table


def _save_table(path, table: CachedLowPrecisionEmbedding) -> None:
    dcp.save({"model": {"tables": {"t": table.state_dict()}}}, checkpoint_id=path, no_dist=True)


def _refused(error: pytest.ExceptionInfo, where) -> str:
    """The refusal's message, checked to be one line that names ``where`` first."""
    message = str(error.value)
    assert "\n" not in message and message.startswith(f"{where}: refused: ")
    return message


def _assert_same_state(loaded: dict, saved: dict) -> None:
    assert loaded.keys() == saved.keys()
    for key, value in saved.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(loaded[key], value), key
        else:
            assert loaded[key] == value, key


def test_load_refuses_a_file_that_would_run_code(tmp_path):
    marker, path = tmp_path / "marker", tmp_path / "hostile.pt"
    torch.save({"weights": torch.ones(3), "x": CreatesFile(marker)}, path)
    for read, where in [
        (lambda: load(path), path),
        (lambda: load(path, mmap=True), path),
        (lambda: load(io.BytesIO(path.read_bytes()), what="the blob"), "the blob"),
    ]:
        with pytest.raises(UnsafeFileError) as error:
            read()
        assert "open" in _refused(error, where)
    assert not marker.exists()


def test_load_reads_tensors_and_plain_data(tmp_path):
    table = _table()
    saved = {"table": table.state_dict(), "plain": {"n": 3, "s": "x", "l": [1.5, None]}}
    torch.save(saved, tmp_path / "state.pt")
    loaded = load(tmp_path / "state.pt")
    assert loaded["plain"] == saved["plain"]
    _assert_same_state(loaded["table"], saved["table"])


def test_a_dcp_metadata_that_would_run_code_is_refused(tmp_path):
    marker, path = tmp_path / "marker", tmp_path / "ckpt"
    _save_table(path, _table())
    metadata = read_metadata(path)
    metadata.planner_data["x"] = CreatesFile(marker)
    (path / ".metadata").write_bytes(pickle.dumps(metadata))
    with pytest.raises(UnsafeFileError) as error:
        SavedTables.from_dcp(path, PREFIX)
    assert "open" in _refused(error, path / ".metadata")
    with pytest.raises(UnsafeFileError) as error:
        load_dcp({"model": {"tables": {"t": _table().state_dict()}}}, path, no_dist=True)
    assert "open" in _refused(error, path / ".metadata")
    assert not marker.exists()


@pytest.mark.parametrize("stored", ["object", "bytes_io"])
def test_a_dcp_item_that_would_run_code_is_refused(tmp_path, stored):
    """DCP saves a non-tensor item with ``torch.save``: the object itself, or an
    ``io.BytesIO`` (which would hand its bytes, unchecked, to whoever reads the item)."""
    marker, path = tmp_path / "marker", tmp_path / "ckpt"
    item = CreatesFile(marker)
    if stored == "bytes_io":
        item = io.BytesIO()
        torch.save(CreatesFile(marker), item)
    dcp.save({"w": torch.ones(3), "x": item}, checkpoint_id=path, no_dist=True)
    with pytest.raises(UnsafeFileError) as error:
        load_dcp({"w": torch.empty(3), "x": None}, path, no_dist=True)
    _refused(error, f"{path} (x)")
    assert not marker.exists()


def plant_in_tensor_item(path, fqn: str, payload: bytes) -> str:
    """Make the stored bytes of the tensor item ``fqn`` of the DCP checkpoint ``path`` be
    ``payload`` (in a data file of its own, the metadata pointing there); the file's name."""
    metadata = read_metadata(path)
    (index,) = [i for i in metadata.storage_data if i.fqn == fqn]
    name = "__planted.distcp"
    (path / name).write_bytes(payload)
    stored = dataclasses.replace(
        metadata.storage_data[index], relative_path=name, offset=0, length=len(payload)
    )
    metadata.storage_data[index] = stored
    (path / ".metadata").write_bytes(pickle.dumps(metadata))
    return name


@pytest.mark.parametrize("stored", ["code", "data", "no_pickle"])
def test_a_dcp_tensor_item_that_holds_anything_but_a_tensor_is_refused(tmp_path, stored):
    """DCP reads a tensor item with torch's weights-only unpickler; its stored bytes here are
    a ``torch.save`` of an object that would run code, or of plain data, or no pickle."""
    marker, path = tmp_path / "marker", tmp_path / "ckpt"
    dcp.save({"w": torch.ones(3), "x": torch.zeros(4)}, checkpoint_id=path, no_dist=True)
    payload = io.BytesIO()
    if stored == "no_pickle":
        payload.write(b"PK\x03\x04" + bytes(60))
    else:
        torch.save(CreatesFile(marker) if stored == "code" else {"x": [1, 2]}, payload)
    name = plant_in_tensor_item(path, "x", payload.getvalue())
    state = {"w": torch.empty(3), "x": torch.empty(4)}
    with pytest.raises(UnsafeFileError) as error:
        load_dcp(state, path, no_dist=True)
    message = _refused(error, f"{path / name} (x)")
    if stored == "code":
        assert "would call io.open" in message
    else:
        assert "it holds more than a tensor" in message
    assert not marker.exists()


def test_a_dcp_tensor_item_that_holds_another_tensor_fails_as_dcp_fails(tmp_path):
    """Stored bytes that are a tensor, only not of the metadata's shape, are no refusal."""
    dcp.save({"x": torch.zeros(4)}, checkpoint_id=tmp_path, no_dist=True)
    other = io.BytesIO()
    torch.save(torch.zeros(3), other)
    plant_in_tensor_item(tmp_path, "x", other.getvalue())
    with pytest.raises(BaseException, match="mismatch sizes") as error:
        load_dcp({"x": torch.empty(4)}, tmp_path, no_dist=True)
    assert not isinstance(error.value, UnsafeFileError)


def test_a_dcp_checkpoint_of_data_loads_as_saved(tmp_path):
    table, plain = _table(), {"n": 3, "s": "x", "w": torch.arange(4)}
    # a tuple is one DCP item (a dict would be split into its leaves)
    dcp.save({"t": table.state_dict(), "plain": (plain,)}, checkpoint_id=tmp_path, no_dist=True)
    state = {"t": CachedLowPrecisionEmbedding(300, 8, **OPTIONS).state_dict(), "plain": None}
    load_dcp(state, tmp_path, no_dist=True)
    _assert_same_state(state["t"], table.state_dict())
    (loaded,) = state["plain"]
    _assert_same_state(loaded, plain)


def test_tables_load_from_dcp_as_saved(tmp_path):
    table = _table()
    _save_table(tmp_path, table)
    _assert_same_state(SavedTables.from_dcp(tmp_path, PREFIX).read("t"), table.state_dict())
