"""HTML building blocks of `ndtrain report`: one self-contained page (inline CSS, plots as base64
PNG data URIs, no scripts, nothing fetched), tables and values formatted for people."""

from __future__ import annotations

import base64
import html
import math
from typing import Any

from ndtrain.run.metrics import human_bytes

_STYLE = """
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 1100px; color: #222; padding: 0 1em; }
h1 { font-size: 1.5em; } h2 { font-size: 1.2em; border-bottom: 1px solid #ccc; padding-bottom: .2em; margin-top: 1.6em; }
table { border-collapse: collapse; font-size: .9em; margin: .5em 0; }
td, th { border: 1px solid #ddd; padding: .25em .6em; text-align: left; vertical-align: top; }
th { background: #f4f4f4; } td.num { text-align: right; font-variant-numeric: tabular-nums; }
pre { background: #f7f7f7; padding: .8em; overflow-x: auto; font-size: .85em; }
.plots { display: flex; flex-wrap: wrap; gap: 1em; }
figure { margin: 0; } figure img { max-width: 100%; border: 1px solid #eee; }
.note { color: #666; font-style: italic; }
"""


def page(title: str, subtitle: str, sections: list[str]) -> str:
    return (
        "<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n"
        f"<title>{esc(title)}</title>\n<style>{_STYLE}</style>\n</head>\n<body>\n"
        f"<h1>{esc(title)}</h1>\n<p>{esc(subtitle)}</p>\n" + "\n".join(sections) + "\n</body>\n</html>\n"
    )


def section(heading: str, *parts: str) -> str:
    return f"<section>\n<h2>{esc(heading)}</h2>\n" + "\n".join(parts) + "\n</section>"


def plots(*figures: str) -> str:
    return "<div class=\"plots\">\n" + "\n".join(figures) + "\n</div>"


def image(name: str, png: bytes, alt: str, caption: str = "") -> str:
    """A figure whose <img> carries data-plot=NAME (what the rendering test counts)."""
    data = base64.b64encode(png).decode("ascii")
    below = f"<figcaption>{esc(caption)}</figcaption>" if caption else ""
    return f"<figure><img data-plot=\"{esc(name)}\" alt=\"{esc(alt)}\" src=\"data:image/png;base64,{data}\">{below}</figure>"


def table(rows: list[list[Any]], header: list[str] | None = None) -> str:
    head = "<tr>" + "".join(f"<th>{esc(h)}</th>" for h in header) + "</tr>\n" if header else ""
    body = "\n".join(
        "<tr>" + "".join(_cell(v) for v in row) + "</tr>" for row in rows
    )
    return f"<table>\n{head}{body}\n</table>"


def pre(text: str) -> str:
    return f"<pre>{esc(text)}</pre>"


def note(text: str) -> str:
    return f"<p class=\"note\">{esc(text)}</p>"


def esc(text: Any) -> str:
    return html.escape(str(text), quote=True)


def fmt(key: str, value: Any) -> str:
    """A value for a person: bytes in KiB/MiB/GiB (keys naming bytes), 4 significant digits, thousands separators."""
    if isinstance(value, dict):
        return ", ".join(f"{k} {fmt(key, v)}" for k, v in value.items())
    if isinstance(value, list):
        return ", ".join(fmt(key, v) for v in value)
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return str(value)
    if "bytes" in key and isinstance(value, (int, float)) and math.isfinite(value):
        return human_bytes(value)
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def _cell(value: Any) -> str:
    numeric = isinstance(value, (int, float)) and not isinstance(value, bool)
    return f"<td class=\"num\">{esc(value)}</td>" if numeric else f"<td>{esc(value)}</td>"
