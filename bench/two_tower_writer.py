"""Versions of examples.two_tower of exactly the size a benchmark asks for, written by the real
`IncrementalCheckpointer` (its id maps included), without training.

    writer = TwoTowerWriter(store_url, "two_tower", config, codec="int4", seed=0)
    v1 = writer.publish(full=True)
    writer.touch_rows("item", 100_000)       # exactly these rows change, marked dirty
    v2 = writer.publish()                    # a delta of 100k item rows

Every id-mapped row is held by the raw id `<table's first letter><row>` (`held_entries`), so a
request can name any row by a raw id. The tables are optimised by plain SGD: no per-row state,
so a blob carries rows (and id-map entries) only, as the DLRM's synthetic versions do
(bench/synthetic_run.py).
"""

from __future__ import annotations

import numpy as np
import torch

from examples import two_tower
from publisher.id_map import IdMap
from schemas.id_map_blob import IdEntries
from trainer.checkpointer import IncrementalCheckpointer

#: the two-tower model's tables with id maps.
MAPPED_TABLES = ("user", "item")


def held_entries(rows: int, prefix: str) -> IdEntries:
    """Every row but the unknown row 0 held by the raw id `<prefix><row>`."""
    assigned = np.ones(rows, dtype=np.bool_)
    assigned[0] = False
    keys = ("", *(f"{prefix}{r}" for r in range(1, rows)))
    return IdEntries(assigned, np.zeros(rows, dtype=np.int64), np.zeros(rows), keys)


class TwoTowerWriter:
    """The two-tower model as its trainer publishes it (module docstring)."""

    def __init__(
        self,
        store_url: str,
        name: str,
        config: two_tower.TwoTowerConfig,
        *,
        codec: str = "int4",
        seed: int = 0,
        bus: str | None = None,
    ) -> None:
        torch.manual_seed(seed)
        self.model = two_tower.TwoTower(config)
        self.rng = np.random.default_rng(seed)
        maps = {table: IdMap(getattr(config, table + "s")) for table in MAPPED_TABLES}
        for table, id_map in maps.items():
            rows = np.arange(id_map.rows, dtype=np.int64)
            id_map.apply(rows, held_entries(id_map.rows, table[0]))
        m = self.model
        tables = [m.user.weight, m.history.weight, m.item.weight, m.category.weight]
        towers = [*m.user_tower.parameters(), *m.item_tower.parameters()]
        self.checkpointer = IncrementalCheckpointer(
            m,
            [torch.optim.SGD(tables, lr=0.05), torch.optim.SGD(towers, lr=0.01)],
            store=store_url,
            model_name=name,
            policy="consecutive",
            codec=codec,
            model_config=config.to_json(),
            id_maps=maps,
            bus=bus,
            preallocate=False,
        )

    def touch_rows(self, table: str, n_rows: int) -> None:
        """Change exactly `n_rows` distinct rows of `table` and mark them dirty."""
        weight = getattr(self.model, table).weight
        ids = torch.from_numpy(np.sort(self.rng.choice(weight.shape[0], n_rows, replace=False)))
        with torch.no_grad():
            weight[ids] += 0.01 * torch.randn(n_rows, weight.shape[1])
        self.checkpointer.tracked.tracker.mark(table, ids)

    def publish(self, full: bool = False) -> int:
        """Commit the rows changed since the last version (or every row); the version."""
        self.checkpointer.step(1)
        steps = self.checkpointer.step_count
        return self.checkpointer.commit_now(reader={"offset": steps}, force_full=full)

    def close(self) -> None:
        self.checkpointer.close()
