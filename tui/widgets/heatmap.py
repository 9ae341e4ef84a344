"""Per-layer block selections as a heatmap, drawn with the Line API.

Rows are layers, two per terminal row (upper half block = even layer, lower = odd);
columns are block positions bucketed to the widget's width; a cell is lit when the layer
selected any block of its bucket at the last step.
"""

from __future__ import annotations

from rich.segment import Segment
from rich.style import Style
from textual.strip import Strip
from textual.widget import Widget

from kvchat.kv.backend import CacheStats

GLYPHS = {(False, False): " ", (True, False): "▀", (False, True): "▄", (True, True): "█"}
LIT = Style(color="rgb(255,170,60)", bgcolor="rgb(40,40,48)")
DENSE = Style(color="rgb(90,140,220)", bgcolor="rgb(40,40,48)")
NO_SELECTIONS = "no block selections (dense attention or empty cache)"
NOT_REPORTED = "not reported by the server"


class SelectionHeatmap(Widget):
    DEFAULT_CSS = """
    SelectionHeatmap { height: auto; min-height: 1; }
    """

    def __init__(self, **kwargs: str) -> None:
        super().__init__(**kwargs)
        self.cache: CacheStats | None = None
        self.empty = NO_SELECTIONS  # the line shown without selections

    def show(self, cache: CacheStats | None) -> None:
        """`cache` None: the engine runs on a server that does not report its cache."""
        empty = NOT_REPORTED if cache is None else NO_SELECTIONS
        if cache == self.cache and empty == self.empty:
            return
        self.cache, self.empty = cache, empty
        self.styles.height = max(1, (len(cache.layers) + 1) // 2) if cache is not None else 1
        self.refresh()

    def n_blocks(self) -> int:
        cache = self.cache
        if cache is None or not cache.layers:
            return 0
        most = max((max(layer.selected, default=-1) + 1 for layer in cache.layers), default=0)
        candidates = max(layer.candidates for layer in cache.layers)
        return max(cache.blocks_in_dram, candidates, most)

    def lit_columns(self, layer: int, width: int, n_blocks: int) -> list[bool]:
        """For each of `width` columns, whether `layer` selected a block in its bucket."""
        assert self.cache is not None
        lit = [False] * width
        for block in self.cache.layers[layer].selected:
            lit[min(block * width // n_blocks, width - 1)] = True
        return lit

    def render_line(self, y: int) -> Strip:
        width = self.size.width
        cache = self.cache
        n_blocks = self.n_blocks()
        if cache is None or not cache.layers or n_blocks == 0 or width == 0:
            text = self.empty if y == 0 else ""
            return Strip([Segment(text[:width].ljust(width))])
        top_layer, bottom_layer = 2 * y, 2 * y + 1
        if top_layer >= len(cache.layers):
            return Strip.blank(width)
        top = self.lit_columns(top_layer, width, n_blocks)
        has_bottom = bottom_layer < len(cache.layers)
        bottom = self.lit_columns(bottom_layer, width, n_blocks) if has_bottom else [False] * width
        style = DENSE if cache.layers[top_layer].dense else LIT
        cells = "".join(GLYPHS[pair] for pair in zip(top, bottom, strict=True))
        return Strip([Segment(cells, style)], width)
