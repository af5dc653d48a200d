"""One dated benchmark record, ``<record dir>/<YYYY-MM-DD>-<SLUG>.md``, from a bench.json.

``tools/bench/bench.py --record SLUG`` writes it after a run, ``--record-from PATH/bench.json``
from an earlier run's output folder. A record holds what it takes to read and repeat the
measurement: a title, the date, the device, the software versions, the exact command line (after
the environment variables of the launch that change a run), the tables bench.py prints (as
Markdown) and the chart (the run's bench.png, copied beside the record as
``<YYYY-MM-DD>-<SLUG>.png``). Records are never edited: an existing one is refused unless
``overwrite`` is set (``--record-overwrite``).
"""

from __future__ import annotations

import os
import re
import shlex
import shutil

# File names: lower-case words of letters and digits joined by single dashes.
SLUG = re.compile(r"^[a-z0-9]+(-[a-z0-9]+)*$")
TOOL = "tools/bench/bench.py"


class RecordError(Exception):
    """The record cannot be written; the message says why in one line."""


def check_slug(text: str) -> str:
    """``text`` if it is a valid record slug (``moe-1x4096``), else :class:`ValueError`."""
    if not SLUG.match(text):
        raise ValueError(
            f"{text!r} is not a record slug (lower-case letters and digits, words joined by "
            "single dashes, e.g. moe-1x4096)"
        )
    return text


def paths(record_dir: str, date: str, slug: str) -> tuple[str, str]:
    """The record's Markdown file and its chart."""
    stem = os.path.join(record_dir, f"{date}-{check_slug(slug)}")
    return stem + ".md", stem + ".png"


def refuse_existing(record_dir: str, date: str, slug: str, overwrite: bool) -> None:
    """:class:`RecordError` when the record of ``date`` and ``slug`` exists and ``overwrite`` is
    not set."""
    markdown, chart = paths(record_dir, date, slug)
    for path in (markdown, chart):
        if os.path.exists(path) and not overwrite:
            raise RecordError(
                f"{path} exists: records are never edited (--record-overwrite replaces it)"
            )


def device_line(facts: dict) -> str:
    if facts.get("report_only"):
        return "not recorded (the tables were rebuilt with --report-only)"
    if not facts.get("device"):
        return "no GPU visible to bench.py"
    count = facts.get("device_count") or 1
    memory = facts.get("device_memory_gib")
    line = f"{count}x {facts['device']}" + (f" ({memory} GiB each)" if memory else "")
    if facts.get("host_cpu"):
        line += f"; host: {facts['host_cpu']}, {facts.get('host_cpus')} CPUs"
    return line


def software_line(facts: dict) -> str:
    names = (
        ("torch", "torch"),
        ("megatron_core", "megatron-core"),
        ("transformer_engine", "TransformerEngine"),
        ("python", "Python"),
        ("torchtitan", "torchtitan"),
    )
    found = [f"{label} {facts[key]}" for key, label in names if facts.get(key)]
    return ", ".join(found) if found else "not recorded"


def command_line(argv: list[str] | None, env: dict | None = None) -> str:
    """bench.py's command line as it ran, from the repository root, after the environment
    variables of the launch that bench.json kept; a variable that names a path (its value holds a
    ``/``) belongs to the machine that ran it and is left out."""
    if argv is None:
        return "not recorded (bench.json without argv)"
    kept = {k: v for k, v in (env or {}).items() if "/" not in v}
    prefix = "".join(f"{k}={shlex.quote(v)} " for k, v in kept.items())
    return f"{prefix}python {TOOL} {shlex.join(argv)}".rstrip()


def render(result: dict, date: str, title: str, sections: list, chart: str | None) -> str:
    """The record's Markdown: ``sections`` are (caption, Markdown table) pairs, ``chart`` the file
    name of the chart beside the record (None: no chart)."""
    lines = [
        f"# {title}",
        "",
        f"- Date: {date}",
        f"- Device: {device_line(result.get('facts') or {})}",
        f"- Software: {software_line(result.get('facts') or {})}",
        "",
        "Command, from the repository root:",
        "",
        "```bash",
        command_line(result.get("argv"), result.get("launch_env")),
        "```",
        "",
    ]
    for caption, table in sections:
        lines += [f"{caption}:", "", table, ""]
    if chart:
        lines += [f"![{title}]({chart})", ""]
    return "\n".join(lines)


def write(
    result: dict,
    *,
    date: str,
    title: str,
    sections: list,
    chart_source: str | None,
    record_dir: str,
    slug: str,
    overwrite: bool = False,
) -> str:
    """Write the record (and copy ``chart_source`` beside it when it exists); returns its path."""
    refuse_existing(record_dir, date, slug, overwrite)
    markdown, chart = paths(record_dir, date, slug)
    os.makedirs(record_dir, exist_ok=True)
    has_chart = bool(chart_source) and os.path.exists(chart_source)
    if has_chart:
        shutil.copyfile(chart_source, chart)
    text = render(result, date, title, sections, os.path.basename(chart) if has_chart else None)
    with open(markdown, "w") as handle:
        handle.write(text)
    return markdown
