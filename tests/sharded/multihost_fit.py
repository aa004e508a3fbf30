"""One process of a two-host run (``jax.distributed`` on this machine, 2 CPU devices each):
``python multihost_fit.py PROCESS_ID PORT`` fits the methods tested across hosts
(``names("multihost")`` in ``tests/methods.py``: GPF, GF and WVGD) with the particles split
across all 4 devices and prints, from process 0, each fit's trace and parameters as JSON.
Started by ``tests/test_jax.py::test_a_fit_across_two_hosts_equals_the_unsharded_one``."""

import json
import os
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"

import jax

process_id, port = int(sys.argv[1]), sys.argv[2]
jax.config.update("jax_cpu_collectives_implementation", "gloo")  # CPUs talk through gloo
jax.distributed.initialize(f"localhost:{port}", num_processes=2, process_id=process_id)

import warnings  # noqa: E402

import numpy as np  # noqa: E402
import pymc as pm  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from conftest import regression  # noqa: E402
from methods import names  # noqa: E402

import pymc_gpf  # noqa: E402, F401

warnings.simplefilter("ignore")
data = json.loads(sys.argv[3])
# the fits' numbers are compared, not their verdicts (check_draws=0); WVGD's first 100 steps
STEPS = {"wvgd": 100}
results = {}
for method in names("multihost"):
    with regression(np.asarray(data["x"]), np.asarray(data["y"])):
        approx = pm.fit(STEPS.get(method), method=method, random_seed=3, progressbar=False,
                        inf_kwargs={"devices": len(jax.devices())}, check_draws=0)  # fmt: skip
    results[method] = {
        "hist": approx.hist.tolist(),
        "params": [np.asarray(p.get_value()).tolist() for p in approx.params],
        "devices": approx.inference.settings()["devices"],
    }
if jax.process_index() == 0:
    print(json.dumps(results))
