"""File reports → rich renderables: per file, a table of tensors and a headroom table.
Never prints.

Every cell is text first (``12 overflow``, ``empty``, ``refused``); color only repeats
it, so a piped or colorless report says the same. Numbers never wrap (four significant
digits, short exponents: ``-4.502e5``); when long names (a model's
``model.layers.17.self_attn.q_proj.weight``) leave no room, each tensor's name goes
above its shape and dtype in one folding column, so the tables read at 80 columns.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace

from rich import box
from rich.cells import cell_len
from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from sdpa_cli.diagnosis.inspect import FileReport, Headroom, TensorStats
from sdpa_cli.render.common import MUTED, SEVERITY_STYLE, THEME, headroom_text
from sdpa_cli.text import compact, plural, printable, share, shared_parts

TITLE = THEME["title"]
OVERFLOW = SEVERITY_STYLE["error"]
UNDERFLOW = SEVERITY_STYLE["warning"]
NONFINITE = THEME["nonfinite"]
FORMAT_NAMES = {
    "npy": ".npy",
    "npz": ".npz",
    "safetensors": ".safetensors",
    "torch": "PyTorch",
    "json": "JSON",
    "yaml": "YAML",
}


def shape_text(shape: Sequence[int]) -> str:
    """``2×4×6×8``, compact enough for 80 columns; ``scalar`` for shape ()."""
    return "×".join(str(n) for n in shape) if len(shape) else "scalar"


def _title(report: FileReport) -> Text:
    """``samples/cross.npz  .npz, 3 arrays``: the path in bold, what it is muted."""
    kind = FORMAT_NAMES[report.format] + (" case file" if report.case else "")
    unit = "array" if report.format in ("npy", "npz") else "tensor"
    return Text.assemble(
        (report.path, TITLE), "  ", (f"{kind}, {plural(len(report.tensors), unit)}", MUTED)
    )


def _named(tensors: Sequence[TensorStats]) -> list[TensorStats]:
    """``tensors`` with their names as a terminal may show them (:func:`printable`): a
    key in a file from elsewhere may hold an escape sequence. ``--format json`` keeps
    the exact key, which a script needs to load the tensor."""
    return [t if t.name.isprintable() else replace(t, name=printable(t.name)) for t in tensors]


def _nonfinite(n: int, text: str | None = None) -> Text:
    return Text(text or str(n), NONFINITE if n else "")


def _inf_text(t: TensorStats) -> Text:
    """``0``, ``+2``, ``-1`` or ``+2 -1``: infinities by sign."""
    if not t.inf:
        return Text("0")
    parts = [f"+{t.posinf}"] if t.posinf else []
    parts += [f"-{t.neginf}"] if t.neginf else []
    return _nonfinite(t.inf, " ".join(parts))


STAT_COLUMNS = ("min", "max", "mean", "std", "nan", "inf")


def _stat_cells(t: TensorStats) -> list[Text]:
    low = Text("empty", MUTED) if not t.size else Text(compact(t.min))
    numbers = [Text(compact(x)) for x in (t.max, t.mean, t.std)]
    return [low, *numbers, _nonfinite(t.nan), _inf_text(t)]


def _natural_width(rows: Sequence[Sequence[str | Text]], headers: Sequence[str]) -> int:
    """The width of a table of these cells, unwrapped: widest cell per column, plus
    three between columns (a space of padding each side and the box's blank rule)."""
    widths = [cell_len(h) for h in headers]
    for row in rows:
        for i, cell in enumerate(row):
            widths[i] = max(widths[i], cell_len(str(cell)))
    return sum(widths) + 3 * (len(widths) - 1)


def _fitted(
    shown: Sequence[TensorStats], rows: list[list[str | Text]], width: int
) -> tuple[list[list[str | Text]], tuple[str, ...], str] | None:
    """The table's rows and headers made to fit ``width`` with every tensor on one line:
    the names less what all of them share, and the shape and the dtype left out when
    every tensor has the same; what was left out, said once (the caption). None when
    even that does not fit."""
    short, pattern = shared_parts([t.name for t in shown])
    said = [f"name: {pattern}"] if pattern is not None else []
    columns: list[tuple[str, list[str | Text]]] = [("name", list(short))]
    alike = [str(rows[0][i]) for i in (1, 2) if len({str(row[i]) for row in rows}) == 1]
    if alike:
        said.append(("all " if len(rows) > 1 else "") + " ".join(alike))
    for i, header in ((1, "shape"), (2, "dtype")):
        if len({str(row[i]) for row in rows}) > 1:
            columns.append((header, [row[i] for row in rows]))
    if not said:
        return None
    fitted = [[*(c[1][k] for c in columns), *rows[k][3:]] for k in range(len(rows))]
    headers = (*(c[0] for c in columns), *STAT_COLUMNS)
    if _natural_width(fitted, headers) > width:
        return None
    return fitted, headers, " · ".join(said)


def stats_table(tensors: Sequence[TensorStats], width: int = 80) -> Table:
    """One row per tensor: shape, dtype, min, max, mean and std of the finite values,
    NaN and ±inf counts.

    When the names, shapes and dtypes do not fit in ``width`` beside the numbers (a
    model's ``model.layers.17.self_attn.q_proj.weight``), the dotted parts every name
    shares at either end are left out (said once below the table:
    ``model.layers.‹name›.self_attn.q_proj.out``), so that each tensor's shape stays
    on its line; when even that does not fit, each tensor's first cell holds its name
    with its shape and dtype on the line below, and the name folds there rather than
    squeezing every column.
    """
    shown = [t for t in _named(tensors) if t.problem is None]
    headers: tuple[str, ...] = ("name", "shape", "dtype", *STAT_COLUMNS)
    rows: list[list[str | Text]] = [
        [t.name, shape_text(t.shape), t.dtype, *_stat_cells(t)] for t in shown
    ]
    table = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False)
    if _natural_width(rows, headers) > width and shown:
        fitted = _fitted(shown, rows, width)
        if fitted is not None:
            rows, headers, caption = fitted
            table.caption, table.caption_justify = Text(caption, MUTED), "left"
            for header in headers[: len(headers) - len(STAT_COLUMNS)]:
                table.add_column(header, overflow="fold")
            for col in STAT_COLUMNS:
                table.add_column(col, justify="right", no_wrap=True)
            for row in rows:
                table.add_row(*row)
            return table
    if _natural_width(rows, headers) <= width:
        table.add_column("name", overflow="fold")
        table.add_column("shape", overflow="fold")
        table.add_column("dtype", overflow="fold")
    else:
        table.add_column("tensor", overflow="fold", min_width=12)
        rows = [
            [Text.assemble(t.name, "\n", (f"{shape_text(t.shape)} {t.dtype}", MUTED)), *row[3:]]
            for t, row in zip(shown, rows, strict=True)
        ]
    for col in STAT_COLUMNS:
        table.add_column(col, justify="right", no_wrap=True)
    for row in rows:
        table.add_row(*row)
    return table


