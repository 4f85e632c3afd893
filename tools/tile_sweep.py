"""What the Triton GEMM benchmarks (tools/splitk_add_bench, tools/gate_up_silu_bench) share: timing a kernel
module over a space of tile configurations, and the tables they print."""

from __future__ import annotations

import itertools
from collections.abc import Callable

import triton


def sweep_tiles(module, space: dict[str, tuple], tiles_of: Callable[[dict], object | None],
                measure: Callable[[], tuple[float, float]]) -> list[tuple[object, float, float]]:
    """(tiles, µs, rel err) of `measure` with module.tile_config answering each configuration of `space` (the
    product of its values; tiles_of builds the module's Tiles, or None to skip one), put back after; those
    that do not fit the GPU (OutOfResources) are left out."""
    out = []
    shipped = module.tile_config
    try:
        for values in itertools.product(*space.values()):
            tiles = tiles_of(dict(zip(space, values, strict=True)))
            if tiles is None:
                continue
            module.tile_config = lambda m, t=tiles: t
            try:
                us, err = measure()
            except triton.runtime.errors.OutOfResources:
                continue
            out.append((tiles, us, err))
    finally:
        module.tile_config = shipped
    return out


def best_lines(swept: list[dict], rows: tuple[int, ...], top: int = 3) -> list[str]:
    """The `top` fastest swept configurations at each row count."""
    return [f"sweep {m} rows: {r['us']:.2f} µs {r['tiles']}"
            for m in rows for r in sorted((r for r in swept if r["rows"] == m), key=lambda r: r["us"])[:top]]


def comparison_lines(results: list[dict], rows: tuple[int, ...], base: str, ours: str) -> list[str]:
    """A markdown table of the `base` and `ours` variants' µs per row count, ours' TB/s and the speed-up."""
    lines = [f"| rows | {base} µs | {ours} µs | TB/s | speed-up |", "|---|---|---|---|---|"]
    for m in rows:
        b = next(r for r in results if r["rows"] == m and r["variant"] == base)
        o = next((r for r in results if r["rows"] == m and r["variant"] == ours), None)
        lines.append(f"| {m} | {b['us']:.2f} | - | - | - |" if o is None else
                     f"| {m} | {b['us']:.2f} | {o['us']:.2f} | {o['TBps']:.2f} | {b['us'] / o['us']:.2f} |")
    return lines
