"""The shared adapter: batched log-density and gradient equal PyMC's own, point by point."""

import warnings

import numpy as np
import pymc as pm
import pytensor
import pytensor.tensor as pt
import pytest

from pymc.distributions.transforms import ordered
from pytensor.compile.mode import Mode
from pytensor.graph.basic import Apply
from pytensor.graph.fg import FunctionGraph
from pytensor.graph.op import Op
from pytensor.graph.rewriting.basic import in2out
from pytensor.graph.traversal import ancestors
from pytensor.scalar import Switch
from pytensor.scan.op import Scan
from pytensor.tensor.blockwise import Blockwise

import pymc_gpf.target as target_module

from pymc_gpf import BatchedTarget
from pymc_gpf.rewrites import lift_switch_through_unary, python_mode


@pytest.fixture(scope="module")
def simplex_model():
    with pm.Model(coords={"k": ["a", "b", "c"]}) as model:
        p = pm.Dirichlet("p", np.ones(3), dims="k")
        scale = pm.HalfNormal("scale", 1.0)
        loc = pm.Normal("loc", 0, 1, shape=2)
        pm.Deterministic("spread", scale * p, dims="k")
        pm.Multinomial("counts", 30, p, observed=[5, 10, 15])
        pm.Normal("y", loc.sum(), scale, observed=[0.3, -0.2])
        pm.Bernoulli("flip", logit_p=loc * scale, observed=[0, 1])  # the lifted switch
    return model


def test_layout_and_round_trip(simplex_model):
    target = BatchedTarget(simplex_model)
    assert target.ndim == 2 + 1 + 2
    assert target.labels == ["p_simplex__[0]", "p_simplex__[1]", "scale_log__", "loc[0]", "loc[1]"]
    x = np.arange(5.0)
    point = target.point(x)
    assert set(point) == {"p_simplex__", "scale_log__", "loc"} and point["loc"].shape == (2,)
    np.testing.assert_array_equal(target.flatten(point), x)
    assert target.variables_at(np.array([False, False, True, False, True])) == ["scale", "loc"]


PYTHON_MODE = {"mode": "FAST_COMPILE"}  # cheap to compile; for reference values only


@pytest.fixture(scope="module")
def batched(simplex_model):
    """The function under test, compiled once with the default backend."""
    return BatchedTarget(simplex_model).compile_logp_dlogp()


def _assert_pymc_values(model, target, batched, points) -> None:
    """The batched log-density and gradient at every row equal PyMC's at that point."""
    logp, grad = batched(points)
    pm_logp = model.compile_logp(**PYTHON_MODE)
    pm_dlogp = model.compile_dlogp(**PYTHON_MODE)
    for i, x in enumerate(points):
        assert logp[i] == pytest.approx(pm_logp(target.point(x)), rel=1e-12)
        np.testing.assert_allclose(grad[i], pm_dlogp(target.point(x)), rtol=1e-10, atol=1e-12)


def test_batched_logp_and_grad_equal_pymc_per_point(simplex_model, batched):
    target = BatchedTarget(simplex_model)
    points = np.random.default_rng(0).normal(size=(7, target.ndim))
    _assert_pymc_values(simplex_model, target, batched, points)


def test_simplex_transform_is_truly_batched(simplex_model):
    """Every Op of the Dirichlet model (LogSumExp of the simplex transform included) has a
    batched rule: no per-particle Blockwise loop in the log-density or gradient graph."""
    target = BatchedTarget(simplex_model)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        logp, grad, _ = target.logp_and_grads(pt.matrix("particles"))
    ops = {type(v.owner.op) for v in ancestors([logp, grad]) if v.owner is not None}
    assert Blockwise not in ops


LOOPING_MODE = {"mode": Mode(linker="py", optimizer="fast_run").excluding("fusion")}  # no C


def _looped_ops(fn) -> set:
    return {n.op for n in fn.maker.fgraph.apply_nodes if isinstance(n.op, Blockwise)}