def _headroom_cell(h: Headroom) -> Text:
    """Bits below the format's max, then each kind of damage the cast does."""
    if math.isnan(h.bits):
        return Text("—")
    cell = Text(f"{headroom_text(h.bits)} bits", OVERFLOW if h.overflow else "")
    for n, what, style in (
        (h.overflow, "overflow", OVERFLOW),
        (h.flush, "to zero", UNDERFLOW),
        # A few subnormals in data around zero are no damage: the JSON counts them.
        (h.subnormal if h.subnormal_notable else 0, "subnormal", UNDERFLOW),
    ):
        if n:
            cell.append(f"\n{n} {what}", style)
    return cell


def headroom_table(tensors: Sequence[TensorStats], width: int = 80) -> RenderableType:
    """Per tensor, its largest and smallest nonzero |x|, and per format the bits of
    headroom and the values a cast would overflow, flush to zero or make subnormal;
    the names less what all of them share when they would not fit ``width``."""
    shown = [t for t in _named(tensors) if t.problem is None]
    names = [t.name for t in shown]
    longest = max((cell_len(n) for n in names), default=0)
    pattern = None
    if longest + 62 > width:  # the numbers' columns take about 62 cells
        names, pattern = shared_parts(names)
    formats = [h.format for h in shown[0].headroom] if shown else []
    table = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False)
    table.add_column("name", overflow="fold", min_width=4)
    table.add_column("max |x|", justify="right", no_wrap=True)
    table.add_column("min |x|>0", justify="right", no_wrap=True)
    for f in formats:
        table.add_column(f, justify="right", no_wrap=True)
    for t, name in zip(shown, names, strict=True):
        table.add_row(
            name, compact(t.absmax), compact(t.absmin), *(_headroom_cell(h) for h in t.headroom)
        )
    if pattern is not None:
        table.caption, table.caption_justify = Text(f"name: {pattern}", MUTED), "left"
    title = Text.assemble(
        ("headroom", TITLE),
        ("  bits between max |x| and each format's max; what a cast would do", MUTED),
    )
    return Group(title, table)


