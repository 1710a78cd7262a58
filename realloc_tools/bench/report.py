"""The bench report: the summary of every direction, the lower bound and its formula, the text table."""

from __future__ import annotations

import os

from realloc_tools.bench.common import BASELINES, MB
from realloc_tools.bench.staged import format_staged

LOWER_BOUND_FORMULA = (
    "max(aggregate, critical_rank) with "
    "aggregate = bytes_inter_node / gloo_gbps + (bytes_intra_node + bytes_local_copy) / memcpy_gbps, "
    "critical_rank = max over ranks r of inter_recv[r] / gloo_p2p_gbps + (intra_recv[r] + local[r]) / memcpy_1core_gbps; "
    "gloo_gbps = max(gloo_p2p_gbps, gloo_aggregate_gbps), "
    "memcpy_gbps = min(max(memcpy_cores_gbps, memcpy_aggregate_gbps), min(cores, workers) * memcpy_1core_gbps) "
    "(min(cores, workers) actors, and every actor, copying at once: measured, never more than every core "
    "copying at the one-core rate); "
    "warm buffers (no first-touch page faults), no pack/unpack, bytes from the plan"
)


def summarise(report: dict, directions: list[dict], ours_ok: bool, failures: list[str]) -> None:
    """Top-level figures: the worst direction's, and the goals over every direction."""
    worst = max(range(len(directions)), key=lambda i: directions[i]["ratio_to_lower_bound"])
    w = directions[worst]
    report["worst_direction"] = worst
    for key in (
        "ours_seconds",
        "ours",
        "lower_bound_seconds",
        "lower_bound_terms",
        "lower_bound_fresh_buffers_seconds",
        "lower_bound_formula",
        "plan",
        "baselines",
    ):
        report[key] = w[key]
    report["ratio_to_lower_bound"] = w["ratio_to_lower_bound"]
    report["ratio_to_linear_copy_bound"] = max(d["ratio_to_linear_copy_bound"] for d in directions)
    # a baseline skipped (memory) or failed in a direction has no figures there; it counts where it ran
    names = [n for n in BASELINES if any(n in d["baselines"] for d in directions)]
    ran = {n: [i for i, d in enumerate(directions) if n in d["baselines"]] for n in names}
    # speedup_vs: the smallest over every direction (what "N x faster in every direction" means)
    report["speedup_vs"] = {n: min(directions[i]["speedup_vs"][n] for i in ran[n]) for n in names}
    report["speedup_vs_direction"] = {n: min(ran[n], key=lambda i: directions[i]["speedup_vs"][n]) for n in names}
    report["peak_extra_bytes_per_actor"] = max(d["peak_extra_bytes_per_actor"] for d in directions)
    report["verified"] = {
        "ours": ours_ok and not failures,
        **{n: all(directions[i]["verified"][n] for i in ran[n]) for n in names},
    }
    report["baseline_failures"] = [
        {"direction": i, "baseline": n, "error": f["error"]}
        for i, d in enumerate(directions)
        for n, f in d.get("baselines_failed", {}).items()
    ]
    report["baseline_skips"] = [
        {"direction": i, "baseline": n, "reason": why}
        for i, d in enumerate(directions)
        for n, why in d.get("baselines_skipped", {}).items()
    ]
    report["baseline_skips"] += [
        {"direction": i, "baseline": n, "reason": m["shrunk"]}
        for i, d in enumerate(directions)
        for n, m in d.get("baseline_memory", {}).items()
        if "shrunk" in m
    ]
    report["baselines_complete"] = not report["baseline_failures"] and not report["baseline_skips"]
    peaks: dict[str, dict] = {}
    for d in directions:
        for n, m in d.get("baseline_memory", {}).items():
            p = peaks.setdefault(
                n,
                {
                    "estimate_bytes": 0,
                    "peak_extra_bytes": 0,
                    "peak_used_bytes": 0,
                    "workers_private_peak_bytes": 0,
                    "worker_rss_max_bytes": 0,
                },
            )
            p["estimate_bytes"] = max(p["estimate_bytes"], m.get("estimate_bytes", 0))
            for key in ("peak_extra_bytes", "peak_used_bytes", "workers_private_peak_bytes", "worker_rss_max_bytes"):
                p[key] = max(p[key], m.get(key, 0))
    report.setdefault("memory", {})["baselines"] = peaks  # per baseline, the largest over the directions
    report["verification_failures"] = failures
    report["goals"] = {
        "speedup_5x_vs_every_baseline": all(s >= 5 for s in report["speedup_vs"].values()),
        "within_1_5x_of_lower_bound": report["ratio_to_lower_bound"] <= 1.5,
    }


