"""The publishing side's trainer: online training of a DLRM (or a user's model) on a stream.

    from trainer import IncrementalCheckpointer, train_online

    ckpt = IncrementalCheckpointer(model, optimizers, store="file:///tmp/store", model_name="m")
    ...train; ckpt.step(len(batch)); ckpt.maybe_checkpoint(reader={"offset": n})...

Batches are scored before they are trained on (progressive validation); at every interval
boundary `IncrementalCheckpointer` copies the rows modified since the last checkpoint and hands
them to a background publisher that quantizes, commits and announces them. `ShardedCheckpointer`
does the same for each rank of a model TorchRec shards over N processes (the 'sharded' extra);
`load_restored` puts a committed version back into a model and its optimizers to train on.
These names load on first use, so `import trainer.options` (the `train` options) stays light.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from schemas.lazy_face import lazy_face

if TYPE_CHECKING:
    from trainer.checkpoint_records import CheckpointRecord
    from trainer.checkpointer import IncrementalCheckpointer
    from trainer.errors import CheckpointError, RankFailedError
    from trainer.online import TrainingReport, build_dlrm, build_optimizers, train_online
    from trainer.progressive_metrics import ProgressiveMetrics
    from trainer.resume import load_restored
    from trainer.sharded.checkpointing import ShardedCheckpointer
    from trainer.streams.base import Batch, InteractionStream

_EXPORTS = {
    "Batch": "trainer.streams.base",
    "CheckpointError": "trainer.errors",
    "CheckpointRecord": "trainer.checkpoint_records",
    "IncrementalCheckpointer": "trainer.checkpointer",
    "InteractionStream": "trainer.streams.base",
    "ProgressiveMetrics": "trainer.progressive_metrics",
    "RankFailedError": "trainer.errors",
    "ShardedCheckpointer": "trainer.sharded.checkpointing",
    "TrainingReport": "trainer.online",
    "build_dlrm": "trainer.online",
    "build_optimizers": "trainer.online",
    "load_restored": "trainer.resume",
    "train_online": "trainer.online",
}
__getattr__ = lazy_face(__name__, _EXPORTS)

__all__ = [
    "Batch",
    "CheckpointError",
    "CheckpointRecord",
    "IncrementalCheckpointer",
    "InteractionStream",
    "ProgressiveMetrics",
    "RankFailedError",
    "ShardedCheckpointer",
    "TrainingReport",
    "build_dlrm",
    "build_optimizers",
    "load_restored",
    "train_online",
]
