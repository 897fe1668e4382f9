"""The image LongContextEval logs: exact match per (length, depth) cell, with its axes and a legend, drawn in plain
torch (no plotting library): lengths left to right under the title ``TOKENS``, depths top to bottom under ``DEPTH``,
and a colour bar from 0 (red) through 0.5 (yellow) to 1 (green) titled ``EXACT MATCH``. The labels use a 3x5-pixel
font of the few characters they need, drawn at twice that size."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

_RED, _YELLOW, _GREEN = torch.tensor([200.0, 40, 40]), torch.tensor([235.0, 200, 60]), torch.tensor([40.0, 170, 70])
GRID, PAPER, INK = 128, 255, 0
"""Grey of the grid lines, white of the margins, black of the labels."""

GLYPHS = {
    "0": "###|#.#|#.#|#.#|###", "1": ".#.|##.|.#.|.#.|###", "2": "###|..#|###|#..|###", "3": "###|..#|###|..#|###",
    "4": "#.#|#.#|###|..#|..#", "5": "###|#..|###|..#|###", "6": "###|#..|###|#.#|###", "7": "###|..#|..#|..#|..#",
    "8": "###|#.#|###|#.#|###", "9": "###|#.#|###|..#|###", ".": "...|...|...|...|.#.", " ": "...|...|...|...|...",
    "K": "#.#|##.|#..|##.|#.#", "M": "#.#|###|###|#.#|#.#", "A": "###|#.#|###|#.#|#.#", "C": "###|#..|#..|#..|###",
    "D": "##.|#.#|#.#|#.#|##.", "E": "###|#..|##.|#..|###", "H": "#.#|#.#|###|#.#|#.#", "N": "##.|#.#|#.#|#.#|#.#",
    "O": "###|#.#|#.#|#.#|###", "P": "###|#.#|###|#..|#..", "S": "###|#..|###|..#|###", "T": "###|.#.|.#.|.#.|.#.",
    "X": "#.#|#.#|.#.|#.#|#.#",
}
"""3 wide, 5 high; ``#`` is ink."""
SCALE = 2
"""Pixels per font pixel."""
CHAR_W, CHAR_H = 4 * SCALE, 5 * SCALE
"""A character's advance (3 pixels and a space) and height, in image pixels."""


def cell_color(value: Tensor) -> Tensor:
    """``(..., 3)`` float RGB of exact-match values: red (0) through yellow (0.5) to green (1)."""
    value = value.double().clamp(0, 1).unsqueeze(-1)
    low, high = (value * 2).clamp(max=1), (value * 2 - 1).clamp(min=0)
    return torch.where(value <= 0.5, _RED + (_YELLOW - _RED) * low, _YELLOW + (_GREEN - _YELLOW) * high)


def heatmap(exact_match: Tensor, *, cell: int = 24) -> Tensor:
    """``(3, H, W)`` uint8 image of a ``(lengths, depths)`` table: lengths left to right, depths top to bottom, each
    cell ``cell`` pixels square with a 1-pixel grey grid, red (0) through yellow (0.5) to green (1)."""
    colors = cell_color(exact_match.detach().T)  # (depths, lengths, 3): rows are depths
    rows, cols = colors.shape[:2]
    image = torch.full((3, rows * (cell + 1) + 1, cols * (cell + 1) + 1), GRID, dtype=torch.uint8)
    for r in range(rows):
        for c in range(cols):
            top, left = 1 + r * (cell + 1), 1 + c * (cell + 1)
            image[:, top:top + cell, left:left + cell] = colors[r, c].round().to(torch.uint8)[:, None, None]
    return image


def text_width(text: str) -> int:
    return len(text) * CHAR_W - SCALE


def draw_text(image: Tensor, text: str, top: int, left: int) -> None:
    """Write ``text`` (characters of :data:`GLYPHS`; others as blanks) into ``image`` at ``(top, left)``."""
    for i, char in enumerate(text.upper()):
        rows = GLYPHS.get(char, GLYPHS[" "]).split("|")
        for y, row in enumerate(rows):
            for x, ink in enumerate(row):
                if ink == "#":
                    t, lft = top + y * SCALE, left + i * CHAR_W + x * SCALE
                    image[:, t:t + SCALE, lft:lft + SCALE] = INK


def length_label(tokens: int) -> str:
    """``"512"``, ``"64K"``, ``"1M"``: a length in the fewest characters."""
    for size, suffix in ((2**20, "M"), (2**10, "K")):
        if tokens >= size and tokens % size == 0:
            return f"{tokens // size}{suffix}"
    return str(tokens)


def depth_label(depth: float) -> str:
    """``"0"``, ``".25"``, ``"1"``."""
    text = f"{depth:.2f}".rstrip("0").rstrip(".")
    return text[1:] if text.startswith("0.") else text


def labelled_heatmap(exact_match: Tensor, lengths: Sequence[int], depths: Sequence[float], *,
                     cell: int = 24) -> Tensor:
    """:func:`heatmap` on white paper with its axes (``TOKENS``: each column's length; ``DEPTH``: each row's depth)
    and a legend (a colour bar from 0 to 1 titled ``EXACT MATCH``): ``(3, H, W)`` uint8."""
    row_labels = [depth_label(d) for d in depths]
    col_labels = [length_label(n) for n in lengths]
    margin = 6
    cell = max(cell, max(text_width(t) for t in col_labels) + margin)  # room for each column's label
    grid = heatmap(exact_match, cell=cell)
    left = margin + max(text_width("DEPTH"), *(text_width(t) for t in row_labels)) + margin
    top = margin + CHAR_H + margin + CHAR_H + margin  # the axis title, then the column labels
    bar_height = cell // 2
    legend = margin + CHAR_H + margin + bar_height + margin + CHAR_H + margin
    width = max(left + grid.shape[2] + margin, left + text_width("EXACT MATCH") + margin)
    height = top + grid.shape[1] + legend
    image = torch.full((3, height, width), PAPER, dtype=torch.uint8)
    image[:, top:top + grid.shape[1], left:left + grid.shape[2]] = grid
    draw_text(image, "TOKENS", margin, left)
    draw_text(image, "DEPTH", top - margin - CHAR_H, margin)  # beside the column labels, over the row labels
    for c, label in enumerate(col_labels):
        center = left + 1 + c * (cell + 1) + cell // 2
        draw_text(image, label, top - margin - CHAR_H, center - text_width(label) // 2)
    for r, label in enumerate(row_labels):
        middle = top + 1 + r * (cell + 1) + cell // 2
        draw_text(image, label, middle - CHAR_H // 2, left - margin - text_width(label))
    # the legend: its title, the colour bar across the grid's width, 0 and 1 at its ends
    below = top + grid.shape[1] + margin
    draw_text(image, "EXACT MATCH", below, left)
    bar_top, bar_width = below + CHAR_H + margin, max(grid.shape[2], text_width("EXACT MATCH"))
    colors = cell_color(torch.linspace(0, 1, bar_width)).round().to(torch.uint8)  # (bar_width, 3)
    image[:, bar_top:bar_top + bar_height, left:left + bar_width] = colors.T[:, None, :]
    draw_text(image, "0", bar_top + bar_height + margin, left)
    draw_text(image, "1", bar_top + bar_height + margin, left + bar_width - text_width("1"))
    return image
