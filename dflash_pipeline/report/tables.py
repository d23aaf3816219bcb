"""The HTML tables of the report (``snakemake --report report.html``): the ingest's numbers and
quarantined rows, the tokenization per shard, and the engine settings tune measured. The figures
are ``dflash_pipeline.report.figures``."""

from __future__ import annotations

import html
from pathlib import Path

from dflash_pipeline.report.figures import shard_label


def write_quarantine_table(summary: dict, quarantine: list[dict], out: str | Path, limit: int = 500) -> None:
    """An HTML page: the ingest numbers and the quarantined rows with file, row and reason."""
    facts = [
        ("rows read", summary.get("rows_read")),
        ("samples kept", summary.get("samples")),
        ("held out", summary.get("heldout_samples")),
        ("duplicates dropped", summary.get("duplicates_dropped")),
        ("quarantined", summary.get("bad_rows")),
        ("quarantined fraction", summary.get("bad_fraction")),
    ]
    rows = "".join(
        f"<tr><td>{html.escape(str(r.get('file', '')))}</td><td>{html.escape(str(r.get('row', '')))}</td>"
        f"<td>{html.escape(str(r.get('reason', '')))}</td><td>{html.escape(str(r.get('detail', '')))}</td></tr>"
        for r in quarantine[:limit]
    )
    more = (
        f"<p>… and {len(quarantine) - limit} more rows (see ingest-quarantine.jsonl).</p>"
        if len(quarantine) > limit
        else ""
    )
    _write_html(
        out,
        "Prompt set",
        _facts_table(facts)
        + "<h2>Quarantined rows</h2>"
        + (
            f"<table><tr><th>file</th><th>row</th><th>reason</th><th>detail</th></tr>{rows}</table>{more}"
            if quarantine
            else "<p>No row was quarantined.</p>"
        ),
    )


def write_tokenization_table(stats: list[dict], out: str | Path) -> None:
    head = (
        "shard",
        "samples",
        "sequences",
        "degenerate",
        "fraction",
        "truncated",
        "supervised tokens",
        "tokens",
        "reasons",
    )
    rows = "".join(
        "<tr>"
        + "".join(
            f"<td>{html.escape(str(v))}</td>"
            for v in (
                shard_label(s.get("shard", "")),
                s.get("samples"),
                s.get("sequences_out"),
                s.get("degenerate_samples"),
                f"{s.get('degenerate_fraction', 0):.2%}",
                s.get("truncated_sequences"),
                s.get("supervised_tokens_total"),
                s.get("tokens_total"),
                ", ".join(f"{k} {v}" for k, v in s.get("reasons", {}).items()) or "–",
            )
        )
        + "</tr>"
        for s in stats
    )
    header = "".join(f"<th>{h}</th>" for h in head)
    _write_html(out, "Tokenization per shard", f"<table><tr>{header}</tr>{rows}</table>")


def write_tune_table(result: dict, out: str | Path) -> None:
    """The engine settings tune measured (outputs/tune-result.json): one row per setting, the
    chosen one marked, and what the choice was made on."""
    choice = result["choice"]
    facts = [
        ("engine", result["engine_version"]),
        ("device", result["device"]),
        ("measured", result["created_utc"]),
        ("prompts per setting", f"{result['prompts']} (up to {result['max_new_tokens']} new tokens each)"),
        ("MTP", result["mtp"]),
        ("bounds", ", ".join(f"{k} {v}" for k, v in result["bounds"].items() if v is not None) or "none"),
        ("choice", f"concurrency {choice['concurrency']}{' with MTP' if choice['mtp'] else ''}: {choice['why']}"),
    ]
    header = "".join(
        f"<th>{h}</th>"
        for h in (
            "", "MTP", "concurrency", "output tok/s", "per GPU", "TTFT p50 / p90 (s)", "TPOT p50 / p90 (ms)",
            "requests", "cut at budget", "finish reasons", "engine memory (MB)", "out of bounds",
        )
    )  # fmt: skip

    def pair(figures: dict | None) -> str:
        return f"{figures['p50']} / {figures['p90']}" if figures else "–"

    rows = []
    for s in result["settings"]:
        chosen = s["concurrency"] == choice["concurrency"] and s["mtp"] == choice["mtp"]
        memory = s.get("engine_memory_mb") or {}
        cells = (
            "chosen" if chosen else "", "yes" if s["mtp"] else "no", s["concurrency"], s["output_tokens_per_s"],
            s["tokens_per_s_per_gpu"], pair(s.get("ttft_s")), pair(s.get("tpot_ms")), s["requests"],
            s["cut_at_budget"], ", ".join(f"{k} {v}" for k, v in s["finish_reasons"].items()),
            ", ".join(f"{k} {v}" for k, v in memory.items() if v is not None) or "–",
            "; ".join(s.get("out_of_bounds") or []) or "–",
        )  # fmt: skip
        rows.append("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in cells) + "</tr>")
    _write_html(
        out,
        "Engine settings measured by tune",
        _facts_table(facts) + f"<table><tr>{header}</tr>{''.join(rows)}</table>",
    )


_STYLE = (
    "body{font:13px system-ui,sans-serif;margin:12px}table{border-collapse:collapse}"
    "td,th{border:1px solid #ccd;padding:3px 8px;text-align:left}th{background:#eef1f5}"
)


def _facts_table(facts) -> str:
    return (
        "<table>"
        + "".join(f"<tr><th>{html.escape(k)}</th><td>{html.escape(str(v))}</td></tr>" for k, v in facts)
        + "</table>"
    )


def _write_html(out: str | Path, title: str, body: str) -> None:
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(
        f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
        f"<style>{_STYLE}</style></head><body><h1>{html.escape(title)}</h1>{body}</body></html>\n"
    )