def lower_bound(plan, transport: dict, cores: int, workers: int) -> dict:
    """The lower bound of a transition on this machine from the plan's bytes and measured rates."""
    gloo = max(transport["gloo_p2p_gbps"], transport["gloo_aggregate_gbps"]) * 1e9
    # The concurrent probes, capped at every core copying at the one-core rate: a lone copier has
    # the memory bus to itself, so no set of copiers beats cores x it; a probe that does measured
    # its barriers' noise (the cap is what the bound then charges, and says so).
    measured = max(transport["memcpy_cores_gbps"], transport["memcpy_aggregate_gbps"]) * 1e9
    ceiling = min(cores, workers) * transport["memcpy_1core_gbps"] * 1e9
    memcpy = min(measured, ceiling)
    # The formula before 2026-11-22 charged copies at cores x the one-core rate, a rate no
    # measurement showed (two cores copying at once moved 1.45-1.75x one core here, not 2x); kept
    # beside the bound so runs before and after compare.
    linear = max(min(cores, workers) * transport["memcpy_1core_gbps"], transport["memcpy_aggregate_gbps"]) * 1e9
    one_core = transport["memcpy_1core_gbps"] * 1e9
    pair = transport["gloo_p2p_gbps"] * 1e9
    s = plan.stats
    copied = s["bytes_intra_node"] + s["bytes_local_copy"]
    aggregate = s["bytes_inter_node"] / gloo + copied / memcpy
    inter: dict[int, int] = {}
    copies: dict[int, int] = {}
    for _, a, b, j in plan.routes():
        n = plan.list_bytes(j)
        if plan.nodes[a] != plan.nodes[b]:
            inter[b] = inter.get(b, 0) + n
        else:
            copies[b] = copies.get(b, 0) + n
    for w, j in plan.local_copies:
        copies[w] = copies.get(w, 0) + plan.list_bytes(j)
    critical = max(
        (inter.get(r, 0) / pair + copies.get(r, 0) / one_core for r in set(inter) | set(copies)), default=0.0
    )
    return {
        "lower_bound_seconds": max(aggregate, critical),
        "lower_bound_formula": LOWER_BOUND_FORMULA,
        "lower_bound_terms": {
            "aggregate_seconds": aggregate,
            "critical_rank_seconds": critical,
            "inter_node_seconds": s["bytes_inter_node"] / gloo,
            "copy_seconds": copied / memcpy,
            "gloo_gbps": gloo / 1e9,
            "memcpy_gbps": memcpy / 1e9,
            "memcpy_capped": measured > ceiling,
            "cores": cores,
        },
        "lower_bound_linear_copy_seconds": max(s["bytes_inter_node"] / gloo + copied / linear, critical),
        # The same bound for an implementation that writes into freshly allocated /dev/shm
        # destination buffers (as ours and every baseline do): copies at the first-touch rate.
        "lower_bound_fresh_buffers_seconds": s["bytes_inter_node"] / gloo
        + copied / (min(cores, workers) * transport["memcpy_shm_cold_gbps"] * 1e9),
    }


