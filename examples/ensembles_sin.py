"""The ensembles paper's many-minima experiment (Wild et al. 2023, slides "Number of
particles N_E when many local minima are present").

The loss -|sin(theta)| on a wide uniform prior, theta in [-1000 pi, 1000 pi], has 2000 local
minima. ``N_E = 20`` particles start from the same initialisation for the three kinds of
``pm.fit(method="ensemble")``: deep (gradient ascent of log p), Langevin and repulsive
Langevin (small temperature and repulsion, as the authors' defaults lambda2 = 1e-4,
lambda1 = 1e-3). The particles fall into the local minima nearest to where they start, most
alone in theirs, and end in the same minimum whatever the kind: the regulariser does not move
them between minima on this landscape (the slides' finding). The script prints how many
particles share their minimum with another and how many end in the same minimum for all
three kinds, and saves their final positions to ``ensembles_sin.png``.

Run: ``python examples/ensembles_sin.py [--steps N] [--out FILE] [--quick]``.
"""

import argparse
import os

import numpy as np
import pymc as pm

from matplotlib.figure import Figure

import pymc_gpf  # noqa: F401  (registers method="ensemble" with pm.fit)

HALF_WIDTH = 1000 * np.pi
KINDS = {
    "deep": {},
    "langevin": {"temperature": 1e-4},
    "repulsive": {"temperature": 1e-4, "repulsion": 1e-3},
}


def model() -> pm.Model:
    with pm.Model() as m:
        theta = pm.Uniform("theta", -HALF_WIDTH, HALF_WIDTH, default_transform=None, initval=0.0)
        pm.Potential("minus_loss", pm.math.abs(pm.math.sin(theta)))
    return m


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2000, help="steps of the Langevin kinds")
    parser.add_argument("--out", default="ensembles_sin.png")
    parser.add_argument("--quick", action="store_true", help="no progress bars")
    args = parser.parse_args()
    quick = args.quick or bool(os.environ.get("PYMC_GPF_EXAMPLES_QUICK"))
    minima = {}
    with model():
        for kind, options in KINDS.items():
            approx = pm.fit(
                args.steps if kind != "deep" else None, method="ensemble",
                inf_kwargs={
                    "kind": kind, "init": "initial_point", "init_scale": HALF_WIDTH / 3,
                    **options,
                },
                learning_rate=None if kind == "deep" else 0.05, random_seed=7,
                progressbar=not quick,
            )  # fmt: skip
            theta = approx.particles[:, 0]
            # the minimum a particle sits in: the nearest theta = pi/2 + k pi
            minima[kind] = np.round((theta - np.pi / 2) / np.pi).astype(int)
            alone = np.sum(np.unique(minima[kind], return_counts=True)[1] == 1)
            print(f"{kind}: {alone} of {len(theta)} particles alone in their minimum")
    same = np.sum((minima["deep"] == minima["langevin"]) & (minima["deep"] == minima["repulsive"]))
    print(f"same minimum for all three kinds: {same} of {len(minima['deep'])} particles")
    fig = Figure(figsize=(8, 2.6))
    ax = fig.subplots()
    for row, k in enumerate(minima.values()):
        ax.scatter(np.pi / 2 + k * np.pi, np.full(len(k), row), marker="|", s=200)
    ax.set_yticks(range(len(minima)), list(minima))
    ax.set_xlim(-HALF_WIDTH, HALF_WIDTH)
    ax.set_xlabel("theta (final particles; the loss -|sin theta| has 2000 minima)")
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(f"final particles saved to {args.out}")


if __name__ == "__main__":
    main()
