"""The publishing side: codecs, tracking, policies, stores, the commit protocol, restore.

    from publisher import open_store, open_announcer, restore, Subscriber, ModuleSink

    store = open_store("s3://models/prod")             # or file:///PATH
    state = restore(store, "ranker", version=7)         # any committed version, as arrays
    announcer = open_announcer("kafka://broker:9092/models", "ranker")

The writing half's engine (`CheckpointPublisher`, `BackgroundPublisher`, `VersionWriter`, the
`Snapshot` it publishes) is what trainer/ drives; the read half (`Subscriber` and its sinks) is
publisher/read's face, re-exported here. Names load on first use, so the light commands
(`checknrun ls`, `inspect`) import no more than they need.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from schemas.lazy_face import lazy_face

if TYPE_CHECKING:
    from publisher.bus import open_announcer, open_source
    from publisher.read.catalog import Catalog, NoVersionError
    from publisher.read.module_state import load_module_state
    from publisher.read.restore import RestoredState, restore
    from publisher.read.sinks import ModuleSink, TensorSink
    from publisher.read.subscriber import Subscriber
    from publisher.store import ObjectStore, StoreError, open_store
    from publisher.write.background import BackgroundPublisher
    from publisher.write.job_publishing import CheckpointPublisher
    from publisher.write.publishing import PublishResult
    from publisher.write.snapshot import Snapshot, TableRows
    from publisher.write.version_writer import VersionWriter

_EXPORTS = {
    "BackgroundPublisher": "publisher.write.background",
    "Catalog": "publisher.read.catalog",
    "CheckpointPublisher": "publisher.write.job_publishing",
    "ModuleSink": "publisher.read.sinks",
    "NoVersionError": "publisher.read.catalog",
    "ObjectStore": "publisher.store",
    "PublishResult": "publisher.write.publishing",
    "RestoredState": "publisher.read.restore",
    "Snapshot": "publisher.write.snapshot",
    "StoreError": "publisher.store",
    "Subscriber": "publisher.read.subscriber",
    "TableRows": "publisher.write.snapshot",
    "TensorSink": "publisher.read.sinks",
    "VersionWriter": "publisher.write.version_writer",
    "load_module_state": "publisher.read.module_state",
    "open_announcer": "publisher.bus",
    "open_source": "publisher.bus",
    "open_store": "publisher.store",
    "restore": "publisher.read.restore",
}
__getattr__ = lazy_face(__name__, _EXPORTS)

__all__ = [
    "BackgroundPublisher",
    "Catalog",
    "CheckpointPublisher",
    "ModuleSink",
    "NoVersionError",
    "ObjectStore",
    "PublishResult",
    "RestoredState",
    "Snapshot",
    "StoreError",
    "Subscriber",
    "TableRows",
    "TensorSink",
    "VersionWriter",
    "load_module_state",
    "open_announcer",
    "open_source",
    "open_store",
    "restore",
]
