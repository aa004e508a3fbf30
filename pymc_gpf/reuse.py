"""Compiled functions reused across fits: the same graph over other shared variables.

PyTensor's rewrites take most of a warm fit's setup (a default GPF fit of a 26-coefficient
logistic regression: 1.5 s of its 1.8 s compiling five functions). A second fit of the same
model with the same method and options builds the same graphs over new shared variables
(its own particles, generator, step size): the compiled function of the first is copied
with those swapped in (``Function.copy(swap=...)``, no rewriting), when
:func:`~pytensor.graph.basic.equal_computations` finds the two graphs equal with the shared
variables paired in the order the graphs reach them. Constants (the data) and every Op are
compared; any difference compiles afresh.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass

from pytensor.compile.sharedvalue import SharedVariable
from pytensor.graph.basic import Variable, equal_computations
from pytensor.graph.traversal import graph_inputs

__all__ = ["MAX_KEPT", "MAX_KEPT_BYTES", "reuse_or_compile"]

# compiled functions kept (the most recently used): each holds the shared variables of the
# fit that compiled it, so one whose shared values exceed MAX_KEPT_BYTES is not kept (a
# large model's factor, which the fit's user may have let go)
MAX_KEPT = 16
MAX_KEPT_BYTES = 64 * 2**20


@dataclass
class _Compiled:
    key: Hashable
    inputs: list[Variable]
    graphs: list[Variable]  # the outputs, then the updates' new values
    targets: list[SharedVariable]  # the updated shared variables
    shared: list[SharedVariable]
    fn: Callable


_KEPT: list[_Compiled] = []


def _shared(graphs: list[Variable], targets: Sequence[SharedVariable]) -> list[SharedVariable]:
    """The shared variables the graphs reach, in the order they reach them, then the
    updated ones they do not read."""
    seen = [v for v in graph_inputs(graphs) if isinstance(v, SharedVariable)]
    return seen + [t for t in targets if t not in seen]


def reuse_or_compile(
    key: Hashable,
    inputs: list[Variable],
    outputs: Variable | list[Variable],
    updates: dict | None,
    compile: Callable[[], Callable],
) -> Callable:
    """``compile()``'s function, or a kept one compiled for an equal graph under the same
    ``key`` (what else decides compilation: backend, mode, flags), copied onto this graph's
    shared variables."""
    single = not isinstance(outputs, list | tuple)
    updates = dict(updates or {})
    targets = list(updates)
    graphs = [*([outputs] if single else outputs), *updates.values()]
    shared = _shared(graphs, targets)
    for kept in _KEPT:
        if _same(kept, key, inputs, graphs, targets, shared):
            _KEPT.remove(kept)
            _KEPT.append(kept)
            present = {i.variable for i in kept.fn.maker.inputs}
            pairs = zip(kept.shared, shared, strict=True)
            return kept.fn.copy(swap={o: n for o, n in pairs if o is not n and o in present})
    fn = compile()
    if sum(getattr(v.get_value(borrow=True), "nbytes", 0) for v in shared) <= MAX_KEPT_BYTES:
        _KEPT.append(_Compiled(key, list(inputs), graphs, targets, shared, fn))
        del _KEPT[:-MAX_KEPT]
    return fn


def _same(
    kept: _Compiled,
    key: Hashable,
    inputs: list[Variable],
    graphs: list[Variable],
    targets: list[SharedVariable],
    shared: list[SharedVariable],
) -> bool:
    if kept.key != key or len(kept.graphs) != len(graphs) or len(kept.shared) != len(shared):
        return False
    if len(kept.inputs) != len(inputs) or len(kept.targets) != len(targets):
        return False
    pairs = [*zip(kept.shared, shared, strict=True), *zip(kept.inputs, inputs, strict=True)]
    if any(old.type != new.type for old, new in pairs):
        return False
    # each update writes the shared variable paired with the kept one's
    position = {id(new): i for i, new in enumerate(shared)}
    if [position.get(id(t)) for t in targets] != [kept.shared.index(t) for t in kept.targets]:
        return False
    old, new = zip(*pairs, strict=True) if pairs else ((), ())
    return equal_computations(kept.graphs, graphs, in_xs=list(old), in_ys=list(new))
