"""The bit-width rule: which codec to checkpoint with, given the restores a run expects.

Each restore from a quantized checkpoint puts that codec's error into every table, and the
errors add up; a run that expects few restores can afford fewer bits (Check-N-Run, section 5).
`derive_rule` turns the `accuracy` part's measurements into thresholds; the ones measured on
this project's workloads (docs/benchmarks/bit_rule.json) live in publisher/write/policies.py
(`MEASURED_BIT_RULE`, `codec_for_expected_restores`), where checkpointing uses them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from publisher.codecs import codec_of
from publisher.write.policies import (  # noqa: F401 - re-exported for the bench
    FALLBACK_CODEC,
    MEASURED_BIT_RULE,
    codec_for_expected_restores,
)

#: the paper's criterion: relative AUC degradation at most 0.01%.
AUC_TOLERANCE = 1e-4

# The rule itself lives on the policy side, which uses it; this module measures it.
MEASURED_RULE = MEASURED_BIT_RULE


def _order(codec: str) -> tuple[int, int]:
    # Fewer bits first; at equal bits the uniform codec (cheaper to encode) first.
    c = codec_of(codec)
    return (c.bits, c.adaptive)


def derive_rule(accuracy_doc: Mapping[str, Any]) -> dict[str, Any]:
    """Thresholds from an `accuracy` document: per k, the fewest bits within tolerance everywhere.

    A codec passes k restores when its relative AUC degradation is <= AUC_TOLERANCE on every
    workload for k and for every smaller measured k (so bits never fall as k grows), and as the
    served model (k = 0: checkpoints are also what servers load). A codec not measured on
    every workload at some k does not pass it: a rule must not rest on one workload.
    """
    workloads = accuracy_doc["workloads"]
    ks = sorted({r["failures"] for w in workloads.values() for r in w["restores"]})
    codecs = sorted({r["codec"] for w in workloads.values() for r in w["restores"]}, key=_order)
    worst: dict[tuple[str, int], float] = {}
    seen: dict[tuple[str, int], int] = {}
    for w in workloads.values():
        rows = [(r["codec"], r["failures"], r) for r in w["restores"]]
        rows += [(r["codec"], 0, r) for r in w["served"]["codecs"]]
        for codec, k, r in rows:
            key = (codec, k)
            worst[key] = max(worst.get(key, float("-inf")), r["auc_rel_degradation"])
            seen[key] = seen.get(key, 0) + 1
    everywhere = {key for key, n in seen.items() if n == len(workloads)}
    ks = [0, *ks]
    thresholds = []
    for k in ks:
        ok = [
            c
            for c in codecs
            if all((c, j) in everywhere and worst[(c, j)] <= AUC_TOLERANCE for j in ks if j <= k)
        ]
        if not ok:
            break
        best = ok[0]
        thresholds.append(
            {
                "max_expected_restores": k,
                "codec": best,
                "bits": codec_of(best).bits,
                "worst_auc_rel_degradation": worst[(best, k)],
            }
        )
    return {
        "criterion": f"relative AUC degradation <= {AUC_TOLERANCE:.0e} on every workload",
        "workloads": sorted(workloads),
        "thresholds": thresholds,
        "beyond": FALLBACK_CODEC,
        "worst_auc_rel_degradation": [
            {"codec": c, "failures": k, "value": v} for (c, k), v in sorted(worst.items())
        ],
    }
