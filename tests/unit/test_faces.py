"""Each package's public face: every name it lists resolves, and nothing else does."""

from __future__ import annotations

import importlib

import pytest

FACES = ("trainer", "publisher", "publisher.read", "publisher.store")


@pytest.mark.parametrize("package", FACES)
def test_every_listed_name_resolves(package: str) -> None:
    module = importlib.import_module(package)
    missing = [name for name in module.__all__ if getattr(module, name, None) is None]
    assert missing == []


def test_the_faces_name_the_public_api() -> None:
    import publisher
    import trainer
    from publisher.read.restore import restore
    from trainer.checkpointer import IncrementalCheckpointer
    from trainer.sharded.checkpointing import ShardedCheckpointer

    assert trainer.IncrementalCheckpointer is IncrementalCheckpointer
    assert trainer.ShardedCheckpointer is ShardedCheckpointer
    assert publisher.restore is restore
    assert {"open_store", "open_announcer", "open_source", "Subscriber"} <= set(publisher.__all__)


def test_an_unlisted_name_is_an_attribute_error() -> None:
    import trainer

    with pytest.raises(AttributeError, match="no attribute 'cmd_train'"):
        trainer.cmd_train  # noqa: B018