def test_common_model_ops_compile_to_batched_ops_without_a_warning():
    """Ops PyTensor has no batched rule for, or whose rule loops on a shape-derived index:
    the ordered transform's ``AllocEmpty``/``SetSubtensor`` (and the ``Join``/``Split`` of
    their gradient) with the ordered logistic's cutpoints joined to constants, the LKJ factor's
    ``AdvancedSetSubtensor``, a Categorical's ``take_along_axis`` over a 2-D Dirichlet, a
    covariance's ``AllocDiag``, imputed observations: one model with all of them compiles with
    no per-particle loop left (a gufunc kernel such as the Cholesky is batched itself), no
    warning, and PyMC's values and gradients at every particle; so do its draws' constrained
    values, where the imputed values are written back through a boolean mask and a
    deterministic another one uses is output through a ``ViewOp``."""
    rng = np.random.default_rng(2)
    imputed = rng.normal(size=(10, 3))
    imputed[[2, 5], [1, 0]] = np.nan
    with pm.Model() as model:
        cut = pm.Normal("cut", 0, 3, shape=3, transform=ordered, initval=[-1.0, 0.0, 1.0])
        pm.OrderedLogistic("grade", eta=pm.Normal("eta"), cutpoints=cut,
                           observed=rng.integers(0, 4, 20))  # fmt: skip
        chol, _, _ = pm.LKJCholeskyCov(
            "L", n=3, eta=2.0, sd_dist=pm.Exponential.dist(1.0), compute_corr=True
        )
        pm.MvNormal("z", np.zeros(3), chol=chol, observed=rng.normal(size=(8, 3)))
        p = pm.Dirichlet("p", np.ones(3), shape=(4, 3))
        pm.Categorical("c", p[np.arange(12) % 4], observed=rng.integers(0, 3, 12))
        scale = pm.HalfNormal("scale")
        pm.MvNormal("v", 0.0, cov=pt.diag(pt.ones(3) * scale**2), observed=rng.normal(size=3))
        pm.Normal("x", pm.Normal("m", shape=3), 1.0, observed=imputed)
        # a deterministic used by another: its value is output through a ViewOp
        shifted = pm.Deterministic("shifted", 2 * scale - 1)
        pm.Deterministic("powers", shifted ** pt.arange(3))
    target = BatchedTarget(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fn = target.compile_logp_dlogp(compile_kwargs=LOOPING_MODE)
    assert not {op for op in _looped_ops(fn) if not hasattr(op.core_op, "gufunc_signature")}
    points = 0.3 * np.random.default_rng(3).normal(size=(5, target.ndim))
    _assert_pymc_values(model, target, fn, points)
    # the draws' constrained values: the imputed observations are written through a mask
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        # in C: numba's rewrites remove the ViewOp's loop themselves
        values = target.compile_constrained(backend="c")(points)
    expected = np.repeat(imputed[None], len(points), axis=0)
    expected[:, np.isnan(imputed)] = values["x_unobserved"]
    np.testing.assert_array_equal(values["x"], expected)
    shifted = 2 * values["scale"] - 1
    np.testing.assert_allclose(values["shifted"], shifted, rtol=1e-15)
    np.testing.assert_allclose(values["powers"], shifted[:, None] ** np.arange(3), rtol=1e-14)


def test_a_loop_over_time_is_one_scan_over_the_batch():
    """A GARCH-like variance recursion (a state, parameters, a sequence) and a level with two
    lags (taps -2 and -1) run as one ``Scan`` of batched states each way (no ``Blockwise``,
    no ``Scan`` inside another), with PyMC's values and gradients at every particle."""
    y = np.random.default_rng(4).normal(size=24)
    with pm.Model() as model:
        a, b = pm.Normal("a", 0, 0.3), pm.Normal("b", 0, 0.3)
        omega, alpha = pm.HalfNormal("omega"), pm.Uniform("alpha", 0, 0.5)
        returns = pt.as_tensor(y)
        variance = pytensor.scan(
            lambda r, v, om, al: om + al * r**2 + (1 - al - 0.2) * v,
            sequences=[returns[:-1]], outputs_info=[omega / 0.2], non_sequences=[omega, alpha],
            return_updates=False,
        )  # fmt: skip
        pm.Normal("r", 0.0, pt.sqrt(variance), observed=y[1:])
        level = pytensor.scan(
            lambda x, l2, l1, a_, b_: a_ * l1 + b_ * l2 + x,
            sequences=[returns[2:]], outputs_info=[{"initial": pt.stack([a, b]), "taps": [-2, -1]}],
            non_sequences=[a, b], return_updates=False,
        )  # fmt: skip
        pm.Normal("l", level, 1.0, observed=np.zeros(22))
    target = BatchedTarget(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fn = target.compile_logp_dlogp(compile_kwargs=LOOPING_MODE)
    nodes = fn.maker.fgraph.apply_nodes
    scans = [n for n in nodes if isinstance(n.op, Scan)]
    assert scans and not _looped_ops(fn)
    assert not any(isinstance(m.op, Scan) for n in scans for m in n.op.fgraph.apply_nodes)
    points = 0.3 * np.random.default_rng(5).normal(size=(5, target.ndim))
    _assert_pymc_values(model, target, fn, points)


class _Cube(Op):
    """``x ** 3`` elementwise, with no batched rule (a user's custom Op)."""

    def make_node(self, x):
        x = pt.as_tensor_variable(x)
        return Apply(self, [x], [x.type()])

    def perform(self, node, inputs, outputs):
        outputs[0][0] = inputs[0] ** 3

    def pullback(self, inputs, outputs, cotangents):
        return [3 * inputs[0] ** 2 * cotangents[0]]


def test_an_op_left_looping_after_compilation_is_reported_once():
    with pm.Model() as model:
        x = pm.Normal("x", shape=2)
        pm.Potential("cube", -(pt.sum(_Cube()(x)) ** 2) / 10)
    target = BatchedTarget(model)
    monkey = set()
    target_module._WARNED, saved = monkey, target_module._WARNED
    try:
        with pytest.warns(RuntimeWarning, match=r"the Ops \['_Cube'\] have no batched"):
            fn = target.compile_logp_dlogp(compile_kwargs=LOOPING_MODE)
    finally:
        target_module._WARNED = saved
    assert _looped_ops(fn)
    points = np.array([[1.0, 2.0], [0.5, -1.0]])
    logp, grad = fn(points)
    cubes = np.sum(points**3, axis=1)
    expected = -0.5 * np.sum(points**2, axis=1) - np.log(2 * np.pi) - cubes**2 / 10
    np.testing.assert_allclose(logp, expected, rtol=1e-12)
    np.testing.assert_allclose(grad, -points - (cubes / 5)[:, None] * 3 * points**2, rtol=1e-12)


def test_switch_of_one_unary_op_is_lifted():
    """switch(c, f(a), f(b)) -> f(switch(c, a, b)): one transcendental per element."""
    c, a, b = pt.vector("c", dtype="bool"), pt.vector("a"), pt.vector("b")
    fgraph = FunctionGraph([c, a, b], [pt.switch(c, pt.softplus(-a), pt.softplus(b))])
    in2out(lift_switch_through_unary).rewrite(fgraph)
    [out] = fgraph.outputs
    assert out.owner.op == pt.softplus(a).owner.op
    assert isinstance(out.owner.inputs[0].owner.op.scalar_op, Switch)


def test_a_sum_wider_than_a_ufunc_compiles_without_c_code():
    """Python mode evaluates an elementwise node with one NumPy ufunc (at most 32
    operands); a sum of 80 terms and of int8 terms that overflow int8 as partial sums are
    split into narrower sums, with the same value as in C."""
    xs = [pt.scalar(f"x{i}") for i in range(80)]
    ks = [pt.scalar(f"k{i}", dtype="int8") for i in range(40)]
    f = pt.scalar("f")
    total = pt.add(*xs) * 2.0 + pt.add(*ks, f)
    inputs = [*xs, *ks, f]
    values = [*np.linspace(-1.0, 2.0, 80), *[np.int8(100)] * 40, 0.5]
    expected = 2.0 * np.sum(values[:80]) + 4000.0 + 0.5
    fn = pytensor.function(inputs, total, mode=python_mode())
    np.testing.assert_allclose(fn(*values), expected, rtol=1e-12)


def test_a_model_with_more_free_variables_than_a_ufunc_takes_operands_compiles():
    """PyMC's log-density adds one term per free variable: with 40, the start check and
    GF's probing gradient (both compiled without C code) failed before any step of any
    method. x_i ~ N(0, 1), y = 1 ~ N(sum x, 1): log p and its gradient in closed form."""
    with pm.Model() as model:
        xs = [pm.Normal(f"x{i}", 0.0, 1.0) for i in range(40)]
        pm.Normal("y", pt.add(*xs), 1.0, observed=1.0)
    target = BatchedTarget(model)
    rows = np.random.default_rng(0).normal(size=(3, 40))
    log_norm = -0.5 * np.log(2 * np.pi)
    logp = 41 * log_norm - 0.5 * (rows**2).sum(1) - 0.5 * (1.0 - rows.sum(1)) ** 2
    grad = -rows + (1.0 - rows.sum(1))[:, None]
    point = model.initial_point() | {f"x{i}": rows[0, i] for i in range(40)}
    np.testing.assert_allclose(target.check_logp()(point), logp[0], rtol=1e-12)
    np.testing.assert_allclose(target.quick_gradient()(rows), grad, rtol=1e-12)


def test_fallback_when_the_graph_cannot_be_vectorised(simplex_model, batched, monkeypatch):
    target = BatchedTarget(simplex_model)
    points = np.random.default_rng(1).normal(size=(4, target.ndim))
    expected = batched(points)

    def refuse(*args, **kwargs):
        raise NotImplementedError("no batched rule")

    monkeypatch.setattr(target_module, "batched_graph", refuse)
    monkeypatch.setattr(target_module, "_WARNED", set())
    with pytest.warns(RuntimeWarning, match="falling back to a slower per-particle loop"):
        got = target.compile_logp_dlogp(compile_kwargs=PYTHON_MODE)(points)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        target.compile_logp_dlogp(compile_kwargs=PYTHON_MODE)  # warned once only
    np.testing.assert_allclose(got[0], expected[0], rtol=1e-12)
    np.testing.assert_allclose(got[1], expected[1], rtol=1e-12)


def test_start_in_constrained_or_transformed_names(simplex_model):
    target = BatchedTarget(simplex_model)
    by_rv = target.start_vector({"scale": 2.0, "loc": 0.5})
    by_value = target.start_vector({"scale_log__": np.log(2.0)})
    assert by_rv[2] == pytest.approx(np.log(2.0)) and by_value[2] == pytest.approx(np.log(2.0))
    np.testing.assert_array_equal(by_rv[3:], [0.5, 0.5])


def test_constrained_values_and_deterministics(simplex_model):
    target = BatchedTarget(simplex_model)
    draws = np.random.default_rng(2).normal(size=(6, target.ndim))
    values = target.compile_constrained(compile_kwargs=PYTHON_MODE)(draws)
    assert set(values) == {"p", "scale", "loc", "spread"}
    np.testing.assert_allclose(values["p"].sum(axis=1), 1.0)
    np.testing.assert_allclose(values["scale"], np.exp(draws[:, 2]))
    np.testing.assert_allclose(values["spread"], values["scale"][:, None] * values["p"])


def _categorical(x_data, y_data, total_size=None):
    with pm.Model() as m:
        w = pm.Normal("w", 0, 1, shape=(4, 3))
        pm.Categorical("y", logit_p=x_data @ w, observed=y_data, total_size=total_size)
    return m


def _matrix_normal(x_data, y_data, total_size=None):
    # a 2-D observation: total_size (300, None), whose None PyMC cannot rebuild
    with pm.Model() as m:
        w = pm.Normal("w", 0, 1, shape=(4, 3))
        pm.Normal("y", x_data @ w, 1.0, observed=y_data, total_size=total_size)
    return m


@pytest.mark.parametrize("build", [_categorical, _matrix_normal])
def test_the_full_data_log_density_of_a_minibatched_model(build):
    """pm.Categorical's log-density states the minibatch's length in a shape check, and a
    2-D observation's total_size has a None; the full-data log-density (the verdict's,
    diagnose's) equals the log-density of the same model on the whole data set."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(300, 4))
    if build is _categorical:
        y = rng.integers(0, 3, 300).astype("int32")
    else:
        y = rng.normal(size=(300, 3))

    minibatched = BatchedTarget(build(*pm.Minibatch(x, y, batch_size=32), total_size=300))
    points = rng.normal(size=(3, 12))
    full = BatchedTarget(build(x, y)).compile_logp()(points)
    np.testing.assert_allclose(minibatched.compile_logp(full_data=True)(points), full, rtol=1e-12)


def test_prior_draws_mark_what_the_prior_could_not_give():
    """The mode search's starts: draws of the prior in flat unconstrained coordinates, the
    model's initial values ignored; a Flat variable has no prior to draw from, and an ordered
    variable's prior draw is not ordered where its transform cannot map it (log of a negative
    difference): both are marked as not drawn. A HalfNormal's draw is its log."""
    with pm.Model() as model:
        pm.Flat("free", shape=2)
        pm.Normal("cut", 0, 3, shape=2, transform=ordered, initval=[-1.0, 1.0])
        pm.HalfNormal("scale", 2.0, initval=0.5)
    target = BatchedTarget(model)
    draws, drawn = target.prior_draws(np.arange(200))
    assert draws.shape == drawn.shape == (200, 5)
    assert not drawn[:, target.find("free").slice].any()
    cut = target.find("cut").slice
    assert drawn[:, cut.start].all()
    unmapped = ~drawn[:, cut.stop - 1]
    assert 0.3 < unmapped.mean() < 0.7  # an unordered pair half the time
    assert np.isfinite(draws[~unmapped]).all()
    scale = np.exp(draws[:, target.find("scale").slice][:, 0])
    assert drawn[:, target.find("scale").slice].all()
    assert 0.38 < np.mean(scale < 2.0 * 0.6745) < 0.62  # its median: 0.6745 sigma (3.4 se)
    assert np.isclose(np.std(scale), 2.0 * np.sqrt(1 - 2 / np.pi), rtol=0.2)
    np.testing.assert_array_equal(target.prior_draws(np.arange(200))[0], draws)


def test_prior_draws_of_a_model_with_an_undrawable_variable_mark_none():
    """A free ``CustomDist`` with a log-density and no ``random``: the prior cannot be drawn,
    so no coordinate is marked drawn (the mode search then starts from q widened)."""
    with pm.Model() as model:
        mu = pm.Normal("mu", 0, 1)
        pm.CustomDist("x", mu, logp=lambda value, mu: -0.5 * (value - mu) ** 2)
    draws, drawn = BatchedTarget(model).prior_draws(np.arange(3))
    assert draws.shape == (3, 2) and not drawn.any()
