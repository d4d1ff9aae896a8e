"""The manifest's clients held as columns: same file, same entries, a size that does not grow in objects."""

import gc
import json
import types

import pytest
from pydantic import ValidationError

from data_prep.manifest import ClientEntry, ClientTable, Manifest, Shard


def _client(i: int, labels: int = 3) -> ClientEntry:
    lang = ("en", "de", "fr")[i % 3]
    hist = [(i + k) % 5 for k in range(labels)]
    return ClientEntry(
        id=f"{lang}-{i:05d}",
        language=lang,
        edge=f"edge-{lang}",
        cluster=lang,
        train=Shard(path=f"clients/train.arrow[{i}:{i + 7}]", size=7 + i % 4, label_hist=hist),
        test=Shard(path=f"clients/test.arrow[{i}:{i + 2}]", size=i % 3, label_hist=hist[::-1]),
    )


def _manifest(clients: list[ClientEntry]) -> Manifest:
    empty = Shard(path="proxy/test", size=0, label_hist=[0, 0, 0])
    return Manifest(
        fingerprint="hand-0001",
        source="by hand",
        task="classification",
        labels=["x", "y", "z"],
        tokenizer="none",
        vocab_size=10,
        pad_token_id=0,
        clients=clients,  # type: ignore[arg-type]  # validated into a ClientTable
        proxy_train=empty,
        proxy_test=empty,
        unused_pool_rows=0,
    )


def test_the_file_is_unchanged_and_reads_back_as_the_same_entries(tmp_path):
    entries = [_client(i) for i in range(50)]
    manifest = _manifest(entries)
    manifest.write(tmp_path)
    as_written = json.loads((tmp_path / "manifest.json").read_text())
    assert as_written["clients"] == [c.model_dump() for c in entries]  # the list of entries, as before

    read = Manifest.read(tmp_path)
    assert isinstance(read.clients, ClientTable) and read == manifest
    assert list(read.clients) == entries and read.clients[-1] == entries[-1] and read.clients[3:5] == entries[3:5]
    assert read.clients.by_id("de-00007") == entries[7]
    assert read.clients.test_size.tolist() == [c.test.size for c in entries]
    assert read.clients.train_hist[11].tolist() == entries[11].train.label_hist
    assert [c.id for c in read.tree_clients()] == [c.id for c in entries]
    assert [c.num_train for c in read.tree_clients()] == [c.train.size for c in entries]
    with pytest.raises(KeyError, match="no client 'xx-1'"):
        read.clients.by_id("xx-1")


def _tracked_objects_reachable_from(root: object) -> int:
    """Container objects the garbage collector walks that `root` keeps alive: counted from `root` itself, not
    from the whole process (whose count moves with whatever else ran before in this worker)."""
    seen: set[int] = set()
    stack = [root]
    while stack:
        item = stack.pop()
        if id(item) in seen or isinstance(item, (type, types.ModuleType, types.FunctionType)):
            continue
        seen.add(id(item))
        stack.extend(ref for ref in gc.get_referents(item) if gc.is_tracked(ref))
    return len(seen)


def test_held_clients_are_a_few_objects_however_many_there_are(tmp_path):
    """As pydantic entries a client kept ~30 tracked objects alive (300k at 10,000 clients, walked by every
    full collection); as columns the manifest keeps the same few objects for 10 clients or 3,000."""

    def kept_objects(count: int) -> int:
        _manifest([_client(i) for i in range(count)]).write(tmp_path)
        manifest = Manifest.read(tmp_path)
        assert len(manifest.clients) == count
        return _tracked_objects_reachable_from(manifest)

    small, large = kept_objects(10), kept_objects(3_000)
    assert large - small < 20, (small, large)  # as pydantic entries: ~90,000 more
    entries = _manifest([_client(i) for i in range(3_000)])
    entries.clients = list(entries.clients)  # what the old manifest held
    assert _tracked_objects_reachable_from(entries) - large > 3_000 * 5  # the count sees per-client objects


def test_a_bad_entry_is_named_and_a_duplicate_id_refused(tmp_path):
    _manifest([_client(i) for i in range(3)]).write(tmp_path)
    data = json.loads((tmp_path / "manifest.json").read_text())
    data["clients"][2]["train"]["size"] = "many"
    (tmp_path / "manifest.json").write_text(json.dumps(data))
    with pytest.raises(ValidationError, match=r"2\.train\.size"):
        Manifest.read(tmp_path)
    with pytest.raises(ValidationError, match="client ids must be unique"):
        _manifest([_client(1), _client(1)])
