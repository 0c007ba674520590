"""The read side: keep any model at the newest verified version, or rebuild any version.

    from publisher.read import ModuleSink, Subscriber

    sink = ModuleSink(build)          # build(model_config) -> your nn.Module (or a module to copy)
    with Subscriber("s3://models/prod", "ranker", sink, bus="kafka://broker:9092/models") as sub:
        sub.start().wait_for_version()
        with sink.reader() as copy:   # one version for the whole read
            scores = copy.module(*inputs)

    state = restore(open_store(url), "ranker", version=7)    # any committed version, as arrays
    id_maps = load_module_state(module, state)               # into any module of its model

A subscriber takes no lease: it reads while a trainer publishes. The catalog, planner, follower,
consistency schemes and held tables behind it are this package's modules; these names are its
public face (docs/SUBSCRIBER.md).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from schemas.lazy_face import lazy_face

if TYPE_CHECKING:
    from publisher.model_factory import ModelFactory
    from publisher.read.catalog import Catalog, ModelNotFoundError, NoVersionError, VersionRef
    from publisher.read.consistency import UpdateResult
    from publisher.read.errors import (
        ApplyError,
        NonFiniteError,
        NotBootstrappedError,
        PinnedError,
        ShuttingDownError,
        SubscriberError,
    )
    from publisher.read.model_copy import ModelCopy, ServedVersion
    from publisher.read.module_state import ModuleStateError, load_module_state
    from publisher.read.observer import SubscriberObserver
    from publisher.read.restore import RestoredState, RestoreError, restore
    from publisher.read.scheme_names import ConsistencyScheme
    from publisher.read.sinks import ModuleSink, TensorSink, VersionSink
    from publisher.read.subscriber import Subscriber, SubscriberOptions, rejection_reason

# Names load on first use: the store commands (`checknrun ls`, `inspect`, `gc`) and the server's
# command line import `publisher.read.catalog` without the subscriber's torch (2 s to import).
_EXPORTS = {
    "ApplyError": "publisher.read.errors",
    "Catalog": "publisher.read.catalog",
    "ConsistencyScheme": "publisher.read.scheme_names",
    "ModelCopy": "publisher.read.model_copy",
    "ModelFactory": "publisher.model_factory",
    "ModelNotFoundError": "publisher.read.catalog",
    "ModuleSink": "publisher.read.sinks",
    "ModuleStateError": "publisher.read.module_state",
    "NoVersionError": "publisher.read.catalog",
    "NonFiniteError": "publisher.read.errors",
    "NotBootstrappedError": "publisher.read.errors",
    "PinnedError": "publisher.read.errors",
    "RestoreError": "publisher.read.restore",
    "RestoredState": "publisher.read.restore",
    "ServedVersion": "publisher.read.model_copy",
    "ShuttingDownError": "publisher.read.errors",
    "Subscriber": "publisher.read.subscriber",
    "SubscriberError": "publisher.read.errors",
    "SubscriberObserver": "publisher.read.observer",
    "SubscriberOptions": "publisher.read.subscriber",
    "TensorSink": "publisher.read.sinks",
    "UpdateResult": "publisher.read.consistency",
    "VersionRef": "publisher.read.catalog",
    "VersionSink": "publisher.read.sinks",
    "load_module_state": "publisher.read.module_state",
    "rejection_reason": "publisher.read.subscriber",
    "restore": "publisher.read.restore",
}
__getattr__ = lazy_face(__name__, _EXPORTS)

__all__ = [
    "ApplyError",
    "Catalog",
    "ConsistencyScheme",
    "ModelCopy",
    "ModelFactory",
    "ModelNotFoundError",
    "ModuleSink",
    "ModuleStateError",
    "NoVersionError",
    "NonFiniteError",
    "NotBootstrappedError",
    "PinnedError",
    "RestoreError",
    "RestoredState",
    "ServedVersion",
    "ShuttingDownError",
    "Subscriber",
    "SubscriberError",
    "SubscriberObserver",
    "SubscriberOptions",
    "TensorSink",
    "UpdateResult",
    "VersionRef",
    "VersionSink",
    "load_module_state",
    "rejection_reason",
    "restore",
]
