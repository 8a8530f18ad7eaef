"""The Markdown summary of a ``chaos.py`` report (its figures, the kills, and under ``--cpu-burn`` the load
and the client's ban decisions)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["markdown"]


def markdown(report: Mapping[str, Any]) -> str:
    m = report["meta"]
    verdict = "PASSED" if report["passed"] else "FAILED"
    lines = [
        f"# Chaos: {m['model']}, {m['streams']} streams, {m['duration_s']:.0f} s, "
        f"SIGKILL every {m['kill_every_s']:.0f} s",
        "",
        f"**{verdict}** — {report['requests']} requests, **{report['failed']} failed**, "
        f"**{report['mismatched']} texts differing** from the fault-free greedy reference; {report['kills']} kills "
        f"of a replica of span {m['replicated_span']} ({m['replicas']} replicas; spans {m['spans']}); "
        f"{report['completion_tokens']} tokens, {report['tokens_per_s']} tok/s, ITL p50/p99 "
        f"{report['itl_p50_ms']}/{report['itl_p99_ms']} ms. {m['cpu_count']} CPU(s); load average "
        f"{m['loadavg_start']} at start, {m['loadavg_end']} at end.",
        "",
        "| | median (s) | max (s) |",
        "|---|---:|---:|",
    ]
    for key, name in (("stall", "stall of the streams in flight at the kill"),
                      ("restart_ready", "kill → replacement worker ready"),
                      ("restart_routable", "kill → replacement in the gateway's view")):  # fmt: skip
        lines.append(f"| {name} | {report[key]['median_s']} | {report[key]['max_s']} |")
    lines += ["", "| kill | at (s) | victim | its sessions | in flight | stall (s) | ready (s) | routable (s) "
              "| held back (s) |", "|---:|---:|---|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    for k in report["per_kill"]:
        lines.append(
            f"| {k['index']} | {k['at_s']:.1f} | {k['victim']} | {k['victim_sessions']} | {k['in_flight']} "
            f"| {k['stall_s']} | {k['restart_ready_s']} | {k['restart_routable_s']} | {k['waited_for_restart_s']} |"
        )
    lines += ["", "Stall: the longest gap between two content events (send, or a content chunk) of a request "
              "straddling the kill, over all requests in flight then (it includes the normal step time and "
              "the CPU the restarting worker takes)."]  # fmt: skip
    lines += [f"- error: {e}" for e in report["error_samples"]]
    if "bans" in report:  # issue 35: the load beside the swarm and what the gateway's client decided
        cpu, bans, after = report["cpu"], report["bans"], report["after"]
        lines += [
            "",
            f"Load beside the swarm: {cpu['tool']}; load average median {cpu['loadavg_median']}, max "
            f"{cpu['loadavg_max']}.",
            f"Ban decisions of the gateway's client: {bans['ban_decisions']} ({bans['killed_servers_bans']} of "
            f"killed servers, {bans['healthy_servers_bans']} of live ones, longest {bans['healthy_longest_ban_s']} s, "
            f"{bans['healthy_escalations']} escalated); kept while slow: {bans['kept_while_slow']}; watchdog "
            f"resets: {bans['watchdog_resets']}.",
            f"Afterwards: {after['ok']}/{after['requests']} requests answered, texts equal: {after['texts_equal']}, "
            f"slowest {after['slowest_s']} s.",
        ]
        lines += [f"- live server banned: {b}" for b in bans["healthy_ban_samples"]]
    return "\n".join(lines) + "\n"