def format_report(r: dict) -> str:
    if r.get("staged_only"):
        s = r.get("staged", {})
        return "\n".join(
            [
                f"{r['model']} ({r['model_bytes'] / 1e9:.2f} GB), staged update only, {r['workers']} actors on "
                f"{s.get('nodes', '?')} nodes, {r['machine']['cores']} cores; total {r['total_seconds']:.1f}s",
                *format_staged(s),
            ]
        )
    names = list(r["baselines"])
    lines = [
        f"{r['model']} ({r['model_bytes'] / 1e9:.2f} GB) on {r['workers']} actors, {r['nodes']} nodes, "
        f"{r['machine']['cores']} cores; medians of {r['repeats']} (ours) and {r['baseline_repeats']} "
        "(baselines) runs, seconds",
        f"{'direction':<44}{'ours':>8}{'bound':>8}{'ratio':>9}" + "".join(f"{n:>17}" for n in names),
    ]
    for d in r["directions"]:
        ok = all(d["verified"].values())
        lines.append(
            f"{d['src'] + ' -> ' + d['dst']:<44}{d['ours_seconds']:>8.3f}{d['lower_bound_seconds']:>8.3f}"
            f"{d['ratio_to_lower_bound']:>8.2f}x"
            + "".join(
                f"{d['baselines'][n]:>9.2f} ({d['speedup_vs'][n]:>4.1f}x)"
                if n in d["baselines"]
                else f"{'failed' if n in d.get('baselines_failed', {}) else 'skipped':>17}"
                for n in names
            )
            + ("" if ok else "  NOT VERIFIED")
        )
    t = r["transport"]
    lines.append(
        f"transport: gloo p2p {t['gloo_p2p_gbps']:.2f} GB/s, aggregate {t['gloo_aggregate_gbps']:.2f} GB/s; "
        f"memcpy 1 core {t['memcpy_1core_gbps']:.2f} GB/s, {t['memcpy_copiers']} at once "
        f"{t['memcpy_cores_gbps']:.2f} GB/s, all actors {t['memcpy_aggregate_gbps']:.2f} GB/s, "
        f"first touch {t['memcpy_shm_cold_gbps']:.2f} GB/s"
    )
    g = r["goals"]
    w = r["directions"][r["worst_direction"]]
    lines.append(
        f"worst direction {w['src']} -> {w['dst']}: {r['ratio_to_lower_bound']:.2f}x its lower bound; "
        f"goals: 5x faster than every baseline in every direction "
        f"{'met' if g['speedup_5x_vs_every_baseline'] else 'NOT met'}"
        + (f" (least: {min(r['speedup_vs'].values()):.1f}x)" if r["speedup_vs"] else "")
        + f"; within 1.5x of the lower bound {'met' if g['within_1_5x_of_lower_bound'] else 'NOT met'}"
    )
    verified = ", ".join(f"{k} {'yes' if v else 'NO'}" for k, v in r["verified"].items())
    lines.append(
        f"verified: {verified}; "
        f"peak extra bytes per actor {r['peak_extra_bytes_per_actor'] / 1e6:.1f} MB; "
        f"bucket {r['bucket_bytes'] / MB:g} MiB; total {r['total_seconds']:.1f}s"
    )
    if r.get("resident"):
        res = r["resident"]
        lines.append(
            f"resident layouts (keep=, RL loop on the first transition): round trip "
            f"{res['without_keep_round_trip_median_seconds']:.3f}s without keep; "
            + "; ".join(
                f"{m} {res[m]['round_trip_median_seconds']:.3f}s (there {res[m]['there_median_seconds']:.3f}"
                f", back {res[m]['back_median_seconds']:.3f}), kept "
                f"{res[m]['kept_bytes_per_actor'] / 1e6:.1f} MB/actor"
                for m in ("in_place", "host")
            )
        )
    mem = r.get("memory", {})
    if mem.get("baselines"):
        lines.append(
            "baseline memory added to the node at its peak (largest over the directions; the largest "
            "estimate in parentheses): "
            + ", ".join(
                f"{n} +{m['peak_extra_bytes'] / 1e9:.2f} GB (+{m['estimate_bytes'] / 1e9:.2f})"
                for n, m in mem["baselines"].items()
            )
            + (
                f"; node peak {mem['peak_used_bytes'] / 1e9:.1f} of {mem['total_bytes'] / 1e9:.1f} GB"
                if "peak_used_bytes" in mem
                else ""
            )
        )
    for f in r.get("baseline_failures", []):
        d = r["directions"][f["direction"]]
        lines.append(f"baseline {f['baseline']} FAILED on {d['src']} -> {d['dst']}: {f['error'][:300]}")
    for k in r.get("baseline_skips", []):
        d = r["directions"][k["direction"]]
        lines.append(f"baseline {k['baseline']} on {d['src']} -> {d['dst']} {k['reason']}")
    if r.get("error"):
        lines.append(f"STOPPED EARLY after {len(r['directions'])} directions: {r['error'][:300]}")
    if "staged" in r:
        lines += format_staged(r["staged"])
    return "\n".join(lines)


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


def loadavg() -> list[float]:
    """Other processes on the machine skew every number here; the report says how busy it was."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return []


def ram_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return 0
