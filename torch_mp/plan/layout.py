"""A layout as one value: :class:`Layout` (the C++ ``torch_mp::plan::Layout``), and the one
place where the keyword form of :func:`torch_mp.plan.estimate`, :func:`~torch_mp.plan.measure`
and :func:`~torch_mp.plan.measure_time` becomes one."""

from __future__ import annotations

from torch_mp import _C

__all__ = ["Layout", "as_layout"]

Layout = _C.Layout


def as_layout(layout: Layout | None, keywords: dict, who: str) -> Layout:
    """``layout``, or the :class:`Layout` that ``keywords`` make; ``who`` names the caller in
    the error for both given, or for something else given."""
    if layout is None:
        return Layout(**keywords)
    if keywords:
        raise TypeError(
            f"{who}: takes a Layout or its keywords, not both (got a Layout and "
            f"{', '.join(sorted(keywords))})"
        )
    if not isinstance(layout, Layout):
        raise TypeError(
            f"{who}: layout must be a torch_mp.plan.Layout, got {type(layout).__name__}"
        )
    return layout


def mesh_sizes(layout: Layout) -> dict[str, int]:
    """The mesh a layout asks for: ``{"tp": ..., "pp": ..., "dp": ..., "cp": ..., "ep": ...}``."""
    return {d: getattr(layout, d) for d in ("tp", "pp", "dp", "cp", "ep")}
