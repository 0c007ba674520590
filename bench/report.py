"""Markdown tables and PNG plots from the part documents under docs/benchmarks/.

`checknrun bench report [--dir DIR]` regenerates docs/benchmarks/RESULTS.md and the PNGs from
whatever part JSONs the directory holds (paper.json, accuracy.json, stall.json, codec.json,
freshness.json), so figures are always derived from committed results.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # headless: CI and servers have no display
import matplotlib.pyplot as plt

from bench.workloads import DEFAULT_CODEC, DEFAULT_POLICY
from publisher.codecs import CODECS

PARTS = ("paper", "accuracy", "stall", "codec", "freshness")
COMMANDS = {
    "paper": "checknrun bench paper --json docs/benchmarks/paper.json",
    "accuracy": "checknrun bench accuracy --json docs/benchmarks/accuracy.json",
    "stall": "checknrun bench stall --json docs/benchmarks/stall.json",
    "codec": "checknrun bench codec --json docs/benchmarks/codec.json",
    "freshness": "source ~/.cache/checknrun/services/env && "
    "checknrun bench freshness --json docs/benchmarks/freshness.json",
    "report": "checknrun bench report --dir docs/benchmarks",
}
#: the paper's headline reductions (Check-N-Run, NSDI'22) and this project's targets.
PAPER_BANDWIDTH = "6-17x"
PAPER_CAPACITY = "2.5-8x"
TARGET_BANDWIDTH = 17.0
TARGET_CAPACITY = 8.0


def load(directory: Path) -> dict[str, dict[str, Any]]:
    """The part documents present in `directory`."""
    docs = {}
    for part in PARTS:
        path = directory / f"{part}.json"
        if path.exists():
            docs[part] = json.loads(path.read_text(encoding="utf-8"))
    return docs


def _fmt(x: float | None, digits: int = 2) -> str:
    return "-" if x is None else f"{x:,.{digits}f}"


def _result(wl: dict[str, Any], policy: str, codec: str) -> dict[str, Any] | None:
    return next((r for r in wl["results"] if r["policy"] == policy and r["codec"] == codec), None)


def _served_loss_cell(wl: dict[str, Any], policy: str, codec: str) -> str:
    """The served loss the manifests of a published setting recorded (bench/paper.py)."""
    arm = next(
        (a for a in wl.get("published", []) if (a["policy"], a["codec"]) == (policy, codec)), None
    )
    if arm is None or not arm["served_loss"].get("versions_measured"):
        return ""
    loss = arm["served_loss"]
    again = arm.get("versions_encoded_again")
    notes = [f"{loss['surely_over_budget']} surely"] if "surely_over_budget" in loss else []
    notes += [f"{again} encoded again"] if again else []
    return (
        f"{loss['auc_rel_loss_pct_median']:+.4f}% / {loss['auc_rel_loss_pct_worst']:+.4f}%, "
        f"{loss['over_budget']} of {loss['versions_measured']}"
        + (f" ({'; '.join(notes)})" if notes else "")
    )


def _auto_row(name: str, wl: dict[str, Any]) -> list[str]:
    """The headline row of `--codec auto`, from the versions it committed (no replay)."""
    arm = next((a for a in wl.get("published", []) if a["codec"] == "auto"), None)
    if arm is None or "bandwidth_reduction_mean" not in arm:
        return []
    return [
        f"| {name} | {arm['policy']} auto (committed) | "
        f"{_fmt(arm['bandwidth_reduction_mean'])}x / - / - | "
        f"{_fmt(arm['capacity_reduction_latest'])}x / "
        f"{_fmt(arm['capacity_reduction_mean'])}x / - | "
        f"{_served_loss_cell(wl, arm['policy'], 'auto')} | "
        f"{PAPER_BANDWIDTH} / {PAPER_CAPACITY} |"
    ]


def headline(docs: dict[str, dict[str, Any]]) -> list[str]:
    """The README's table: default setting vs full fp32, next to the paper's ranges."""
    paper = docs.get("paper")
    if not paper:
        return []
    lines = [
        f"| workload | policy + codec | write bandwidth (mean / steady / max) | "
        f"storage (latest / mean over versions / {paper['retain_versions']}-version window) | "
        "served AUC loss per version (median / worst, over budget) | "
        "paper |",
        "|---|---|---|---|---|---|",
    ]
    for name, wl in paper["workloads"].items():
        for policy, codec in (
            (DEFAULT_POLICY, DEFAULT_CODEC),
            ("consecutive", "int4"),
            ("one-shot", "int4"),
            ("consecutive", "int2"),
        ):
            r = _result(wl, policy, codec)
            if r is None:
                continue
            auc = _served_loss_cell(wl, policy, codec)
            lines.append(
                f"| {name} | {policy} {codec} | {_fmt(r['bandwidth_reduction_mean'])}x / "
                f"{_fmt(r['bandwidth_reduction_steady_mean'])}x / "
                f"{_fmt(r['bandwidth_reduction_max'])}x | "
                f"{_fmt(r['capacity_reduction_latest'])}x / "
                f"{_fmt(r.get('capacity_reduction_mean'))}x / "
                f"{_fmt(r['capacity_reduction_window'])}x | {auc} | "
                f"{PAPER_BANDWIDTH} / {PAPER_CAPACITY} |"
            )
            if (policy, codec) == (DEFAULT_POLICY, DEFAULT_CODEC):
                lines.extend(_auto_row(name, wl))
    return lines


def targets(docs: dict[str, dict[str, Any]]) -> list[str]:
    """Each target of the issue with the measured value and met / not met."""
    rows: list[tuple[str, str, str, bool]] = []
    paper = docs.get("paper", {})
    for name, wl in paper.get("workloads", {}).items():
        r = _result(wl, DEFAULT_POLICY, DEFAULT_CODEC)
        if r is None:
            continue
        bw, cap = r["bandwidth_reduction_mean"], r["capacity_reduction_latest"]
        rows.append((f"write bandwidth >= 17x ({name})", ">= 17x", f"{bw:.1f}x", bw >= 17))
        rows.append((f"storage capacity >= 8x ({name})", ">= 8x", f"{cap:.2f}x", cap >= 8))
        served = wl["served_default_codec"].get("auc_rel_degradation_pct")
        if served is not None:
            rows.append(
                (f"served AUC degradation ({name})", "<= 0.01%", f"{served:.4f}%", served <= 0.01)
            )
        # The trainer's default is --codec auto: its arm when the run published one.
        auto = next((a for a in wl.get("published", []) if a["codec"] == "auto"), None)
        arm = auto if auto is not None else wl.get("published_default", {})
        loss = arm.get("served_loss", {})
        if loss.get("versions_measured"):
            worst = loss["auc_rel_loss_pct_worst"]
            surely = (
                f"; {loss['surely_over_budget']} surely, worst low end "
                f"{loss['sure_auc_rel_loss_pct_worst']:.4f}%"
                if "surely_over_budget" in loss
                else ""
            )
            rows.append(
                (
                    f"served AUC loss, worst version's manifest ({name}, "
                    f"{arm.get('codec', DEFAULT_CODEC)})",
                    "<= 0.01%",
                    f"{worst:.4f}% ({loss['over_budget']} of {loss['versions_measured']} over"
                    f"{surely})",
                    worst <= 0.01,
                )
            )
        ratio = wl["restore"]["restore_over_torch_load"]
        rows.append(
            (f"restore vs torch.load ({name}, paper run)", "<= 1.5x", f"{ratio:.2f}x", ratio <= 1.5)
        )
    for name, w in docs.get("stall", {}).get("workloads", {}).items():
        st = w["stall_over_torch_save"]
        if st is not None:
            rows.append((f"stall / torch.save ({name})", "<= 5%", f"{st * 100:.2f}%", st <= 0.05))
        s = w["summary"]
        over = s["overhead_pct"]
        rows.append(
            (
                f"training overhead ({name}; CPU-time {s['overhead_cpu_pct']:.1f}%)",
                "<= 1%",
                f"{over:.1f}%",
                over <= 1,
            )
        )
        ratio = w["restore"]["restore_over_torch_load"]
        rows.append(
            (f"restore vs torch.load ({name}, stall run)", "<= 1.5x", f"{ratio:.2f}x", ratio <= 1.5)
        )
    codec = docs.get("codec")
    if codec and "int4_target" in codec:  # absent when int4 was not among the codecs measured
        t = codec["int4_target"]
        rows.append(
            (
                "int4 encode per core",
                ">= 1000 MB/s",
                f"{t['encode_mb_s']:,.0f} MB/s",
                t["encode_met"],
            )
        )
        rows.append(
            (
                "int4 decode per core",
                ">= 2000 MB/s",
                f"{t['decode_mb_s']:,.0f} MB/s",
                t["decode_met"],
            )
        )
    fresh = docs.get("freshness")
    if fresh:
        p99 = fresh["freshness"]["train_step_to_served"].get("p99_ms")
        where = "Kafka + MinIO" if fresh["real_services"] else "file store + file bus"
        rows.append(
            (
                f"freshness p99 ({where})",
                "<= 2 s",
                f"{(p99 or 0) / 1e3:.2f} s",
                bool(fresh["p99_met"]),
            )
        )
    if not rows:
        return []
    out = ["| target | goal | measured | met |", "|---|---|---|---|"]
    out += [f"| {a} | {b} | {c} | {'yes' if ok else 'no'} |" for a, b, c, ok in rows]
    return [*out, ""]


def paper_table(doc: dict[str, Any]) -> list[str]:
    out = []
    for name, wl in doc["workloads"].items():
        w = wl["workload"]
        df = wl["dirty_fraction"]
        out += [
            f"### {name}: {w['description']}",
            "",
            f"{w['table_rows_total']:,} rows x dim {w['embedding_dim']} "
            f"({w['fp32_embedding_bytes'] / 1e9:.3f} GB fp32), {len(df)} checkpoints every "
            f"{w['interval_samples']:,} samples; full fp32 checkpoint "
            f"{wl['full_fp32_bytes']:,} B; dirty rows per interval: median "
            f"{sorted(df)[len(df) // 2]:.2%}, max {max(df):.2%}. Restore of the default "
            f"setting's latest version ({wl['restore']['chain_versions']} versions): "
            f"{wl['restore']['restore_s_median']:.3f} s vs torch.load "
            f"{wl['restore']['torch_load_s_median']:.3f} s "
            f"({wl['restore']['restore_over_torch_load']:.2f}x).",
            "",
            "| policy | codec | MB/interval mean | max | bandwidth x (mean / steady / max) | "
            "storage x (latest / mean over versions / window) |",
            "|---|---|---|---|---|---|",
        ]
        for r in wl["results"]:
            out.append(
                f"| {r['policy']} | {r['codec']} | {r['bytes_mean'] / 1e6:,.2f} | "
                f"{r['bytes_max'] / 1e6:,.2f} | {_fmt(r['bandwidth_reduction_mean'])} / "
                f"{_fmt(r['bandwidth_reduction_steady_mean'])} / "
                f"{_fmt(r['bandwidth_reduction_max'])} | "
                f"{_fmt(r['capacity_reduction_latest'])} / "
                f"{_fmt(r.get('capacity_reduction_mean'))} / "
                f"{_fmt(r['capacity_reduction_window'])} |"
            )
        out.append("")
    return out


def accuracy_table(doc: dict[str, Any]) -> list[str]:
    out = []
    for name, wl in doc["workloads"].items():
        ref = wl["reference_fp32"]
        out += [
            f"### {name} ({wl['workload']['samples']:,} samples, checkpoint every "
            f"{wl['workload']['interval_samples']:,})",
            "",
            f"Uninterrupted fp32 run: AUC {ref['auc']:.5f}, log loss {ref['logloss']:.5f}. "
            f"fp32 restores reproduce it exactly: "
            f"{wl['fp32_restores_check']['equals_reference']}.",
            "",
            "Served model (relative AUC degradation, log loss increase):",
            "",
            "| codec | AUC degr. | log loss incr. |",
            "|---|---|---|",
        ]
        for r in wl["served"]["codecs"]:
            out.append(
                f"| {r['codec']} | {r['auc_rel_degradation'] * 100:+.4f}% | "
                f"{r['logloss_rel_increase'] * 100:+.4f}% |"
            )
        ks = sorted({r["failures"] for r in wl["restores"]})
        out += [
            "",
            "Restores from quantized checkpoints (relative AUC degradation per k failures):",
            "",
            "| codec | " + " | ".join(f"k={k}" for k in ks) + " |",
            "|---|" + "---|" * len(ks),
        ]
        codecs = list(dict.fromkeys(r["codec"] for r in wl["restores"]))
        for c in codecs:
            cells = []
            for k in ks:
                r = next(x for x in wl["restores"] if x["codec"] == c and x["failures"] == k)
                cells.append(f"{r['auc_rel_degradation'] * 100:+.4f}%")
            out.append(f"| {c} | " + " | ".join(cells) + " |")
        out.append("")
    rule = doc.get("bit_rule", {})
    out += [f"Bit rule ({rule.get('criterion', '')}):", ""]
    for t in rule.get("thresholds", []):
        out.append(f"- expected restores <= {t['max_expected_restores']}: {t['codec']}")
    out.append(f"- beyond: {rule.get('beyond')}")
    out.append("")
    return out


def stall_table(doc: dict[str, Any]) -> list[str]:
    out = [
        "| workload | checkpoints | stall ms median (max) | torch.save ms | DCP async_save "
        "stall ms | stall / torch.save | overhead (wall / CPU) | overhead, process publisher "
        "(wall / CPU) | DCP overhead | restore / torch.load |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, w in doc["workloads"].items():
        s = w["summary"]
        pp = w.get("process_publisher", {})
        out.append(
            f"| {name} | {s['checkpoints']} | {_fmt(s['stall_ms_median'])} "
            f"({_fmt(s['stall_ms_max'])}) | {_fmt(s['torch_save_ms_median'])} | "
            f"{_fmt(w['dcp']['stall_ms_median'])} | "
            f"{_fmt((w['stall_over_torch_save'] or 0) * 100)}% | "
            f"{_fmt(s['overhead_pct'])}% / {_fmt(s['overhead_cpu_pct'])}% | "
            f"{_fmt(pp.get('overhead_pct'))}% / {_fmt(pp.get('overhead_cpu_pct'))}% | "
            f"{_fmt(w['dcp']['overhead_pct'])}% | "
            f"{_fmt(w['restore']['restore_over_torch_load'])}x |"
        )
    return [*out, ""]


def codec_table(doc: dict[str, Any]) -> list[str]:
    out = [
        "| codec | encode MB/s | decode MB/s | rel MSE | bytes/row | x fp32 |",
        "|---|---|---|---|---|---|",
    ]
    for r in doc["results"]:
        out.append(
            f"| {r['codec']} | {r['encode_mb_s']:,.0f} | {r['decode_mb_s']:,.0f} | "
            f"{r['rel_mse']:.2e} | {r['bytes_per_row']:.1f} | {r['ratio_vs_fp32']:.2f} |"
        )
    return [*out, ""]


def freshness_table(doc: dict[str, Any]) -> list[str]:
    f = doc["freshness"]
    out = [
        f"Store {f['store']}, bus {f['bus']} (real services: {doc['real_services']}), "
        f"{f['servers']} servers, {f['versions']} versions every {f['interval_s']} s, "
        f"median delta {f['delta_bytes_median']:,} B.",
        "",
        "| stage | p50 ms | p99 ms | max ms |",
        "|---|---|---|---|",
    ]
    for key in ("train_step_to_served", "train_step_to_committed", "committed_to_served"):
        p = f[key]
        out.append(
            f"| {key} | {_fmt(p.get('p50_ms'))} | {_fmt(p.get('p99_ms'))} | "
            f"{_fmt(p.get('max_ms'))} |"
        )
    out += [
        "",
        "Apply time vs delta size:",
        "",
        "| delta rows | blob bytes | apply ms |",
        "|---|---|---|",
    ]
    for r in doc["apply"].get("results", []):
        rows = r.get("delta_rows", r.get("rows"))
        out.append(f"| {rows:,} | {r.get('blob_bytes', 0):,} | {_fmt(r.get('apply_ms_median'))} |")
    h = doc["http"]
    out += [
        "",
        f"Predict over HTTP: p99 idle {_fmt(h['idle'].get('p99_ms'))} ms, while applying "
        f"{_fmt(h['applying'].get('p99_ms'))} ms.",
        "",
    ]
    return out


def plot_bytes(doc: dict[str, Any], out: Path) -> Path:
    """Bytes per interval over time per policy (default codec), one panel per workload."""
    names = list(doc["workloads"])
    fig, axes = plt.subplots(1, len(names), figsize=(5 * len(names), 3.2), squeeze=False)
    for ax, name in zip(axes[0], names, strict=True):
        wl = doc["workloads"][name]
        ref = wl["full_fp32_bytes"] / 1e6
        for policy in ("full", "one-shot", "consecutive", "intermittent"):
            r = _result(wl, policy, DEFAULT_CODEC)
            if r:
                x = range(1, len(r["bytes_per_interval"]) + 1)
                ax.plot(x, [b / 1e6 for b in r["bytes_per_interval"]], marker=".", label=policy)
        ax.axhline(ref, color="k", ls="--", lw=0.8, label="full fp32")
        ax.set_yscale("log")
        ax.set_title(f"{name}: MB per checkpoint ({DEFAULT_CODEC})", fontsize=9)
        ax.set_xlabel("interval")
        ax.legend(fontsize=7)
    fig.tight_layout()
    path = out / "bytes_per_interval.png"
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path


def plot_accuracy(doc: dict[str, Any], out: Path) -> Path:
    """Relative AUC degradation vs bits, one line per failure count, per workload."""
    names = list(doc["workloads"])
    fig, axes = plt.subplots(1, len(names), figsize=(5 * len(names), 3.2), squeeze=False)
    for ax, name in zip(axes[0], names, strict=True):
        wl = doc["workloads"][name]
        bits = {c.name: c.bits for c in CODECS.values() if not c.lossless and not c.adaptive}
        served = {r["codec"]: r for r in wl["served"]["codecs"] if r["codec"] in bits}
        xs = sorted(served, key=lambda c: bits[c])
        ax.plot(
            [bits[c] for c in xs],
            [served[c]["auc_rel_degradation"] * 100 for c in xs],
            marker="o",
            label="served (k=0)",
        )
        for k in sorted({r["failures"] for r in wl["restores"]}):
            rs = [r for r in wl["restores"] if r["failures"] == k and r["codec"] in bits]
            rs.sort(key=lambda r: bits[r["codec"]])
            ax.plot(
                [bits[r["codec"]] for r in rs],
                [r["auc_rel_degradation"] * 100 for r in rs],
                marker=".",
                label=f"k={k} restores",
            )
        ax.axhline(0.01, color="r", ls="--", lw=0.8, label="0.01% bound")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("bits (uniform codecs)")
        ax.set_ylabel("AUC degradation, %")
        ax.set_title(name, fontsize=9)
        ax.legend(fontsize=6)
    fig.tight_layout()
    path = out / "auc_vs_bits.png"
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path


def plot_stall(doc: dict[str, Any], out: Path) -> Path:
    """Median per-checkpoint stall: incremental vs torch.save vs DCP async_save."""
    names = list(doc["workloads"])
    fig, ax = plt.subplots(figsize=(5, 3.2))
    width = 0.25
    arms = (
        ("checknrun", ("summary", "stall_ms_median")),
        ("torch.save", ("summary", "torch_save_ms_median")),
        ("DCP async_save", ("dcp", "stall_ms_median")),
    )
    for i, (label, (section, key)) in enumerate(arms):
        vals = [doc["workloads"][n][section][key] or 0 for n in names]
        ax.bar([j + i * width for j in range(len(names))], vals, width, label=label)
    ax.set_xticks([j + width for j in range(len(names))], names)
    ax.set_yscale("log")
    ax.set_ylabel("stall per checkpoint, ms (median)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    path = out / "stall.png"
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path


def write(directory: Path) -> Path:
    """RESULTS.md and the PNGs from the part JSONs in `directory`; returns RESULTS.md."""
    docs = load(directory)
    lines = [
        "# checknrun benchmark results",
        "",
        "Generated by `" + COMMANDS["report"] + "` from the JSON files next to this one; "
        "each section names the command that produced its JSON. Machine: see `machine` in "
        "each JSON (shared 2-core VM: ratios measured side by side in one run are what count).",
        "",
    ]
    head = headline(docs)
    if head:
        lines += [
            "## Headline (reduction factors against full fp32 checkpoints every interval)",
            "",
            *head,
            "",
        ]
    goals = targets(docs)
    if goals:
        lines += ["## Targets", "", *goals]
    sections = (
        ("paper", "Write bandwidth and storage capacity", paper_table, plot_bytes),
        ("accuracy", "Accuracy of served and restored models", accuracy_table, plot_accuracy),
        ("stall", "Checkpoint stall and overhead", stall_table, plot_stall),
        ("codec", "Codec throughput (one core) and error", codec_table, None),
        ("freshness", "Freshness and serving", freshness_table, None),
    )
    for part, title, table, plot in sections:
        if part not in docs:
            continue
        doc = docs[part]
        m = doc.get("machine", {})
        lines += [
            f"## {title}",
            "",
            f"`{COMMANDS[part]}`" + (" (quick mode)" if doc.get("quick") else ""),
            "",
            f"Measured {m.get('measured_at')} on {m.get('nproc')} x {m.get('cpu_model')}, "
            f"load average {m.get('load_average')}, torch {m.get('torch')}.",
            "",
        ]
        if doc.get("note"):
            lines += [str(doc["note"]), ""]
        if plot is not None:
            png = plot(doc, directory)
            lines += [f"![{title}]({png.name})", ""]
        lines += table(doc)
    if "accuracy" in docs:
        # The rule as data, for the policy side (bench.bit_rule.MEASURED_RULE mirrors it).
        rule = {
            **docs["accuracy"]["bit_rule"],
            "source": "accuracy.json",
            "command": COMMANDS["accuracy"],
            "measured_at": docs["accuracy"].get("machine", {}).get("measured_at"),
        }
        (directory / "bit_rule.json").write_text(
            json.dumps(rule, indent=1) + "\n", encoding="utf-8"
        )
    path = directory / "RESULTS.md"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path
