"""What the fits need from PyTensor's JAX backend beyond compiling: generators that continue
across compiled functions, and rows of points sharded across JAX devices.

**Generators.** PyTensor's JAX linker compiles a function against a *copy* of each shared
NumPy generator (JAX keeps its key in a dict of arrays), so the fit's ``noise_rng`` never
advanced: a recompiled step (GPF's growing cloud, ``refine`` after ``load``) restarted the
noise from the seed, and a saved fit did not continue exactly. :func:`sync_generators` keeps
the two in step around every call: the JAX key lives in the 64 low bits of the generator's
PCG64 state, where the linker reads it from.

**Sharding.** :func:`row_sharding` turns ``devices`` (a number, a list of JAX devices or a
``jax.sharding.Mesh``) into a sharding of the first axis; :func:`shard_rows` marks an
``(N, D)`` graph variable with it (``jax.lax.with_sharding_constraint`` on JAX, the identity
elsewhere), so XLA evaluates each row's log-density and gradient on the device holding it.
Across the hosts of ``jax.distributed``, :func:`whole_on_every_host` makes a function's
results whole on each host, which cannot read rows held by another.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from pytensor.compile.ops import TypeCastingOp
from pytensor.compile.sharedvalue import SharedVariable
from pytensor.graph.basic import Apply, Variable
from pytensor.graph.traversal import applys_between
from pytensor.tensor.random.type import RandomGeneratorType
from pytensor.tensor.type import TensorType

__all__ = [
    "ShardRows",
    "row_sharding",
    "shard_rows",
    "sync_generators",
    "whole_on_every_host",
]

_KEY_BITS = 64  # jax_typify(Generator) takes the key from the low 64 bits of PCG64's state


def _with_key(generator: np.random.Generator, key: np.ndarray) -> np.random.Generator:
    """A copy of ``generator`` whose JAX key (two uint32 words, low word first) is ``key``."""
    state = generator.bit_generator.state
    word0, word1 = (int(w) for w in np.asarray(key, dtype=np.uint32))
    high = state["state"]["state"] >> _KEY_BITS << _KEY_BITS
    state["state"]["state"] = high | word1 << 32 | word0
    out = np.random.Generator(type(generator.bit_generator)())
    out.bit_generator.state = state
    return out


class _SyncedGenerators:
    """A compiled JAX function whose generator copies follow the shared generators: before a
    call a generator set from outside (a new seed, a loaded fit) replaces the copy's key,
    after it the shared generator takes the advanced key."""

    def __init__(self, fn, pairs: list):
        self.__dict__.update(_fn=fn, _pairs=pairs, _written=[None] * len(pairs))

    def __call__(self, *args, **kwargs):
        from pytensor.link.jax.dispatch import jax_typify

        for i, (shared, container) in enumerate(self._pairs):
            current = shared.get_value(borrow=True)
            if current is not self._written[i]:
                container.storage[0] = jax_typify(current)  # as the linker stores it
        out = self._fn(*args, **kwargs)
        for i, (shared, container) in enumerate(self._pairs):
            advanced = _with_key(shared.get_value(borrow=True), container.data["jax_state"])
            shared.set_value(advanced, borrow=True)
            self._written[i] = advanced
        return out

    def __getattr__(self, name: str) -> Any:
        return getattr(self._fn, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._fn, name, value)


def sync_generators(fn):
    """``fn`` (a compiled PyTensor function) with its shared generators kept in step with
    their copies when it runs on JAX; ``fn`` itself otherwise."""
    from pytensor.link.jax.linker import JAXLinker

    if not isinstance(fn.maker.linker, JAXLinker):
        return fn
    pairs = [
        (spec.variable, container)
        for spec, container in zip(fn.maker.inputs, fn.input_storage, strict=True)
        if isinstance(spec.variable, SharedVariable)
        and isinstance(spec.variable.type, RandomGeneratorType)
    ]
    return _SyncedGenerators(fn, pairs) if pairs else fn


class ShardRows(TypeCastingOp):
    """The identity, telling XLA how to lay out its input across devices: ``sharding`` (a
    ``jax.sharding.NamedSharding``; rows split, or whole on every device)."""

    __props__ = ("sharding",)

    def __init__(self, sharding):
        self.sharding = sharding

    def make_node(self, x: Variable) -> Apply:
        return Apply(self, [x], [x.type()])

    def infer_shape(self, node, input_shapes):
        return input_shapes

    def pullback(self, inputs, outputs, output_grads):
        return output_grads

    def __str__(self) -> str:
        return f"ShardRows({self.sharding.spec}, {len(self.sharding.device_set)} devices)"


def _register_jax() -> None:
    """How JAX runs :class:`ShardRows` (registered once JAX is known to be installed)."""
    import jax

    from pytensor.link.jax.dispatch import jax_funcify

    @jax_funcify.register(ShardRows)
    def _jax_shard_rows(op: ShardRows, **kwargs):
        def shard(x):
            return jax.lax.with_sharding_constraint(x, op.sharding)

        return shard


def shard_rows(points: Variable, sharding) -> Variable:
    """``points`` ``(N, ...)`` with its rows split across ``sharding``'s devices (unchanged
    for ``sharding=None``)."""
    return points if sharding is None else ShardRows(sharding)(points)


def whole_on_every_host(outputs: list[Variable], updates: dict) -> tuple[list, dict]:
    """``outputs`` and ``updates`` kept whole on every device when the graph splits rows
    across the devices of several processes (``jax.distributed``): each host can then read
    them (a row split across hosts cannot be fetched by any one of them). Unchanged in one
    process, where the state stays split between steps."""
    meshes = {
        node.op.sharding.mesh
        for node in applys_between([], [*outputs, *updates.values()])
        if isinstance(node.op, ShardRows)
    }
    if not meshes:
        return outputs, updates
    import jax

    if jax.process_count() == 1:
        return outputs, updates
    from jax.sharding import NamedSharding, PartitionSpec

    whole = ShardRows(NamedSharding(meshes.pop(), PartitionSpec()))

    def gathered(var: Variable) -> Variable:
        return whole(var) if isinstance(var.type, TensorType) else var

    return [gathered(o) for o in outputs], {k: gathered(v) for k, v in updates.items()}


def row_sharding(devices: int | Sequence | Any | None):
    """The ``jax.sharding.NamedSharding`` splitting a first axis across ``devices``: how
    many of ``jax.devices()`` (all of them, on every host, after ``jax.distributed``), which
    ones, or a ``jax.sharding.Mesh`` (the axis split over all its mesh axes). ``None`` and 1
    device: no sharding."""
    if devices is None:
        return None
    try:
        import jax
    except ImportError:
        raise ImportError(
            "devices= shards the particles across JAX devices and needs JAX: "
            'pip install "pymc-gpf[jax]".'
        ) from None
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    _register_jax()
    if isinstance(devices, Mesh):
        return NamedSharding(devices, PartitionSpec(devices.axis_names))
    available = jax.devices()
    if isinstance(devices, bool) or not isinstance(devices, int | Sequence):
        raise TypeError(
            "devices is a number of JAX devices, a list of them or a jax.sharding.Mesh; "
            f"got {devices!r}."
        )
    if isinstance(devices, int):
        if not 1 <= devices <= len(available):
            raise ValueError(
                f"devices={devices}, but JAX sees {len(available)} device(s) ({available}). "
                "On a CPU, XLA_FLAGS=--xla_force_host_platform_device_count=4 (set before "
                "JAX is imported) splits it into 4 host devices."
            )
        devices = available[:devices]
    devices = list(devices)
    if len(devices) <= 1:
        return None
    return NamedSharding(Mesh(np.asarray(devices), ("particles",)), PartitionSpec("particles"))