def notes(tensors: Sequence[TensorStats]) -> list[Text]:
    """One sentence per problem: refused members, overflow, underflow, non-finite
    values, empty tensors, and where a case file's tensors came from."""
    lines: list[Text] = []
    for t in _named(tensors):
        if t.problem is not None:
            lines.append(
                Text.assemble((t.name, TITLE), ": ", ("refused", OVERFLOW), f": {t.problem}")
            )
            continue
        if t.source is not None:
            lines.append(Text(f"{t.name}: read from {t.source}", MUTED))
        if not t.size:
            lines.append(
                Text(f"{t.name}: empty (shape {shape_text(t.shape)}): nothing to measure", MUTED)
            )
        elif not t.finite:
            lines.append(Text(f"{t.name}: no finite value: every statistic is empty", NONFINITE))
        for h in t.headroom:
            if h.overflow:
                lines.append(
                    Text(
                        f"{t.name}: max |x| = {compact(t.absmax, 3)} > {h.format} max {compact(h.max, 6)}: "
                        f"{_counted(h.overflow, 'overflows', 'overflow')} to inf",
                        OVERFLOW,
                    )
                )
            if h.flush:
                lines.append(
                    Text(
                        f"{t.name}: min |x| = {compact(t.absmin, 3)}: "
                        f"{_counted(h.flush, 'flushes', 'flush', 'nonzero value')} to zero "
                        f"in {h.format} (smallest subnormal {compact(h.tiny, 3)})",
                        UNDERFLOW,
                    )
                )
            if h.subnormal_notable:
                lines.append(
                    Text(
                        f"{t.name}: {plural(h.subnormal, 'value')} ({share(h.subnormal, h.nonzero)} "
                        f"of the nonzero ones) {'is' if h.subnormal == 1 else 'are'} subnormal in {h.format} "
                        f"(below its smallest normal {compact(h.normal, 3)}: fewer significant bits)",
                        UNDERFLOW,
                    )
                )
    return lines


def _counted(n: int, one: str, many: str, unit: str = "value") -> str:
    """``1 value overflows``, ``12 values overflow``."""
    return f"{plural(n, unit)} {one if n == 1 else many}"


def render_file(report: FileReport, width: int = 80) -> RenderableType:
    """One file: its title, the statistics table, the headroom table and the notes."""
    parts: list[RenderableType] = [_title(report)]
    readable = [t for t in report.tensors if t.problem is None]
    if readable:
        parts += [
            stats_table(report.tensors, width),
            Text(""),
            headroom_table(report.tensors, width),
        ]
    found = notes(report.tensors)
    if found:
        parts += [Text(""), *found]
    return Group(*parts)


def render_inspect(reports: Sequence[FileReport], width: int = 80) -> list[RenderableType]:
    """Every file's report, a blank line between files, laid out for ``width`` columns."""
    out: list[RenderableType] = []
    for n, report in enumerate(reports):
        if n:
            out.append(Text(""))
        out.append(render_file(report, width))
    return out
